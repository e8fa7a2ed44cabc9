"""The process groups of one ParallelConfig, from torch.distributed's DeviceMesh.

Mesh dims, outermost first: cfg, ring, ulysses, tp. Tensor parallelism is innermost so its ranks (which
talk at every layer) are neighbours on one host's NVLink; CFG branches, which exchange one tensor per step,
are outermost and may span hosts.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..cuda_graphs import release_all
from .config import ParallelConfig
from .held_groups import refuse_pickle
from .peer_memory import forget_groups

_DIMS = ("cfg", "ring", "ulysses", "tp")


class _Users:
    """What a layout's states share with their deep copies: the states still using the groups, and the
    gloo group of the ranks holding one batch (made at the first ``host_group`` call)."""

    def __init__(self) -> None:
        self.states: list[weakref.ref[ParallelState]] = []
        self.host: dist.ProcessGroup | None = None
        self.host_made = False

    def others(self, state: ParallelState) -> bool:
        """Whether a state other than ``state`` still uses the groups."""
        return any((s := ref()) is not None and s is not state and s.mesh is not None for ref in self.states)


@dataclass(eq=False)
class ParallelState:
    """A layout's mesh of process groups. A deep copy (of a pipeline: the state is not reachable from its
    transformer) shares the groups; the last one closed destroys them. Pickling refuses (see
    ``held_groups``)."""

    config: ParallelConfig
    mesh: DeviceMesh | None
    device: torch.device
    users: _Users = field(default_factory=_Users, repr=False)

    def __post_init__(self) -> None:
        self.users.states.append(weakref.ref(self))

    def __deepcopy__(self, memo: dict) -> ParallelState:
        twin = ParallelState(self.config, self.mesh, self.device, self.users)
        memo[id(self)] = twin
        return twin

    def __reduce__(self):
        if self.mesh is None:
            return ParallelState, (self.config, None, self.device)
        refuse_pickle(f"The {self.config} layout of an accelerated pipeline")

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The group of ``dim``, or None when its degree is 1 (layers then skip communication)."""
        if self.mesh is None or getattr(self.config, dim) == 1:
            return None
        return self.mesh.get_group(dim)

    def host_group(self) -> dist.ProcessGroup | None:
        """A gloo group of the ranks that hold the same batch (every dimension but cfg), for what they decide
        together on the host, such as the projection cache's hits; None where that is this rank alone.
        Every rank must call it (each group is made by all). It waits ``timeout_s``, as the layout's groups do."""
        if self.mesh is None or self.config.world_size == self.config.cfg:
            return None
        if not self.users.host_made:  # one per layout, shared by its components and copies
            timeout = datetime.timedelta(seconds=self.config.timeout_s)
            for ranks in self.mesh.mesh.flatten(1).tolist():  # one row per cfg branch
                group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if dist.get_rank() in ranks:
                    self.users.host = group
            self.users.host_made = True
        return self.users.host

    def close(self) -> None:
        """Destroys the groups this layout's mesh made (``restore`` does, on every rank): each holds
        communicators (NCCL's hold GPU memory) that would otherwise outlive the pipeline, a new set for every
        ``accelerate``. The default group stays. While a deep copy of the pipeline still uses them (not
        restored, not collected), they stay for it."""
        if self.mesh is None:
            return
        made = {id(g): g for g in self.mesh.get_all_groups() if g is not dist.group.WORLD}
        self.mesh = None
        if self.users.others(self):
            gc.collect()  # a copy dropped in a reference cycle is not using them
            if self.users.others(self):
                return
        host, self.users.host = self.users.host, None
        if host is not None:
            dist.destroy_process_group(host)
        if not made:
            return
        release_all()  # graphs may hold NCCL operations of their communicators
        forget_groups([group.group_name for group in made.values()])
        for group in made.values():
            dist.destroy_process_group(group)


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
        atexit.register(_leave_the_group_we_started)
    config.check_world_size(dist.get_world_size())
    device_type = device_type_of(dist.get_backend())
    device = (
        torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0)))
        if device_type == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        # A group started without torch.cuda.set_device leaves every rank on GPU 0; the layout's kernels,
        # streams and peer buffers follow the current device, so make it the rank's own.
        torch.cuda.set_device(device)
    shape = tuple(getattr(config, d) for d in _DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=_DIMS)
    _bound_waits(mesh, config)
    return ParallelState(config, mesh, device)


def _leave_the_group_we_started() -> None:
    """Destroys the default group this process started, at exit, after giving the collectives' worker
    threads the GIL for a moment. A gloo worker that has just finished a collective frees its tensors, which
    needs the GIL when their Python objects are already gone; if the interpreter started finalizing before
    it got the GIL, Python ends that thread and the process aborts ("terminate called without an active
    exception", SIGABRT: a core dump of the torchrun example test showed a ``ProcessGroupGloo::runLoop``
    thread in ``take_gil`` -> ``PyThread_exit_thread`` while freeing an all-gather's outputs). A rank that
    exits within a few milliseconds of its last collective hit it: 3 of 23 runs with nothing done here,
    1 in 100 (and 1 in 15) with the group destroyed but no pause. Step graphs holding NCCL operations are
    freed first (destroying the group waits for them), and the peer buffers (Ulysses', tensor parallelism's)
    with them."""
    if dist.is_initialized():
        time.sleep(_WORKERS_FINISH_S)  # releases the GIL to a worker waiting for it
        release_all()
        forget_groups()
        dist.destroy_process_group()


_WORKERS_FINISH_S = 0.05


def device_type_of(backend: str) -> str:
    """Where a process group's collectives run: CUDA when it has NCCL, also in the ``cpu:gloo,cuda:nccl``
    pair that a plain ``init_process_group()`` starts on a GPU machine."""
    return "cuda" if "nccl" in str(backend) else "cpu"


def _bound_waits(mesh: DeviceMesh, config: ParallelConfig) -> None:
    """The layout's own groups wait ``config.timeout_s`` (torch starts a new group with its default: 10
    minutes on NCCL, 30 on gloo); a dimension spanning all ranks uses the default group, which keeps the
    timeout it was started with (``timeout_s`` too when ``accelerate`` started it)."""
    timeout = datetime.timedelta(seconds=config.timeout_s)
    groups = [mesh.get_group(dim) for dim in _DIMS if getattr(config, dim) > 1]
    for group in groups:
        if group is not dist.group.WORLD:
            _set_pg_timeout(timeout, group)


def is_main_process() -> bool:
    """True on global rank 0, or when torch.distributed is not in use: where a script saves its outputs."""
    return not dist.is_initialized() or dist.get_rank() == 0
