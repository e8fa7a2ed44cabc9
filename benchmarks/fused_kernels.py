"""Bandwidth of our fused kernels at FLUX.1-dev's 1024x1024 shapes against a plain device copy (their
ceiling: each reads and writes its tensors once), each timed from CUDA-graph replays (no launch cost).

    python benchmarks/fused_kernels.py
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from timing import graphed, timed

from omni_accel.layers import fused, fused_kernels
from omni_accel.parallel.copies import copy_rows_
from omni_accel.parallel.placement import Placement

TOKENS, TEXT, DIM, MLP, HEAD_DIM = 4608, 512, 3072, 12288, 128


def replayed_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """Milliseconds per call: the median replay of a graph of ``calls`` calls, divided by ``calls``."""
    replay = graphed(fn, calls)
    return statistics.median(timed(replay, "cuda")[1] / calls for _ in range(replays))


@torch.no_grad()
def main() -> None:
    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    packed = torch.randn(1, TOKENS, 3 * DIM + MLP, device=device, dtype=dtype)  # a single block's GEMM output
    x, y = (torch.randn(1, TOKENS, DIM, device=device, dtype=dtype) for _ in range(2))
    mod = torch.randn(1, DIM, device=device, dtype=dtype)
    w = torch.ones(HEAD_DIM, device=device, dtype=dtype)
    cos, sin = (torch.randn(TOKENS, HEAD_DIM, device=device) for _ in range(2))
    mlp, act = packed[..., 3 * DIM :], TOKENS * DIM * 2
    contiguous_mlp = mlp.contiguous()
    double = [packed[:, :TEXT].split(DIM, -1)[:3], packed[:, TEXT:].split(DIM, -1)[:3]]
    single = [packed[..., : 3 * DIM].split(DIM, -1)]
    flat = torch.empty(TOKENS * (DIM + MLP), device=device, dtype=dtype)
    heads = DIM // HEAD_DIM
    joint = [torch.empty(1, TOKENS, heads, HEAD_DIM, device=device, dtype=dtype) for _ in range(3)]
    halves = [tuple((h, t.narrow(2, h, heads // 2)) for h in (0, heads // 2)) for t in joint]
    same_layout = Placement(*halves, tuple(joint))  # the plain layout, written through the head table
    groups = [
        [torch.empty(1, TOKENS, heads // 2, HEAD_DIM, device=device, dtype=dtype) for _ in range(2)]
        for _ in range(3)
    ]
    gather = [torch.empty(1, 2 * TOKENS, DIM, device=device, dtype=dtype) for _ in range(2)]
    mine = [buffer.narrow(1, 0, TOKENS) for buffer in gather]  # tp=2: this rank's rows in both buffers

    def modulated_then_gathered() -> None:
        h = fused.norm_modulate(x, mod, mod, 1e-6)
        for rows in mine:
            copy_rows_(rows, h)

    ulysses = Placement(*(((0, a), (heads // 2, b)) for a, b in groups), tuple(g[0] for g in groups))
    cases = {  # name: (call, bytes read and written)
        "device copy (ceiling)": (flat.clone, 2 * flat.numel() * 2),
        "concat_gelu (single block)": (lambda: fused.concat_gelu(x, mlp), 2 * TOKENS * (DIM + MLP) * 2),
        "gelu_tanh (MLP)": (lambda: fused.gelu_tanh(mlp), 2 * TOKENS * MLP * 2),
        "PyTorch gelu tanh (MLP, contiguous)": (
            lambda: F.gelu(contiguous_mlp, approximate="tanh"),
            2 * TOKENS * MLP * 2,
        ),
        "qkv_norm_rope (double: two segments, v joined)": (
            lambda: fused.qkv_norm_rope(double, [(w, w), (w, w)], HEAD_DIM, 1e-6, (cos, sin)),
            6 * act,
        ),
        "qkv_norm_rope (single: v a view)": (
            lambda: fused.qkv_norm_rope(single, [(w, w)], HEAD_DIM, 1e-6, (cos, sin)),
            4 * act,
        ),
        "qkv_norm_rope (double, through the head table)": (
            lambda: fused.qkv_norm_rope(
                double, [(w, w), (w, w)], HEAD_DIM, 1e-6, (cos, sin), False, same_layout
            ),
            6 * act,
        ),
        "qkv_norm_rope (double, two head groups apart)": (
            lambda: fused.qkv_norm_rope(double, [(w, w), (w, w)], HEAD_DIM, 1e-6, (cos, sin), False, ulysses),
            6 * act,
        ),
        "norm_modulate": (lambda: fused.norm_modulate(x, mod, mod, 1e-6), 2 * act),
        "norm_modulate, then copied into two gather buffers": (modulated_then_gathered, 3 * act),
        "norm_modulate into two gather buffers": (
            lambda: fused_kernels.norm_modulate_into(x, mod, mod, 1e-6, mine),
            3 * act,
        ),
        "gated_residual": (lambda: fused.gated_residual(x, mod, y), 3 * act),
    }
    for name, (call, nbytes) in cases.items():
        ms = replayed_ms(call)
        print(f"{name:48s} {ms * 1000:7.1f} us  {nbytes / ms / 1e6:6.0f} GB/s")


if __name__ == "__main__":
    main()
