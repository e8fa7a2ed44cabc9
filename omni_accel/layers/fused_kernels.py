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

# Diffusers' GELU(tanh) constants as PyTorch's CUDA kernel has them, rounded to float32.
_GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


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
def _concat_gelu_kernel(A, B, OUT, dim_a, dim_b, stride_a, stride_b, BLOCK: tl.constexpr):
    """One block of one row of ``cat([a, gelu_tanh(b)], -1)`` (rows of every sample ``stride_*`` apart).
    GELU as ``x * sigmoid(2u)``, which is ``0.5 x (1 + tanh(u))`` exactly: one exponential instead of
    CUDA's ``tanhf``, whose arithmetic made the kernel compute-bound (3.0 TB/s against 3.7 at FLUX's shapes
    on an H200). The result is PyTorch's rounded value but for ~1 % of bf16 elements that sit one rounding
    step away, no farther from the float64 GELU (tested)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dim = dim_a + dim_b
    in_a = cols < dim_a
    in_b = (cols >= dim_a) & (cols < dim)
    dtype = OUT.dtype.element_ty
    a = tl.load(A + row * stride_a + cols, mask=in_a, other=0.0)
    x = tl.load(B + row * stride_b + (cols - dim_a), mask=in_b, other=0.0).to(tl.float32)
    u = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    gelu = x / (1.0 + tl.exp(-2.0 * u))
    tl.store(OUT + row * dim + cols, tl.where(in_a, a.to(dtype), gelu.to(dtype)), mask=cols < dim)


@triton.jit
def _norm_rope(x, W, cos, sin, h, d, mask, heads, eps, HEAD_DIM, BLOCK_H, ACROSS_HEADS):
    """The RMSNorm of every head of a token (or, ``ACROSS_HEADS``, of its whole row with a weight per
    channel, as Wan's), then RoPE on (even, odd) channel pairs, split and joined in registers."""
    if ACROSS_HEADS:
        rstd = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / (heads * HEAD_DIM) + eps)
        weight = tl.load(W + h * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    else:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        weight = tl.load(W + d).to(tl.float32)
    x = x * rstd * weight
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, HEAD_DIM // 2, 2)))
    rotated = tl.reshape(tl.join(-odd, even), (BLOCK_H, HEAD_DIM))  # (-odd, even) per pair
    return x * cos + rotated * sin


@triton.jit
def _qkv_norm_rope_kernel(
    Q,
    K,
    V,
    WQ,
    WK,
    COS,
    SIN,
    OUT_Q,
    OUT_K,
    OUT_V,
    seq,
    heads,
    stride_qb,
    stride_qs,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_out_qb,
    stride_out_kvb,
    out_start,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ACROSS_HEADS: tl.constexpr,
    COPY_V: tl.constexpr,
):
    """``BLOCK_H`` heads of one token of one segment (all of them ``ACROSS_HEADS``): its q and k normed
    and rotated, and (``COPY_V``) its v copied, each written at the token's place in the joint
    ``[B, S, H, D]`` tensors (each sample's tokens contiguous; k and v laid out alike). Heads are read and
    written whole (coalesced), every load issued before the math."""
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < heads) & (d < HEAD_DIM)
    dtype = OUT_Q.dtype.element_ty
    channel = h * HEAD_DIM + d
    q = tl.load(Q + b * stride_qb + s * stride_qs + channel, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + s * stride_ks + channel, mask=mask, other=0.0).to(tl.float32)
    if COPY_V:
        v = tl.load(V + b * stride_vb + s * stride_vs + channel, mask=mask, other=0.0)
    position = (out_start + s) * HEAD_DIM + d
    cos = tl.load(COS + position)
    sin = tl.load(SIN + position)
    dst = ((out_start + s) * heads + h) * HEAD_DIM + d
    q = _norm_rope(q, WQ, cos, sin, h, d, mask, heads, eps, HEAD_DIM, BLOCK_H, ACROSS_HEADS)
    tl.store(OUT_Q + b.to(tl.int64) * stride_out_qb + dst, q.to(dtype), mask=mask)
    k = _norm_rope(k, WK, cos, sin, h, d, mask, heads, eps, HEAD_DIM, BLOCK_H, ACROSS_HEADS)
    kv_dst = b.to(tl.int64) * stride_out_kvb + dst
    tl.store(OUT_K + kv_dst, k.to(dtype), mask=mask)
    if COPY_V:
        tl.store(OUT_V + kv_dst, v.to(dtype), mask=mask)


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


