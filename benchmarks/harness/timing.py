"""Timing shared by the benchmarks: CUDA events around each call on a GPU, perf_counter elsewhere."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

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


def interleaved(
    variants: dict[str, Callable[[], object]],
    device: str,
    rounds: int,
    calls: int,
    before: dict[str, Callable[[], None]] | None = None,
) -> dict:
    """``calls`` timed calls of each variant in turn, ``rounds`` times, so clock drift over the run hits
    every variant alike. ``before[name]``, where given, readies a variant that shares its model with
    another (a step cache switched on or off) before its calls of each round, followed by one untimed
    call. Per variant: the median of all calls, each round's median and their spread (ms)."""
    samples: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            if before and name in before:
                before[name]()
                fn()
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


def wall(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device synchronized on both sides (a first call: compiles and
    kernel builds included)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def sustained(fn: Callable[[], Any], seconds: float) -> dict[str, float]:
    """``fn`` called back to back for ``seconds`` while ``nvidia-smi`` samples the SM clock and the board
    power every 100 ms: whether a variant that keeps the GPU busier runs at lower clocks (an H200 sits at
    its 700 W cap under dense GEMMs). Mean ms per call (CUDA events around the whole window / calls),
    median clock (MHz) and power (W) over the window's second half."""
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    end.record()
    torch.cuda.synchronize()
    sampler.terminate()
    rows = [line.split(",") for line in sampler.communicate()[0].splitlines() if line.count(",") == 1]
    rows = rows[len(rows) // 2 :]
    return {
        "ms_per_call": start.elapsed_time(end) / calls,
        "calls": calls,
        "sm_clock_mhz": statistics.median(float(r[0]) for r in rows) if rows else float("nan"),
        "power_w": statistics.median(float(r[1]) for r in rows) if rows else float("nan"),
    }


def write_json(results: dict, path: str | None) -> None:
    """The results as JSON at ``path`` (nothing when no path was given)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
