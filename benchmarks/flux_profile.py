"""Where a FLUX.1-dev step spends its GPU time: kernel families (GEMM, attention, elementwise) per step for
Diffusers' untouched module and for omni_accel eager and compiled, from torch.profiler.

    python benchmarks/flux_profile.py --out profile.json
"""

from __future__ import annotations

import argparse
import gc
from collections import defaultdict

import torch
from flux_step import bare_pipeline, build_transformer, inputs
from timing import write_json
from torch.profiler import ProfilerActivity, profile

import omni_accel

_FAMILIES = (
    ("communication", ("nccl",)),
    # inductor's fused kernels (names list the ops they fuse) and ours (whose GELU writes next to the
    # attention output: "concat" in its name, elementwise work all the same)
    (
        "elementwise / norm / other",
        ("triton_", "_norm_modulate", "_gated_residual", "_concat_gelu", "_qkv_norm", "_quantize"),
    ),
    ("attention", ("fmha", "flash", "cudnn", "attention", "sdpa", "fprop")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk")),
    ("copy / concat", ("copy", "cat", "memcpy", "memset")),
)


def family(kernel: str) -> str:
    name = kernel.lower()
    for label, markers in _FAMILIES:
        if any(marker in name for marker in markers):
            return label
    return "elementwise / norm / other"


def kernel_table(fn, steps: int, x: dict) -> dict:
    for _ in range(2):
        fn(**x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(**x)
        torch.cuda.synchronize()
    totals, top = defaultdict(float), defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.self_device_time_total / 1000 / steps
            totals[family(event.key)] += ms
            top[event.key] += ms
    biggest = dict(sorted(top.items(), key=lambda kv: -kv[1])[:16])
    return {"per_step_ms": dict(totals), "total_ms": sum(totals.values()), "top_kernels_ms": biggest}


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["diffusers_default", "omni_eager", "omni_compiled"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    x = inputs(1, 4096, 512, device, dtype)
    results = {}
    if "diffusers_default" in args.variants:
        results["diffusers_default"] = kernel_table(build_transformer(device, dtype).__call__, args.steps, x)
    variants = {
        "omni_eager": {},
        "omni_compiled": {"compile": True, "compile_in_background": False},
        "omni_fp8": {"quantize": "fp8"},
    }
    for name, options in variants.items():
        if name not in args.variants:
            continue
        model = build_transformer(device, dtype)
        pipe = omni_accel.accelerate(bare_pipeline(model), cuda_graphs=False, **options)
        results[name] = kernel_table(pipe.transformer.__call__, args.steps, x)
        del pipe, model
        gc.collect()
    for name, table in results.items():
        families = ", ".join(f"{k} {v:.1f}" for k, v in sorted(table["per_step_ms"].items()))
        print(f"{name:18s} kernels {table['total_ms']:.1f} ms/step: {families}")
        for kernel, ms in table["top_kernels_ms"].items():
            print(f"    {ms:7.2f} ms  {kernel[:110]}")
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
