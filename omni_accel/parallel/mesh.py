"""The process groups of one ParallelConfig, from torch.distributed's DeviceMesh.

Mesh dims, outermost first: cfg, ring, ulysses, tp. Tensor parallelism is innermost so its ranks (which
talk at every layer) are neighbours on one host's NVLink; CFG branches, which exchange one tensor per step,
are outermost and may span hosts.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelConfig

_DIMS = ("cfg", "ring", "ulysses", "tp")


@dataclass
class ParallelState:
    config: ParallelConfig
    mesh: DeviceMesh | None
    device: torch.device

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The group of ``dim``, or None when its degree is 1 (layers then skip communication)."""
        if self.mesh is None or getattr(self.config, dim) == 1:
            return None
        return self.mesh.get_group(dim)


def init_parallel(config: ParallelConfig) -> ParallelState:
    """Joins (or starts, from torchrun's environment) the default process group and builds the mesh."""
    if config.world_size == 1 and not dist.is_initialized():
        return ParallelState(config, None, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                f"{config} needs {config.world_size} processes: launch the script with "
                f"`torchrun --nproc-per-node {config.world_size} script.py` (or init torch.distributed yourself)."
            )
        config.check_world_size(int(os.environ["WORLD_SIZE"]))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.timeout_s))
    config.check_world_size(dist.get_world_size())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device = (
        torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0)))
        if device_type == "cuda"
        else torch.device("cpu")
    )
    shape = tuple(getattr(config, d) for d in _DIMS)
    backend = dist.get_backend()
    # One options object per group: creating a group writes its ranks and name into the object it is given.
    overrides = {d: _group_options(backend, config.timeout_s) for d in _DIMS if getattr(config, d) > 1}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=_DIMS, backend_override=overrides)
    return ParallelState(config, mesh, device)


def _group_options(backend: str, timeout_s: float) -> tuple[str, object]:
    """Every layout group waits ``timeout_s``: a new group would otherwise take torch's default (30 min
    on gloo), and one spanning all ranks would reuse the default group, whose timeout the user may have
    set otherwise."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return backend, options


def is_main_process() -> bool:
    """True on global rank 0, or when torch.distributed is not in use: where a script saves its outputs."""
    return not dist.is_initialized() or dist.get_rank() == 0
