"""The VAE under a layout: which of its coders split over the ranks by rows, and the splits each pipeline
made (a copy of a split coder that no pipeline owns is taken over by the copy of the pipeline).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch.distributed as dist
from diffusers import DiffusionPipeline
from torch import nn

from ..config import AccelConfig
from ..forward_hooks import installed
from ..parallel import vae as vae_split
from ..report import ComponentReport, shared_mode

# The VAE coders a pipeline's layout split (``split_vae``): a copy of a from_pipe sibling's VAE, split as
# the one it copied and by no pipeline, is the copy's to undo (``adopt_orphans``), as its transformer is.
SPLIT_CODERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def split_vae(pipe: DiffusionPipeline, vae_coders: list[nn.Module]) -> list[Callable[[], None]]:
    undo = []
    for coder in vae_coders:
        row_split = vae_split.RowSplit(coder, dist.group.WORLD)
        row_split.install()
        SPLIT_CODERS.add(coder)
        undo.append(functools.partial(unsplit, coder, row_split))
    return undo


def unsplit(coder: nn.Module, row_split: vae_split.RowSplit) -> None:
    row_split.uninstall()
    SPLIT_CODERS.discard(coder)


def split_detail(split: list[str]) -> str:
    """What the VAE report says of the coders ``split`` by rows."""
    return (
        f"{' and '.join(split)} split over {dist.get_world_size()} ranks by rows (halo rows exchanged, GroupNorm "
        "statistics reduced, the attention gathered); equal to one rank's up to float32 summation order"
    )


def plan_vae(
    pipe: DiffusionPipeline, config: AccelConfig, distributed: bool
) -> tuple[list[nn.Module], list[ComponentReport]]:
    """Under a parallel layout (``distributed``): which of the VAE's encoder and decoder split over the ranks by
    rows (checked before anything is swapped); and the report line, also of a VAE another pipeline split."""
    vae = getattr(pipe, "vae", None)
    coders = {name: getattr(vae, name, None) for name in ("decoder", "encoder")}
    coders = {name: coder for name, coder in coders.items() if isinstance(coder, nn.Module)}
    shared = {
        name: coder for name, coder in coders.items() if installed(coder, vae_split.RowSplit) is not None
    }
    if shared:  # split by another pipeline holding this VAE (from_pipe): a second split would run whole
        if config.vae_parallel is False:
            raise ValueError(
                f"vae_parallel=False cannot keep pipe.vae ({type(vae).__name__}) whole: it is shared with another "
                f"pipeline (from_pipe) whose layout splits its {' and '.join(shared)} by rows. Accelerate without "
                "vae_parallel to share that split, or omni_accel.restore() the other pipeline first."
            )
        detail = (
            f"{' and '.join(shared)} split by rows by another pipeline that shares this VAE (from_pipe), as that "
            "one set it up; restore that pipeline to undo"
        )
        report = ComponentReport("vae", type(vae).__name__, shared_mode("patch-parallel"), detail)
        report.row_split = shared
        return [], [report]
    if not distributed:
        if config.vae_parallel and config.parallel != "auto" and vae is not None:
            why = "vae_parallel=True splits the VAE over a parallel layout's ranks, and none runs here: it runs whole"
            return [], [ComponentReport("vae", type(vae).__name__, "untouched", why)]
        return [], []
    if not coders:
        return [], []
    if config.vae_parallel is False:  # said, as every option asked off is
        why = "runs whole on every rank, as vae_parallel=False asks"
        return [], [ComponentReport("vae", type(vae).__name__, "untouched", why)]
    reasons = {name: vae_split.supports(coder) for name, coder in coders.items()}
    if reasons.get("decoder") is not None:
        if config.vae_parallel:
            raise ValueError(
                f"vae_parallel=True cannot split pipe.vae ({type(vae).__name__})'s decoder: {reasons['decoder']}. "
                "Leave vae_parallel unset (the VAE then runs whole on every rank)."
            )
        why = f"runs whole on every rank: {reasons['decoder']}"
        return [], [ComponentReport("vae", type(vae).__name__, "untouched", why)]
    split = [name for name, reason in reasons.items() if reason is None]
    report = ComponentReport("vae", type(vae).__name__, "patch-parallel", split_detail(split))
    report.row_split = {name: coders[name] for name in split}  # describe reads their splits' counts
    return list(report.row_split.values()), [report]
