"""Variants of a layout for A/B runs in one launch: ``ulysses2+normal_priority`` is ``ulysses2`` with the
library's choice undone or changed while that layout is built and timed. Benchmarks only.

    normal_priority   the layout's NCCL groups on normal-priority streams (the library asks for high)
    three_stages      Ulysses attention in three head stages (a quarter, a half, a quarter) instead of two
    overlapped        transfers beside every attention kernel, also those that hold every SM (FlashInfer's)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import omni_accel.parallel.mesh as mesh
import omni_accel.parallel.sequence as sequence
from omni_accel.attention.base import AttentionProvider
from omni_accel.attention.providers.flashinfer import FlashInferProvider


@contextlib.contextmanager
def _normal_priority() -> Iterator[None]:
    original = mesh._group_options

    def options(backend: str, timeout_s: float):
        backend, opts = original(backend, timeout_s)
        if backend == "nccl":
            opts.is_high_priority_stream = False
        return backend, opts

    mesh._group_options = options
    try:
        yield
    finally:
        mesh._group_options = original


@contextlib.contextmanager
def _three_stages() -> Iterator[None]:
    original = sequence.head_stages

    def stages(heads: int, degree: int) -> list[tuple[int, int]]:
        quarter = heads // 4 // degree * degree
        if degree == 1 or quarter < degree:
            return original(heads, degree)
        counts = [quarter, heads - 2 * quarter, quarter]
        return [(sum(counts[:i]), count) for i, count in enumerate(counts)]

    sequence.head_stages = stages
    try:
        yield
    finally:
        sequence.head_stages = original


@contextlib.contextmanager
def _overlapped() -> Iterator[None]:
    original = FlashInferProvider.occupies_every_sm
    FlashInferProvider.occupies_every_sm = AttentionProvider.occupies_every_sm
    try:
        yield
    finally:
        FlashInferProvider.occupies_every_sm = original


VARIANTS = {"normal_priority": _normal_priority, "three_stages": _three_stages, "overlapped": _overlapped}


def split(name: str) -> tuple[str, contextlib.AbstractContextManager]:
    """``"ulysses2+three_stages"`` -> ``("ulysses2", the variant's context)``; no suffix, no change."""
    base, _, variant = name.partition("+")
    return base, VARIANTS[variant]() if variant else contextlib.nullcontext()
