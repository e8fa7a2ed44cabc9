"""The transformer MLP: up projection, activation, down projection (each maybe LoRA, maybe TP-split)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..parallel.token_rows import Rows
from .fp8 import Fp8Rows
from .fused import gelu_tanh, gelu_tanh_fp8
from .projection import LinearWeights, apply_one, finish_projections, start_projection, takes_fp8_rows


def feed_forward(
    x: torch.Tensor,
    up: LinearWeights,
    down: LinearWeights,
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
    rows: Rows | None = None,
    gathered: bool = False,
) -> torch.Tensor:
    """``down(activation(up(x)))``; under tensor parallelism ``up`` splits its outputs and ``down`` its
    inputs, so the activation runs on the local slice and one all-reduce (with the tokens split, ``rows``:
    a gather before and a reduce-scatter after) frames the MLP. ``gathered``: ``x`` holds every rank's
    tokens already (``norm_modulate_gathered``)."""
    return apply_one(_activated_up(x, up, down, rows, gathered, activation), down, rows)


def feed_forwards_together(
    items: Sequence[tuple[torch.Tensor, LinearWeights, LinearWeights, Rows | None, bool]],
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
) -> list[torch.Tensor]:
    """``feed_forward`` of each ``(x, up, down, rows, gathered)`` (independent streams of a block, of one TP
    group) one after the other, each MLP's partial sums travelling while the next MLP runs, and one barrier
    ending them all."""
    last = len(items) - 1
    started = [
        start_projection(_activated_up(x, up, down, rows, gathered, activation), down, rows, beside=i < last)
        for i, (x, up, down, rows, gathered) in enumerate(items)
    ]
    return finish_projections(started)


def _activated_up(
    x: torch.Tensor | Fp8Rows,
    up: LinearWeights,
    down: LinearWeights,
    rows: Rows | None,
    gathered: bool,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | Fp8Rows:
    """``activation(up(x))``. The tanh-GELU of a plain projection on CUDA runs in the GEMM's epilogue
    (cuBLASLt, from the float32 accumulator): the MLP's widest activation is written once instead of
    written, read and written again, which is faster than the GEMM then our GELU kernel
    (``benchmarks/kernel_bench.py gemm-gelu``; docs/archive/performance-history.md). Left to the GELU
    kernel: adapters (added before the activation), a gather inside the projection, float32, and traced
    graphs. Under FP8 the
    activation is written quantized for ``down`` where nothing else reads it (``gelu_tanh_fp8``)."""
    if activation is gelu_tanh and takes_fp8_rows(down) and rows is None:
        return gelu_tanh_fp8(apply_one(x, up))
    if activation is gelu_tanh and _gelu_epilogue_serves(x, up, rows is None or gathered):
        y = torch._addmm_activation(up.bias, x.flatten(0, -2), up.weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], y.shape[-1])
    return activation(apply_one(x, up, None if gathered else rows))


def _gelu_epilogue_serves(x: torch.Tensor, up: LinearWeights, plain: bool) -> bool:
    """A plain GEMM (no collective, packing or adapter) over plain half-precision tensors of one dtype
    (a tensor subclass, such as a quantized weight, keeps ``F.linear``'s dispatch)."""
    return (
        plain
        and isinstance(x, torch.Tensor)
        and up.fp8 is None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and up.bias is not None
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (x, up.weight, up.bias))
        and up.weight.dtype == up.bias.dtype == x.dtype
        and up.reduce is None
        and len(up.sizes) == 1
        and not any(up.adapters)
        and not torch.compiler.is_dynamo_compiling()
    )
