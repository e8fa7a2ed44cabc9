"""Timing shared by the benchmarks: CUDA events around each call on a GPU, perf_counter elsewhere."""

from __future__ import annotations

import json
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


def graphed(
    fn: Callable[[], object], calls: int = 1, capture_error_mode: str = "global"
) -> Callable[[], None]:
    """``calls`` back-to-back calls of ``fn`` captured once as a CUDA graph (after a warm-up call, so
    lazy initialisation stays out of it); returns the graph's replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for _ in range(calls):
            fn()
    return graph.replay


def median_ms(fn: Callable[[], object], device: str, warmup: int, runs: int) -> dict:
    """Median over warm runs; the first call's wall time is reported apart (JIT, autotuning)."""
    _, first = timed(fn, device)
    for _ in range(warmup):
        fn()
    times = [timed(fn, device)[1] for _ in range(runs)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "first_call_ms": first}


def interleaved(variants: dict[str, Callable[[], object]], device: str, rounds: int, calls: int) -> dict:
    """``calls`` timed calls of each variant in turn, ``rounds`` times, so clock drift over the run hits
    every variant alike. Per variant: the median of all calls, each round's median and their spread (ms)."""
    samples: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append([timed(fn, device)[1] for _ in range(calls)])
    stats = {}
    for name, per_round in samples.items():
        round_medians = [statistics.median(r) for r in per_round]
        stats[name] = {
            "median_ms": statistics.median(t for r in per_round for t in r),
            "round_medians_ms": round_medians,
            "spread_ms": max(round_medians) - min(round_medians),
        }
    return stats


def write_json(results: dict, path: str | None) -> None:
    """The results as JSON at ``path`` (nothing when no path was given)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def cudnn_backend_for(model: torch.nn.Module) -> None:
    """Diffusers' cuDNN attention switch for one baseline model only. ``set_attention_backend`` also sets
    Diffusers' process-wide backend, which every other model in the process (ours included: a user's
    Diffusers choice wins there) would then follow; put that global back to Diffusers' default."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    model.set_attention_backend("_native_cudnn")
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
