"""Triton kernels behind ``layers.fused`` (imported only when Triton is installed), registered as custom ops.

Every kernel computes in float32 and rounds once, when it stores; the unfused reference rounds after each
op, so a bf16 result may sit one rounding step from the reference's (closer to the fp32 result, not
farther). An explicit round trip to bf16 between two steps does not survive Triton's compiler (it was
folded away on an H200), so the kernels do not pretend to round in between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_modulate_kernel(
    X, SHIFT, SCALE, OUT, seq, dim, stride_xb, stride_xs, stride_shift, stride_scale, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = OUT.dtype.element_ty
    x = tl.load(X + b * stride_xb + s * stride_xs + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / dim
    centred = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, 0) / dim + eps)
    scale = tl.load(SCALE + b * stride_scale + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(SHIFT + b * stride_shift + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * dim + cols, (centred * rstd * (1.0 + scale) + shift).to(dtype), mask=mask)


@triton.jit
def _gated_residual_kernel(X, GATE, Y, OUT, seq, dim, stride_gb, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    dtype = OUT.dtype.element_ty
    b = offsets // (seq * dim)
    gate = tl.load(GATE + b * stride_gb + offsets % dim, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, (x + gate * y).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    X,
    W,
    COS,
    SIN,
    OUT,
    seq,
    heads,
    stride_xb,
    stride_xs,
    out_seq,
    out_start,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One token of one segment: every head's RMSNorm, then RoPE on (even, odd) channel pairs. Rows are
    read and written whole (coalesced); the pairs are split and joined in registers."""
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < heads) & (d < HEAD_DIM)
    dtype = OUT.dtype.element_ty
    x = tl.load(X + b * stride_xb + s * stride_xs + h * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
    weight = tl.load(W + d).to(tl.float32)
    x = x * rstd * weight
    position = (out_start + s) * HEAD_DIM + d
    cos = tl.load(COS + position)
    sin = tl.load(SIN + position)
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, HEAD_DIM // 2, 2)))
    rotated = tl.reshape(tl.join(-odd, even), (BLOCK_H, HEAD_DIM))  # (-odd, even) per pair
    out = x * cos + rotated * sin
    dst = OUT + ((b * out_seq + out_start + s) * heads + h) * HEAD_DIM + d
    tl.store(dst, out.to(dtype), mask=mask)


@torch.library.custom_op("omni_accel::norm_modulate", mutates_args=())
def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    batch, seq, dim = x.shape
    out = torch.empty((batch, seq, dim), dtype=x.dtype, device=x.device)
    if out.numel():
        _norm_modulate_kernel[(batch * seq,)](
            x, shift, scale, out, seq, dim, x.stride(0), x.stride(1), shift.stride(0), scale.stride(0), eps,
            BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out


@norm_modulate.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("omni_accel::gated_residual", mutates_args=())
def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    numel = x.numel()
    if numel:
        block = 1024
        _gated_residual_kernel[(triton.cdiv(numel, block),)](
            x, gate, y, out, x.shape[1], x.shape[2], gate.stride(0), numel, BLOCK=block
        )
    return out


@gated_residual.register_fake
def _(x, gate, y):
    return torch.empty_like(x)


@torch.library.custom_op("omni_accel::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    tensors: list[torch.Tensor],
    weights: list[torch.Tensor],
    head_dim: int,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    batch = tensors[0].shape[0]
    heads = tensors[0].shape[2] // head_dim
    total = sum(t.shape[1] for t in tensors)
    out = torch.empty((batch, total, heads, head_dim), dtype=tensors[0].dtype, device=tensors[0].device)
    eps = torch.finfo(out.dtype).eps if eps is None else eps
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    start = 0
    for x, weight in zip(tensors, weights, strict=True):
        seq = x.shape[1]
        if batch * seq:
            _qk_norm_rope_kernel[(batch * seq,)](
                x, weight, cos, sin, out, seq, heads, x.stride(0), x.stride(1), total, start, eps,
                HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
            )  # fmt: skip
        start += seq
    return out


@qk_norm_rope.register_fake
def _(tensors, weights, head_dim, eps, cos, sin):
    first = tensors[0]
    total = sum(t.shape[1] for t in tensors)
    return first.new_empty(first.shape[0], total, first.shape[2] // head_dim, head_dim)
