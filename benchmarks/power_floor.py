"""The floor under a FLUX.1-dev step on this GPU: only the step's GEMMs and attention calls (its shapes,
distinct random bf16 weights per block, cuBLAS and cuDNN as our step runs them), replayed from CUDA graphs
back to back as a denoising loop runs them, interleaved with omni_accel's whole step.

A short burst runs faster than a sustained loop where the card is held at its power limit (its clocks
drop); the floor that matters for a 28-step image is the sustained one, so both are reported.

    python benchmarks/power_floor.py --out floor.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from flux_step import bare_pipeline, build_transformer, inputs
from timing import graphed, timed, write_json
from torch.nn.attention import SDPBackend, sdpa_kernel

import omni_accel

DIM, MLP, HEADS, HEAD_DIM = 3072, 12288, 24, 128


def linear(tokens: int, fan_in: int, fan_out: int, device: str) -> tuple:
    x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16)
    w = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16) * 0.02
    return x, w, torch.randn(fan_out, device=device, dtype=torch.bfloat16) * 0.02


def step_work(image: int, text: int, doubles: int, singles: int, device: str):
    """The GEMMs (modulation GEMVs included) and attention calls of one step, as two callables."""
    tokens = image + text
    gemms = []
    for _ in range(doubles):
        for rows in (image, text):
            gemms += [
                linear(1, DIM, 6 * DIM, device),
                linear(rows, DIM, 3 * DIM, device),
                linear(rows, DIM, DIM, device),
                linear(rows, DIM, MLP, device),
                linear(rows, MLP, DIM, device),
            ]
    for _ in range(singles):
        gemms += [linear(1, DIM, 3 * DIM, device), linear(tokens, DIM, 3 * DIM + MLP, device)]
        gemms += [linear(tokens, DIM + MLP, DIM, device)]
    qkv = [torch.randn(1, HEADS, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(3)]

    def run_gemms():
        for x, w, b in gemms:
            F.linear(x, w, b)

    def run_attention():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(doubles + singles):
                F.scaled_dot_product_attention(*qkv)

    flops = sum(2 * x.shape[0] * w.shape[0] * w.shape[1] for x, w, _ in gemms)
    flops_attention = (doubles + singles) * 4 * tokens * tokens * HEADS * HEAD_DIM
    return run_gemms, run_attention, flops, flops_attention


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28, help="back-to-back steps per sustained run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    run_gemms, run_attention, flops, flops_attention = step_work(4096, 512, 19, 38, "cuda")
    gemms, attention = graphed(run_gemms), graphed(run_attention)
    both = graphed(lambda: (run_gemms(), run_attention()))
    x = inputs(1, 4096, 512, "cuda", torch.bfloat16)
    pipe = omni_accel.accelerate(bare_pipeline(build_transformer("cuda", torch.bfloat16)))
    for _ in range(3):
        pipe.transformer(**x)
    variants = {
        "gemms": gemms,
        "attention": attention,
        "gemms + attention": both,
        "omni_accel step": lambda: pipe.transformer(**x),
    }
    burst, sustained = {n: [] for n in variants}, {n: [] for n in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            time.sleep(2.0)  # the card cools to idle: the next call runs at full clocks
            burst[name].append(timed(fn, "cuda")[1])
            sustained[name] += [timed(fn, "cuda")[1] for _ in range(args.steps)][args.steps // 4 :]
    results = {"gemm_tflop": flops / 1e12, "attention_tflop": flops_attention / 1e12}
    for name in variants:
        results[name] = {
            "burst_ms": statistics.median(burst[name]),
            "sustained_ms": statistics.median(sustained[name]),
        }
        rate = {"gemms": flops, "attention": flops_attention}.get(name)
        extra = ""
        if rate:
            ms = results[name]
            extra = f"  ({rate / ms['burst_ms'] / 1e9:.0f} / {rate / ms['sustained_ms'] / 1e9:.0f} TFLOP/s)"
        print(
            f"{name:20s} burst {results[name]['burst_ms']:6.1f} ms  sustained {results[name]['sustained_ms']:6.1f} ms{extra}"
        )
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
