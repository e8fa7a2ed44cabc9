"""Variants of a layout for A/B runs in one launch: ``ulysses2+three_stages`` is ``ulysses2`` with one of
the library's choices changed while that layout is built and timed. Benchmarks only.

    three_stages      Ulysses attention in three head stages (a quarter, a half, a quarter) instead of two
    four_stages       Ulysses attention in four equal head stages
    one_stage         Ulysses attention in one stage (every head's transfers, then the kernel)
    nccl_exchange     Ulysses' exchanges by NCCL's all-to-all in two head stages, not by peer writes
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import omni_accel.parallel.peer_exchange as peer_exchange
import omni_accel.parallel.sequence as sequence


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
def _four_stages() -> Iterator[None]:
    original = sequence.head_stages

    def stages(heads: int, degree: int) -> list[tuple[int, int]]:
        if heads < 4 * degree:
            return original(heads, degree)
        counts = sequence.split_sizes(heads, 4)
        return [(sum(counts[:i]), count) for i, count in enumerate(counts)]

    sequence.head_stages = stages
    try:
        yield
    finally:
        sequence.head_stages = original


@contextlib.contextmanager
def _one_stage() -> Iterator[None]:
    original = sequence.head_stages
    sequence.head_stages = lambda heads, degree: [(0, heads)]
    try:
        yield
    finally:
        sequence.head_stages = original


@contextlib.contextmanager
def _nccl_exchange() -> Iterator[None]:
    peer_exchange.ENABLED = False
    try:
        yield
    finally:
        peer_exchange.ENABLED = True


VARIANTS = {
    "three_stages": _three_stages,
    "four_stages": _four_stages,
    "one_stage": _one_stage,
    "nccl_exchange": _nccl_exchange,
}


def split(name: str) -> tuple[str, contextlib.AbstractContextManager]:
    """``"ulysses2+three_stages"`` -> ``("ulysses2", the variant's context)``; no suffix, no change."""
    base, _, variant = name.partition("+")
    return base, VARIANTS[variant]() if variant else contextlib.nullcontext()
