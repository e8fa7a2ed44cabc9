"""A projection of a few rows (the per-sample AdaLN modulation: one row per sample) as a Triton kernel,
registered as a custom op; imported only when Triton is installed.

Such a product reads the whole weight for a handful of outputs, so its time is the weight's bytes over
the memory bandwidth. At FLUX.1's modulation shapes on an H200, cuBLAS's kernel for one row reads at 2.9-3.6
TB/s; this one at 3.5-4.0 (``tests/test_gpu_gemv.py`` checks its accuracy against cuBLAS's). Under
``quantize="fp8"`` the weight is read in e4m3 with a scale per output channel (half the bytes, 3.6 TB/s) and
the rows stay in their dtype: weight-only quantization, as the rows are too few for an e4m3 GEMM to pay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..utils.triton_builds import first_launches
from .fp8 import dequantized_linear

# (output channels per program, columns per step over K, warps) by the weight's element size, the fastest
# of a sweep at FLUX.1's modulation shapes on an H200
_CONFIGS = {2: (16, 256, 4), 1: (8, 512, 2)}
MAX_ROWS = 2  # rows one pass takes; more rows, one pass per two (each pass reads the weight once)


@triton.jit
def _few_rows_linear_kernel(
    X, W, SCALE, BIAS, Y, N, K, stride_x, stride_w, stride_y,
    TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """``Y = (X @ W.T) * SCALE + BIAS`` for one or two rows (``TWO_ROWS``) and ``BLOCK_N`` output channels,
    accumulated in float32. (A row per accumulator: a ``[rows, BLOCK_N, BLOCK_K]`` product measured 1.7x
    slower, its layout conversions costing more than the weight's read.)"""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.zeros((BLOCK_N,), tl.float32)
    second = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        w = tl.load(
            W + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0
        ).to(tl.float32)
        first += tl.sum(w * tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)[None, :], 1)
        if TWO_ROWS:
            second += tl.sum(w * tl.load(X + stride_x + k, mask=k < K, other=0.0).to(tl.float32)[None, :], 1)
    if HAS_SCALE:
        scale = tl.load(SCALE + n, mask=n < N, other=0.0)
        first *= scale
        second *= scale
    if HAS_BIAS:
        bias = tl.load(BIAS + n, mask=n < N, other=0.0).to(tl.float32)
        first += bias
        second += bias
    tl.store(Y + n, first.to(Y.dtype.element_ty), mask=n < N)
    if TWO_ROWS:
        tl.store(Y + stride_y + n, second.to(Y.dtype.element_ty), mask=n < N)


@torch.library.custom_op("omni_accel::few_rows_linear", mutates_args=())
def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight * scale[:, None], bias)`` of ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` (both of
    unit column stride): ``weight`` of ``x``'s half-precision dtype with no ``scale``, or e4m3 with its
    float32 scale per output channel (contiguous, ``N`` values)."""
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _CONFIGS[weight.element_size()]
    with first_launches() as launches:
        for first in range(0, rows, MAX_ROWS):
            if launches.deferred:
                break
            _few_rows_linear_kernel[(triton.cdiv(n, block_n),)](
                x[first:], weight, scale, bias, y[first:], n, k, x.stride(0), weight.stride(0), y.stride(0),
                TWO_ROWS=rows - first > 1, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SCALE=scale is not None,
                HAS_BIAS=bias is not None, num_warps=warps,
            )  # fmt: skip
    if launches.deferred:
        return F.linear(x, weight, bias) if scale is None else dequantized_linear(x, weight, scale, bias)
    return y


@few_rows_linear.register_fake
def _(x, weight, scale, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def serves(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes this product: half-precision rows and a weight of their dtype (or e4m3 with
    a contiguous scale per output channel), both of unit column stride."""
    if scale is None:
        weight_ok = weight.dtype == x.dtype
    else:
        weight_ok = (
            weight.dtype == torch.float8_e4m3fn and scale.is_contiguous() and scale.numel() == len(weight)
        )
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and weight.ndim == 2
        and weight.stride(1) == 1
        and weight_ok
        and weight.shape[0] * weight.stride(0) < 2**31  # 32-bit offsets
    )
