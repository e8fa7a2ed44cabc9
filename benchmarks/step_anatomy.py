"""Where a replayed FLUX.1-dev step's wall time goes that its kernels do not account for: sustained
per-step times (clock or power drift over a long run), then one profiled replay's kernel time against its
span (the idle gaps between kernels inside the graph), and the largest gaps with the kernels around them.

    python benchmarks/step_anatomy.py --steps 40 --out anatomy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import torch
from flux_profile import family
from flux_step import bare_pipeline, build_transformer, inputs
from timing import timed, write_json
from torch.profiler import ProfilerActivity, profile

import omni_accel


def sustained(fn, steps: int) -> list[float]:
    """Back-to-back steps, each timed with CUDA events (no host sync between them but the timing's)."""
    return [timed(fn, "cuda")[1] for _ in range(steps)]


def matmul_drift(seconds: float = 3.0) -> list[float]:
    """TFLOP/s of back-to-back 8192^3 bf16 products over ``seconds``: does the GEMM rate hold when sustained?"""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rates, spent = [], 0.0
    while spent < seconds * 1000:
        _, ms = timed(lambda: [a @ b for _ in range(20)], "cuda")
        spent += ms
        rates.append(20 * 2 * 8192**3 / ms / 1e9)
    return rates


def gaps(fn, steps: int = 2) -> dict:
    """Kernel time vs span of ``steps`` profiled calls, from the profiler's trace."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in events)
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    holes = []
    for before, after in zip(events, events[1:], strict=False):
        hole = after["ts"] - (before["ts"] + before["dur"])
        holes.append((hole, before["name"][:60], after["name"][:60]))
    holes.sort(key=lambda h: -h[0])
    by_family, by_kernel, launches = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in events:
        by_family[family(e["name"])] += e["dur"] / 1000 / steps
        by_kernel[e["name"][:90]] += e["dur"] / 1000 / steps
        launches[e["name"][:90]] += 1
    small = [h for h, *_ in holes if h <= 20]
    return {
        "kernels_per_step": len(events) / steps,
        "busy_ms_per_step": busy / 1000 / steps,
        "span_ms_per_step": span / 1000 / steps,
        "idle_ms_per_step": (span - busy) / 1000 / steps,
        "gaps_under_20us_ms_per_step": sum(small) / 1000 / steps,
        "median_gap_us": statistics.median(h for h, *_ in holes),
        "largest_gaps": holes[:12],
        "family_ms_per_step": dict(by_family),
        "top_kernels": [
            (name, ms, launches[name] // steps)
            for name, ms in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]
        ],
    }


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {"matmul_tflops_sustained": matmul_drift()}
    x = inputs(1, 4096, 512, "cuda", torch.bfloat16)
    pipe = omni_accel.accelerate(bare_pipeline(build_transformer("cuda", torch.bfloat16)))
    graphs = omni_accel.describe(pipe).components[0].graphs
    step = lambda: pipe.transformer(**x)  # noqa: E731
    for mode, on in (("replayed", True), ("eager", False)):
        graphs.enabled = on
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        times = sustained(step, args.steps)
        results[mode] = {"step_ms": times, "median_ms": statistics.median(times), **gaps(step)}
    for key, value in results.items():
        if key.startswith("matmul"):
            print(f"matmul TFLOP/s over 3 s: {' '.join(f'{r:.0f}' for r in value)}")
            continue
        print(
            f"{key}: median {value['median_ms']:.1f} ms; steps {' '.join(f'{t:.1f}' for t in value['step_ms'])}"
        )
        print(
            f"  {value['kernels_per_step']:.0f} kernels, busy {value['busy_ms_per_step']:.1f} ms, span "
            f"{value['span_ms_per_step']:.1f} ms, idle {value['idle_ms_per_step']:.1f} ms (gaps <= 20 us: "
            f"{value['gaps_under_20us_ms_per_step']:.1f} ms, median gap {value['median_gap_us']:.1f} us)"
        )
        print(
            "  families: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(value["family_ms_per_step"].items()))
        )
        for name, ms, count in value["top_kernels"]:
            print(f"    {ms:7.2f} ms {count:4d}x  {name}")
        for hole, before, after in value["largest_gaps"][:4]:
            print(f"    gap {hole:8.1f} us after {before} before {after}")
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
