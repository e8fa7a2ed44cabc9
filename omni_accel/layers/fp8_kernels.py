"""Triton kernels behind ``layers.fp8`` and the FP8 forms of ``layers.fused`` (imported only when Triton is
installed), registered as custom ops.

Each writes a GEMM's input straight in e4m3 with its row scales, from the bf16 values the unquantized kernel
would have stored: ``layers.fp8.quantize_rows_reference`` of the unquantized output. The kernels round to
the activations' dtype before quantizing, but Triton's compiler may fold that round trip (as
``fused_kernels`` notes): the norm-modulate kernel then quantizes the float32 value, and a rare element
(under 1 % with bf16 modulation, tests/test_gpu_fp8.py) lands one e4m3 step from the reference's, closer
to the exact value. The row pass and the GELU kernels are bitwise the reference (tested). A value is
divided by its scale as the reference does it, times the scale's IEEE reciprocal; the cast to e4m3 rounds
to nearest even and saturates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.triton_builds import first_launches
from . import fused
from .fp8 import _AMAX_FLOOR, E4M3, E4M3_MAX, quantize_rows_reference
from .fused_kernels import _GELU_BETA, _GELU_KAPPA, norm_modulate_row

_INVERSE_MAX = tl.constexpr(1 / E4M3_MAX)
_FLOOR = tl.constexpr(_AMAX_FLOOR)
_TILE = 2048  # columns per step of the kernels that read a row twice (FLUX's 15360-wide GELU rows)


@triton.jit
def _scale_of(amax):
    return tl.maximum(amax, _FLOOR) * _INVERSE_MAX


@triton.jit
def _quantized(values, inverse):
    # No clamp: |value| <= amax, so |value * inverse| is 448 within float32 rounding, which the cast rounds
    # to 448 (the reference's clamp never acts).
    return values * inverse


@triton.jit
def _inverse(scale):
    return tl.math.div_rn(1.0, scale)  # IEEE, as torch's reciprocal


@triton.jit
def _quantize_rows_kernel(X, Q, S, dim, stride_x, BLOCK: tl.constexpr):
    """One row: its amax over every tile, then each tile divided by the scale (the second read mostly from
    L2)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < dim, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = _scale_of(tl.max(amax, 0))
    tl.store(S + row, scale)
    inverse = _inverse(scale)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < dim, other=0.0).to(tl.float32)
        tl.store(Q + row * dim + cols, _quantized(x, inverse).to(Q.dtype.element_ty), mask=cols < dim)


