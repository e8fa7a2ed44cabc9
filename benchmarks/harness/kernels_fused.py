"""Bandwidth of our fused elementwise kernels (``omni_accel.layers.fused``) against a plain device copy."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from omni_accel.layers import fused
from omni_accel.layers.fp8 import Fp8Weights
from omni_accel.layers.projection import apply_one, read_linear, with_fp8
from omni_accel.parallel.copies import copy_rows_
from omni_accel.parallel.placement import Placement
from omni_accel.utils.kernels import HAS_TRITON

from .kernels_run import Commands, Run, option

# (tokens, text tokens, width, MLP width, head size): FLUX.1-dev at 1024x1024, and the --tiny shapes
FLUX_1024 = (4608, 512, 3072, 12288, 128)
TINY = (72, 8, 64, 256, 32)


def fused_kernels(run: Run, args: argparse.Namespace) -> None:
    """Bandwidth of our fused kernels at FLUX.1-dev's 1024x1024 shapes against a plain device copy.

    A device copy is their ceiling: each kernel reads and writes its tensors once (the modulation: reads
    its weight once). Each timed from
    CUDA-graph replays (no launch cost): us per call and GB/s of the bytes it reads and writes."""
    tokens, text, dim, mlp_dim, head_dim = TINY if run.tiny else FLUX_1024
    torch.manual_seed(0)
    packed = run.randn(1, tokens, 3 * dim + mlp_dim)  # a single block's GEMM output
    x, y = run.randn(1, tokens, dim), run.randn(1, tokens, dim)
    mod = run.randn(1, dim)
    w = torch.ones(head_dim, device=run.device, dtype=run.dtype)
    cos, sin = (torch.randn(tokens, head_dim, device=run.device) for _ in range(2))
    size = packed.element_size()  # bytes per element
    mlp, act = packed[..., 3 * dim :], tokens * dim * size
    contiguous_mlp = mlp.contiguous()
    double = [packed[:, :text].split(dim, -1)[:3], packed[:, text:].split(dim, -1)[:3]]
    single = [packed[..., : 3 * dim].split(dim, -1)]
    flat = torch.empty(tokens * (dim + mlp_dim), device=run.device, dtype=run.dtype)
    heads = dim // head_dim
    joint = [torch.empty(1, tokens, heads, head_dim, device=run.device, dtype=run.dtype) for _ in range(3)]
    halves = [tuple((h, t.narrow(2, h, heads // 2)) for h in (0, heads // 2)) for t in joint]
    same_layout = Placement(*halves, tuple(joint))  # the plain layout, written through the head table
    groups = [
        [torch.empty(1, tokens, heads // 2, head_dim, device=run.device, dtype=run.dtype) for _ in range(2)]
        for _ in range(3)
    ]
    gather = [torch.empty(1, 2 * tokens, dim, device=run.device, dtype=run.dtype) for _ in range(2)]
    mine = [buffer.narrow(1, 0, tokens) for buffer in gather]  # tp=2: this rank's rows in both buffers

    def modulated_then_gathered() -> None:
        h = fused.norm_modulate(x, mod, mod, 1e-6)
        for rows in mine:
            copy_rows_(rows, h)

    ulysses = Placement(*(((0, a), (heads // 2, b)) for a, b in groups), tuple(g[0] for g in groups))
    rope = (cos, sin)
    cases = {  # name: (call, bytes read and written)
        "device copy (ceiling)": (flat.clone, 2 * flat.numel() * size),
        "concat_gelu (single block)": (
            lambda: fused.concat_gelu(x, mlp),
            2 * tokens * (dim + mlp_dim) * size,
        ),
        "gelu_tanh (MLP)": (lambda: fused.gelu_tanh(mlp), 2 * tokens * mlp_dim * size),
        "PyTorch gelu tanh (MLP, contiguous)": (
            lambda: F.gelu(contiguous_mlp, approximate="tanh"),
            2 * tokens * mlp_dim * size,
        ),
        "qkv_norm_rope (double: two segments, v joined)": (
            lambda: fused.qkv_norm_rope(double, [(w, w), (w, w)], head_dim, 1e-6, rope),
            6 * act,
        ),
        "qkv_norm_rope (single: v a view)": (
            lambda: fused.qkv_norm_rope(single, [(w, w)], head_dim, 1e-6, rope),
            4 * act,
        ),
        "qkv_norm_rope (double, through the head table)": (
            lambda: fused.qkv_norm_rope(double, [(w, w), (w, w)], head_dim, 1e-6, rope, False, same_layout),
            6 * act,
        ),
        "qkv_norm_rope (double, two head groups apart)": (
            lambda: fused.qkv_norm_rope(double, [(w, w), (w, w)], head_dim, 1e-6, rope, False, ulysses),
            6 * act,
        ),
        "norm_modulate": (lambda: fused.norm_modulate(x, mod, mod, 1e-6), 2 * act),
        "norm_modulate, then copied into two gather buffers": (modulated_then_gathered, 3 * act),
    }
    if HAS_TRITON and run.cuda:
        from omni_accel.layers import fused_kernels  # Triton's module: importable only with Triton

        cases["norm_modulate into two gather buffers"] = (
            lambda: fused_kernels.norm_modulate_into(x, mod, mod, 1e-6, mine),
            3 * act,
        )
    else:
        run.skip("norm_modulate into two gather buffers", "a Triton kernel: needs CUDA and Triton")
        run.skip(
            "our Triton kernels",
            f"need CUDA and Triton: fused's calls run their PyTorch references on {run.device}",
        )
    cases["gated_residual"] = (lambda: fused.gated_residual(x, mod, y), 3 * act)
    # quantize="fp8": the same kernels writing e4m3 (one byte an element) for the next GEMM
    image_mlp = contiguous_mlp[:, text:]
    cases["concat_gelu_fp8 (single block)"] = (
        lambda: fused.concat_gelu_fp8(x, mlp),
        tokens * (dim + mlp_dim) * (size + 1),
    )
    cases["gelu_tanh_fp8 (double block's image MLP)"] = (
        lambda: fused.gelu_tanh_fp8(image_mlp),
        image_mlp.numel() * (size + 1),
    )
    cases["norm_modulate_fp8"] = (
        lambda: fused.norm_modulate_fp8(x, mod, mod, 1e-6),
        tokens * dim * (size + 1),
    )
    # a double block's AdaLN modulation: one row through a 6 x width weight, read whole
    adaln = torch.nn.Linear(dim, 6 * dim, device=run.device, dtype=run.dtype)
    adaln_weights, conditioning = read_linear(adaln, "norm1.linear"), run.randn(1, dim)
    fp8_weights = with_fp8(adaln_weights, Fp8Weights(), weight_only=True)
    cases["AdaLN modulation, one row (ours)"] = (
        lambda: apply_one(conditioning, adaln_weights),
        adaln.weight.numel() * size,
    )
    cases["AdaLN modulation, one row, e4m3 weight (fp8)"] = (
        lambda: apply_one(conditioning, fp8_weights),
        adaln.weight.numel(),
    )
    cases["AdaLN modulation, one row (F.linear)"] = (
        lambda: F.linear(conditioning, adaln.weight, adaln.bias),
        adaln.weight.numel() * size,
    )
    for name, (call, nbytes) in cases.items():
        ms = run.replayed_ms(call, args.calls, args.replays)
        run.results[name] = {"us": ms * 1000, "gb_s": nbytes / ms / 1e6}
        print(f"{name:48s} {ms * 1000:7.1f} us  {nbytes / ms / 1e6:6.0f} GB/s", flush=True)


def register(commands: Commands) -> None:
    parser = commands.add("fused-kernels", fused_kernels)
    option(parser, "--calls", 20, 2, "calls per captured graph")
    option(parser, "--replays", 7, 2, "timed replays per kernel")
