"""What the layout benchmarks build: Diffusers' pipelines around a random transformer (no text encoders, no
VAE), and variants of a layout for A/B runs in one launch (a ``_lora`` layout's LoRA: ``models.with_lora``).

A variant: ``ulysses2+one_stage`` is ``ulysses2`` with one of its ``LayoutTuning`` choices (or
``batch_guidance``) changed; suffixes combine. Each variant is a config, so both sides of an A/B are built
in the same process and nothing in the library is patched.

    nccl_exchange      exchanges by NCCL's collectives, not by peer writes (tensor parallelism then keeps
                       every token on every rank, as it does without peer writes)
    packed_inputs      the exchanges pack q, k and v; the q/k kernel does not write them into the peers'
                       buffers (and nothing runs beside the exchanges)
    one_stage          Ulysses' exchanges in one head stage (every head's transfers, then the kernel)
    four_stages        Ulysses' exchanges in four head stages
    one_placed_stage   Ulysses with placed inputs in one kernel over a rank's heads at every length
    replicated_tokens  tensor parallelism with every token on every rank (an all-reduce after each
                       row-split projection)
    unstacked          a CFG pipeline's two calls per step one after the other, not stacked in one batch

Changes whose predecessor has no config (the A/Bs docs/archive/performance-history.md lists as pending a
two-GPU launch: ``+returned_apart``, ``+copied_gathers``, ``+streams_apart``, ``+modulation_per_block``)
compare against commit e357fac, where ``benchmarks/layout_variants.py`` still patched the library into
them: run the same launch with that commit's ``benchmarks/flux_parallel.py`` from a worktree of it
(``git worktree add ../before e357fac``; ``two_gpu_launch.sh flux-before``).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from diffusers import (
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    WanPipeline,
    WanTransformer3DModel,
)

from omni_accel import ParallelConfig

VARIANTS = {
    "nccl_exchange": {"peer_writes": False},
    "packed_inputs": {"place_inputs": False},
    "one_stage": {"head_stages": 1},
    "four_stages": {"head_stages": 4},
    "one_placed_stage": {"placed_stages_from": sys.maxsize},
    "replicated_tokens": {"split_tokens": False},
    "unstacked": {"batch_guidance": False},
}


def configured(name: str, layouts: dict[str, ParallelConfig | None]) -> tuple[str, ParallelConfig | None]:
    """``"ulysses2+one_stage"`` -> ``("ulysses2", layouts["ulysses2"] with one head stage)``; several
    suffixes combine; a layout of one GPU (None) takes none."""
    base, *variants = name.split("+")
    if base not in layouts:
        raise ValueError(f"unknown layout {base!r}; known: {list(layouts)}")
    config = layouts[base]
    if variants and config is None:
        raise ValueError(f"{name}: a one-GPU layout has no exchanges to vary")
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown layout variant {variant!r}; known: {sorted(VARIANTS)}")
        changes = VARIANTS[variant]
        if "batch_guidance" in changes:
            config = dataclasses.replace(config, **changes)
        else:
            config = dataclasses.replace(config, tuning=dataclasses.replace(config.tuning, **changes))
    return base, config


def bare_pipeline(transformer: torch.nn.Module) -> DiffusionPipeline:
    """The FluxPipeline or WanPipeline around ``transformer`` with no text encoders or VAE: its callers
    pass prompt embeddings and take latents, so only the denoising loop is timed."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    if isinstance(transformer, WanTransformer3DModel):
        pipe = WanPipeline(None, None, None, scheduler, transformer=transformer)
    else:
        pipe = FluxPipeline(scheduler, None, None, None, None, None, transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