@torch.library.custom_op("omni_accel::concat_gelu", mutates_args=())
def concat_gelu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows evenly spaced across samples (contiguous, or columns of a packed projection)."""
    batch, seq, dim_a = a.shape
    dim_b = b.shape[2]
    out = torch.empty((batch, seq, dim_a + dim_b), dtype=b.dtype, device=b.device)
    if out.numel():
        block = 1024
        _concat_gelu_kernel[(batch * seq, triton.cdiv(dim_a + dim_b, block))](
            a, b, out, dim_a, dim_b, a.stride(1), b.stride(1), BLOCK=block
        )
    return out


@concat_gelu.register_fake
def _(a, b):
    return b.new_empty(*b.shape[:2], a.shape[2] + b.shape[2])


# A head per program leaves too little in flight, a whole padded row (FLUX's 24 heads as 32) wastes lanes:
# eight heads measured best at FLUX's shapes (2: 1.9 TB/s, 4: 3.0, 8: 3.3, 32: 2.9 on an H200).
_HEADS_PER_PROGRAM = 8


@torch.library.custom_op("omni_accel::qkv_norm_rope", mutates_args=())
def qkv_norm_rope(
    qs: list[torch.Tensor],
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    q_weights: list[torch.Tensor],
    k_weights: list[torch.Tensor],
    head_dim: int,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    across_heads: bool = False,
) -> list[torch.Tensor]:
    """Joint q and k (and v, when ``vs`` is given: a custom op cannot return a view of its input, so a lone
    segment's v stays with the caller)."""
    first = qs[0]
    batch, heads = first.shape[0], first.shape[2] // head_dim
    total = sum(q.shape[1] for q in qs)
    outs = [first.new_empty(batch, total, heads, head_dim) for _ in range(3 if vs else 2)]
    qkv_norm_rope_into(qs, ks, vs, q_weights, k_weights, head_dim, eps, cos, sin, across_heads, outs)
    return outs


def qkv_norm_rope_into(
    qs: list[torch.Tensor],
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    q_weights: list[torch.Tensor],
    k_weights: list[torch.Tensor],
    head_dim: int,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    across_heads: bool,
    outs: list[torch.Tensor],
) -> None:
    """``qkv_norm_rope`` written into ``outs`` (q, k and, with ``vs``, v: ``[B, S, H, D]``, each sample's
    tokens contiguous, k and v with the same strides): a caller's buffers, such as the ring's."""
    first = qs[0]
    batch, heads = first.shape[0], first.shape[2] // head_dim
    eps = torch.finfo(first.dtype).eps if eps is None else eps
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    heads_per_program = heads if across_heads else min(_HEADS_PER_PROGRAM, heads)  # the norm needs the row
    block_h = triton.next_power_of_2(heads_per_program)
    warps = 4 if block_h * head_dim <= 4096 else 8  # Wan 14B's 40 heads: 8192 values per token
    start = 0
    for i, (q, k, wq, wk) in enumerate(zip(qs, ks, q_weights, k_weights, strict=True)):
        v = vs[i] if vs else q  # unread without COPY_V
        seq = q.shape[1]
        if batch * seq:
            _qkv_norm_rope_kernel[(batch * seq, triton.cdiv(heads, block_h))](
                q, k, v, wq, wk, cos, sin, outs[0], outs[1], outs[-1], seq, heads,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                outs[0].stride(0), outs[1].stride(0), start, eps,
                HEAD_DIM=head_dim, BLOCK_H=block_h, ACROSS_HEADS=across_heads, COPY_V=bool(vs),
                num_warps=warps,
            )  # fmt: skip
        start += seq


@qkv_norm_rope.register_fake
def _(qs, ks, vs, q_weights, k_weights, head_dim, eps, cos, sin, across_heads=False):
    first = qs[0]
    total = sum(q.shape[1] for q in qs)
    shape = (first.shape[0], total, first.shape[2] // head_dim, head_dim)
    return [first.new_empty(shape) for _ in range(3 if vs else 2)]