@triton.jit
def _norm_modulate_fp8_kernel(
    X, SHIFT, SCALE, Q, S, seq, dim, stride_xb, stride_xs, stride_shift, stride_scale, eps,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """``norm_modulate_row`` rounded to ``DTYPE`` (as ``_norm_modulate_kernel`` stores it), stored quantized."""
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    y = norm_modulate_row(
        X, SHIFT, SCALE, b, s, cols, mask, dim, stride_xb, stride_xs, stride_shift, stride_scale, eps
    )
    y = tl.where(mask, y.to(DTYPE).to(tl.float32), 0.0)
    row_scale = _scale_of(tl.max(tl.abs(y), 0))
    tl.store(S + row, row_scale)
    q = _quantized(y, _inverse(row_scale))
    tl.store(Q + row.to(tl.int64) * dim + cols, q.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _concat_gelu_tile(A, B, row, cols, dim_a, dim_b, stride_a, stride_b, DTYPE: tl.constexpr):
    """Columns ``cols`` of row ``row`` of ``cat([a, gelu_tanh(b)], -1)``, rounded to ``DTYPE`` (as
    ``layers.fused_kernels._concat_gelu_kernel`` computes them), in float32."""
    in_a = cols < dim_a
    in_b = (cols >= dim_a) & (cols < dim_a + dim_b)
    a = tl.load(A + row * stride_a + cols, mask=in_a, other=0.0).to(tl.float32)
    x = tl.load(B + row * stride_b + (cols - dim_a), mask=in_b, other=0.0).to(tl.float32)
    u = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    gelu = x / (1.0 + tl.exp(-2.0 * u))
    return tl.where(in_a, a, gelu.to(DTYPE).to(tl.float32))


@triton.jit
def _gelu_tile(B, row, start, dim_b, stride_b, TILE: tl.constexpr, DTYPE: tl.constexpr):
    """GELU of columns ``start + arange(TILE)`` of row ``row`` of ``b``, rounded to ``DTYPE``, in float32
    (0 past ``dim_b``)."""
    cols = start + tl.arange(0, TILE)
    x = tl.load(B + row * stride_b + cols, mask=cols < dim_b, other=0.0).to(tl.float32)
    u = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    return (x / (1.0 + tl.exp(-2.0 * u))).to(DTYPE).to(tl.float32)


@triton.jit
def _store_tile(Q, row_out, start, limit, values, inverse, TILE: tl.constexpr):
    cols = start + tl.arange(0, TILE)
    tl.store(row_out + cols, _quantized(values, inverse).to(Q.dtype.element_ty), mask=cols < limit)


@triton.jit
def _concat_gelu_fp8_held_kernel(
    A, B, Q, S, dim_a, dim_b, stride_a, stride_b,
    TA: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """One row held in registers, read and activated once: ``a``'s columns in one tile of ``TA`` (0: none),
    the GELU's in power-of-two tiles of ``T1``, ``T2``, ``T3`` (0: absent), so that only the last tile has
    padded lanes (a 12288-wide GELU padded to 16384 spent a third of its arithmetic on nothing)."""
    row = tl.program_id(0).to(tl.int64)
    out = Q + row * (dim_a + dim_b)
    g1 = _gelu_tile(B, row, 0, dim_b, stride_b, T1, DTYPE)
    amax = tl.max(tl.abs(g1), 0)
    if TA > 0:
        cols = tl.arange(0, TA)
        a = tl.load(A + row * stride_a + cols, mask=cols < dim_a, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(a), 0))
    if T2 > 0:
        g2 = _gelu_tile(B, row, T1, dim_b, stride_b, T2, DTYPE)
        amax = tl.maximum(amax, tl.max(tl.abs(g2), 0))
    if T3 > 0:
        g3 = _gelu_tile(B, row, T1 + T2, dim_b, stride_b, T3, DTYPE)
        amax = tl.maximum(amax, tl.max(tl.abs(g3), 0))
    scale = _scale_of(amax)
    tl.store(S + row, scale)
    inverse = _inverse(scale)
    if TA > 0:
        _store_tile(Q, out, 0, dim_a, a, inverse, TA)
    _store_tile(Q, out + dim_a, 0, dim_b, g1, inverse, T1)
    if T2 > 0:
        _store_tile(Q, out + dim_a, T1, dim_b, g2, inverse, T2)
    if T3 > 0:
        _store_tile(Q, out + dim_a, T1 + T2, dim_b, g3, inverse, T3)


@triton.jit
def _concat_gelu_fp8_twice_kernel(
    A, B, Q, S, dim_a, dim_b, stride_a, stride_b, BLOCK: tl.constexpr, DTYPE: tl.constexpr
):  # fmt: skip
    """One row too wide to hold, tile by tile, twice: its amax, then its values."""
    row = tl.program_id(0).to(tl.int64)
    dim = dim_a + dim_b
    amax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _concat_gelu_tile(A, B, row, cols, dim_a, dim_b, stride_a, stride_b, DTYPE)
        amax = tl.maximum(amax, tl.abs(y))
    scale = _scale_of(tl.max(amax, 0))
    tl.store(S + row, scale)
    inverse = _inverse(scale)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _concat_gelu_tile(A, B, row, cols, dim_a, dim_b, stride_a, stride_b, DTYPE)
        tl.store(Q + row * dim + cols, _quantized(y, inverse).to(Q.dtype.element_ty), mask=cols < dim)


_HELD = 16384  # lanes a program of 8 warps holds at once (64 float32 values a thread)


def _power_of_two_tiles(dim: int, tiles: int) -> list[int]:
    """``dim`` as at most ``tiles`` power-of-two tiles, largest first, the last one padded."""
    sizes = []
    while dim > 0 and len(sizes) < tiles - 1:
        sizes.append(1 << (dim.bit_length() - 1))
        dim -= sizes[-1]
    if dim > 0:
        sizes.append(triton.next_power_of_2(dim))
    return sizes + [0] * (tiles - len(sizes))


_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _outputs(rows: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(rows, dim, dtype=E4M3, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


@torch.library.custom_op("omni_accel::quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (unit column stride) as e4m3 rows and their ``[M, 1]`` scales."""
    rows, dim = x.shape
    q, s = _outputs(rows, dim, x.device)
    if rows and dim:
        with first_launches() as launches:
            if not launches.deferred:
                _quantize_rows_kernel[(rows,)](
                    x, q, s, dim, x.stride(0), BLOCK=min(_TILE, triton.next_power_of_2(dim))
                )
        if launches.deferred:
            return quantize_rows_reference(x)
    return q, s


@quantize_rows.register_fake
def _(x):
    return _outputs(*x.shape, x.device)


@torch.library.custom_op("omni_accel::norm_modulate_fp8", mutates_args=())
def norm_modulate_fp8(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_modulate(x, shift, scale, eps)`` (``x`` ``[B, S, D]``, per-sample modulation) as e4m3 rows
    ``[B * S, D]`` and their scales."""
    batch, seq, dim = x.shape
    q, s = _outputs(batch * seq, dim, x.device)
    if batch * seq:
        with first_launches() as launches:
            if not launches.deferred:
                _norm_modulate_fp8_kernel[(batch * seq,)](
                    x, shift, scale, q, s, seq, dim, x.stride(0), x.stride(1), shift.stride(0),
                    scale.stride(0), eps, BLOCK=triton.next_power_of_2(dim), DTYPE=_TRITON_DTYPES[x.dtype],
                )  # fmt: skip
        if launches.deferred:
            return quantize_rows_reference(fused.norm_modulate(x, shift, scale, eps).reshape(-1, dim))
    return q, s


@norm_modulate_fp8.register_fake
def _(x, shift, scale, eps):
    return _outputs(x.shape[0] * x.shape[1], x.shape[2], x.device)


@torch.library.custom_op("omni_accel::concat_gelu_fp8", mutates_args=())
def concat_gelu_fp8(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``concat_gelu(a, b)`` (``[B, S, *]`` tensors with evenly spaced rows) as e4m3 rows and scales."""
    batch, seq, dim_a = a.shape
    dim_b = b.shape[2]
    dim = dim_a + dim_b
    q, s = _outputs(batch * seq, dim, b.device)
    tile_a = triton.next_power_of_2(dim_a) if dim_a else 0
    tiles_b = _power_of_two_tiles(dim_b, 3)
    dtype = _TRITON_DTYPES[b.dtype]
    if not batch * seq or not dim_b:
        if batch * seq and dim_a:
            q, s = quantize_rows(a.reshape(batch * seq, dim_a))
    else:
        with first_launches() as launches:
            if launches.deferred:
                pass
            elif tile_a + sum(tiles_b) <= _HELD:
                _concat_gelu_fp8_held_kernel[(batch * seq,)](
                    a, b, q, s, dim_a, dim_b, a.stride(1), b.stride(1), tile_a, *tiles_b, DTYPE=dtype,
                    num_warps=8,
                )  # fmt: skip
            else:
                _concat_gelu_fp8_twice_kernel[(batch * seq,)](
                    a, b, q, s, dim_a, dim_b, a.stride(1), b.stride(1), BLOCK=_TILE, DTYPE=dtype, num_warps=4
                )
        if launches.deferred:
            return quantize_rows_reference(fused.concat_gelu(a, b).reshape(-1, dim))
    return q, s


@concat_gelu_fp8.register_fake
def _(a, b):
    return _outputs(a.shape[0] * a.shape[1], a.shape[2] + b.shape[2], b.device)
