"""What a profiled step's time is made of, from torch.profiler: the kernels by family (GEMM, attention,
elementwise / norm, copies, communication) and the largest of them, busy time against the span (the idle
gaps between kernels and the kernels on each side of the largest), the communication no compute ran beside,
and the host's time to launch a step.

On CPU (the tiny smoke runs) there are no kernels: the outermost CPU ops give the busy intervals and every
op's self time gives the families, so that the same tables come out.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

_FAMILIES = (
    ("communication", ("nccl", "c10d::")),
    # inductor's fused kernels (names list the ops they fuse) and ours (whose GELU writes next to the
    # attention output: "concat" in its name, elementwise work all the same)
    (
        "elementwise / norm / other",
        ("triton_", "_norm_modulate", "_gated_residual", "_concat_gelu", "_qkv_norm", "_quantize"),
    ),
    ("attention", ("fmha", "flash", "cudnn", "attention", "sdpa", "fprop")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk", "addmm", "aten::mm", "bmm")),
    ("copy / concat", ("copy", "cat", "memcpy", "memset")),
)


def family(kernel: str) -> str:
    """The family of a CUDA kernel (or, on CPU, an aten op) by its name."""
    name = kernel.lower()
    for label, markers in _FAMILIES:
        if any(marker in name for marker in markers):
            return label
    return "elementwise / norm / other"


class Activity(NamedTuple):
    """One kernel (or CPU op): times in microseconds. ``outer``: it counts towards the busy intervals (every
    kernel; on CPU only an op no other op holds, since an op's time includes its children's)."""

    name: str
    start: float
    end: float
    self_us: float
    outer: bool


def record(fn: Callable[[], Any], steps: int, device: str, trace: str | None = None) -> list[Activity]:
    """``steps`` back-to-back calls of ``fn`` under the profiler, sorted by start; the Chrome trace written
    to ``trace`` when given. Only the device's activity is profiled on CUDA, so that the host's launch gaps
    stay what they are without the profiler."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    if cuda:
        found = [
            Activity(e.name, e.time_range.start, e.time_range.end, e.time_range.elapsed_us(), True)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
    else:
        found = [
            Activity(
                e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total, e.cpu_parent is None
            )
            for e in prof.events()
        ]
    if not any(a.outer for a in found):
        raise RuntimeError(f"the profiler recorded no activity on {device} in {steps} calls")
    return sorted(found, key=lambda a: a.start)


def summarize(activities: list[Activity], steps: int) -> dict[str, Any]:
    """Per step (ms): busy time (the union of the kernels' intervals), the span from the first kernel's start
    to the last one's end, the idle time between; the gaps (us), the largest with the kernels on either side;
    kernel time by family and the top kernels with their launches per step."""
    outer = [a for a in activities if a.outer]
    holes = []  # (us, the kernel that ended last before the hole, the one after it)
    end, last = outer[0].end, outer[0].name
    for a in outer[1:]:
        if a.start > end:
            holes.append((a.start - end, last[:60], a.name[:60]))
        if a.end > end:
            end, last = a.end, a.name
    span = end - outer[0].start
    idle = sum(hole for hole, *_ in holes)
    holes.sort(key=lambda h: -h[0])
    by_family, by_kernel, launches = defaultdict(float), defaultdict(float), defaultdict(int)
    for a in activities:
        by_family[family(a.name)] += a.self_us / 1000 / steps
        by_kernel[a.name[:90]] += a.self_us / 1000 / steps
        launches[a.name[:90]] += 1
    return {
        "kernels_per_step": len(outer) / steps,
        "busy_ms_per_step": (span - idle) / 1000 / steps,
        "span_ms_per_step": span / 1000 / steps,
        "idle_ms_per_step": idle / 1000 / steps,
        "gaps_under_20us_ms_per_step": sum(h for h, *_ in holes if h <= 20) / 1000 / steps,
        "median_gap_us": statistics.median(h for h, *_ in holes) if holes else 0.0,
        "largest_gaps": holes[:12],
        "family_ms_per_step": dict(by_family),
        "top_kernels": [
            (name, ms, launches[name] // steps)
            for name, ms in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]
        ],
    }


def gaps(fn: Callable[[], Any], steps: int = 2, device: str = "cuda") -> dict[str, Any]:
    """Kernel time against span of ``steps`` profiled calls of ``fn``: ``summarize`` of ``record``."""
    return summarize(record(fn, steps, device), steps)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted unions of intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def exposed_ms(activities: list[Activity], steps: int) -> float:
    """Communication per step (ms) with no compute kernel running beside it: what a layout's collectives
    cost the step, where the family table says only how long they ran."""
    comm, compute = [], []
    for a in activities:
        if a.outer:
            (comm if family(a.name) == "communication" else compute).append((a.start, a.end))
    comm = _union(comm)
    return (sum(b - a for a, b in comm) - _overlap(comm, _union(compute))) / 1000 / steps


def host_ms(fn: Callable[[], Any], device: str, runs: int = 3) -> float:
    """The host's time to launch one step, no sync inside (median of ``runs``; the device's queue drained
    and, under a layout, the ranks lined up before each): a step is host-bound where this is above its GPU
    time. On CPU the host does the work itself, so this is the step's wall time."""
    times = []
    for _ in range(runs):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return statistics.median(times)
