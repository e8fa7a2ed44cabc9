"""Where a two-GPU FLUX.1-dev step (or Wan 2.1 14B forward) spends its time, per layout: kernel families,
communication, how much of it is exposed (no compute kernel running beside it), GPU idle time and the
host's launch time; the step with and without CUDA graphs.

    torchrun --nproc-per-node 2 benchmarks/parallel_profile.py --out parallel_profile.json
    torchrun --nproc-per-node 2 benchmarks/parallel_profile.py --model wan --layouts ulysses2 --rounds 1
    torchrun --nproc-per-node 2 benchmarks/parallel_profile.py --compile --layouts tp2 1gpu
    torchrun --nproc-per-node 2 benchmarks/parallel_profile.py --layouts ulysses2 ulysses2+packed_inputs
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from flux_profile import family
from flux_step import bare_pipeline, build_transformer, graphs_switched, inputs
from layout_variants import configured
from random_models import WAN_14B, randomized
from timing import interleaved, write_json
from torch.profiler import ProfilerActivity, profile

import omni_accel
from omni_accel import ParallelConfig

LAYOUTS = {
    "1gpu": None,
    "tp2": ParallelConfig(tp=2),
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def timeline(fn, steps: int, trace: str | None = None) -> dict:
    """Kernel time per family, communication exposed beside compute and GPU idle, per step (ms); the
    profiler's Chrome trace written to ``trace`` when given."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    families: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    compute, comm = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        label = family(event.name)
        span = (event.time_range.start, event.time_range.end)
        families[label] += (span[1] - span[0]) / 1000 / steps
        kernels[f"{label}: {event.name[:100]}"] += (span[1] - span[0]) / 1000 / steps
        (comm if label == "communication" else compute).append(span)
    compute, comm = _union(compute), _union(comm)
    busy = _union(compute + comm)
    window = busy[-1][1] - busy[0][0] if busy else 0.0
    return {
        "kernels_ms": dict(families),
        "communication_exposed_ms": (_length(comm) - _overlap(comm, compute)) / 1000 / steps,
        "gpu_idle_ms": (window - _length(busy)) / 1000 / steps,
        "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:15]),
    }


def host_ms(fn, runs: int = 3) -> float:
    """The host's time to launch one step (no sync inside; the GPU queue is drained before each)."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    torch.cuda.synchronize()
    return statistics.median(times)


def _flux(device: str, dtype: torch.dtype):
    """FLUX.1-dev at 1024x1024 (4096 image + 512 text tokens)."""
    return bare_pipeline(build_transformer(device, dtype)), inputs(1, 4096, 512, device, dtype)


def _wan(device: str, dtype: torch.dtype):
    """Wan 2.1 14B at 480x832, 81 frames (32760 video + 512 text tokens)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = randomized(WanTransformer3DModel(**WAN_14B), dtype)
    g = torch.Generator(device).manual_seed(1)
    x = dict(
        hidden_states=torch.randn(1, 16, 21, 60, 104, generator=g, device=device, dtype=dtype),
        timestep=torch.full((1,), 500.0, device=device),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=g, device=device, dtype=dtype),
        return_dict=False,
    )
    return WanPipeline(None, None, None, FlowMatchEulerDiscreteScheduler(), transformer=model), x


MODELS = {"flux": _flux, "wan": _wan}


def _trace_path(directory: str | None, layout: str) -> str | None:
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{layout}_rank{dist.get_rank()}.json")


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="profiled steps per layout")
    parser.add_argument("--model", choices=list(MODELS), default="flux")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--trace-dir", help="write each rank's Chrome trace of the replayed steps here")
    parser.add_argument("--compile", action="store_true", help="accelerate with compile=True")
    parser.add_argument("--watchdog-s", type=float, default=0, help="dump the stacks and exit after this")
    args = parser.parse_args(argv)
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device, dtype = f"cuda:{torch.cuda.current_device()}", torch.bfloat16
    results = {}
    for name in args.layouts:
        base, layout = configured(name, LAYOUTS)  # e.g. ulysses2+one_stage: layout_variants.py
        pipe, x = MODELS[args.model](device, dtype)
        compiled = {"compile": True, "compile_in_background": False} if args.compile else {}

        def step(pipe=pipe, x=x):
            return pipe.transformer(**x)

        omni_accel.accelerate(pipe, parallel=layout, **compiled)
        eager, graphs = graphs_switched(pipe, step, False), graphs_switched(pipe, step, True)
        for _ in range(3):  # warm-up; the graph captures on its second call
            eager(), graphs()
        times = interleaved({"eager": eager, "graphs": graphs}, device, args.rounds, 3)
        result = {
            "eager_ms_per_step": times["eager"]["median_ms"],
            "graphs_ms_per_step": times["graphs"]["median_ms"],
            "host_launch_ms_eager": host_ms(eager),
            "profile_eager": timeline(eager, args.steps),
            "profile_graphs": timeline(graphs, args.steps, _trace_path(args.trace_dir, name)),
        }
        results[name] = result
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, result)
        if omni_accel.is_main_process():
            print(name, result, flush=True)
            for rank, r in enumerate(per_rank):  # the ranks wait for the slower one: compare them
                p = r["profile_graphs"]
                kernels = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["kernels_ms"].items()))
                print(
                    f"  rank {rank} graphs: {kernels} | exposed {p['communication_exposed_ms']:.1f}",
                    flush=True,
                )
        del pipe, eager, graphs, step
        gc.collect()
        torch.cuda.empty_cache()
    if omni_accel.is_main_process():
        for name, r in results.items():
            p = r["profile_eager"]
            kernels = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["kernels_ms"].items()))
            print(
                f"{name:9s} eager {r['eager_ms_per_step']:.1f} graphs {r['graphs_ms_per_step']:.1f} "
                f"host {r['host_launch_ms_eager']:.1f} | {kernels} | comm exposed "
                f"{p['communication_exposed_ms']:.1f} idle {p['gpu_idle_ms']:.1f} | graphs: exposed "
                f"{r['profile_graphs']['communication_exposed_ms']:.1f} idle {r['profile_graphs']['gpu_idle_ms']:.1f}"
            )
        write_json(results, args.out)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
