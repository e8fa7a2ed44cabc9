"""Timing shared by the benchmarks: CUDA events around each call on a GPU, perf_counter elsewhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], device: str) -> tuple[object, float]:
    """Runs ``fn`` once; returns its result and the elapsed milliseconds."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1000


def median_ms(fn: Callable[[], object], device: str, warmup: int, runs: int) -> dict:
    """Median over warm runs; the first call's wall time is reported apart (JIT, autotuning)."""
    _, first = timed(fn, device)
    for _ in range(warmup):
        fn()
    times = [timed(fn, device)[1] for _ in range(runs)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "first_call_ms": first}
