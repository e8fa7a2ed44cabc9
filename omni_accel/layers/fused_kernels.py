"""Triton kernels behind ``layers.fused`` (imported only when Triton is installed), registered as custom ops.

Every kernel computes in float32 and rounds once, when it stores; the unfused reference rounds after each
op, so a bf16 result may sit one rounding step from the reference's (closer to the fp32 result, not
farther). An explicit round trip to bf16 between two steps does not survive Triton's compiler (it folds
it away), so the kernels do not pretend to round in between.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..parallel.placement import HeadPieces
from ..utils.triton_builds import first_launches, wait_for_driver
from . import fused

# Diffusers' GELU(tanh) constants as PyTorch's CUDA kernel has them, rounded to float32.
_GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def norm_modulate_row(
    X, SHIFT, SCALE, b, s, cols, mask, dim, stride_xb, stride_xs, stride_shift, stride_scale, eps
):  # fmt: skip
    """Row ``s`` of sample ``b``: ``LayerNorm(x) * (1 + scale) + shift`` in float32 (``cols``: the row's
    columns, ``mask`` those below ``dim``)."""
    x = tl.load(X + b * stride_xb + s * stride_xs + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / dim
    centred = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, 0) / dim + eps)
    scale = tl.load(SCALE + b * stride_scale + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(SHIFT + b * stride_shift + cols, mask=mask, other=0.0).to(tl.float32)
    return centred * rstd * (1.0 + scale) + shift


@triton.jit
def _norm_modulate_kernel(
    X,
    SHIFT,
    SCALE,
    OUT,
    TABLE,
    seq,
    dim,
    stride_xb,
    stride_xs,
    stride_shift,
    stride_scale,
    stride_ob,
    eps,
    BLOCK: tl.constexpr,
    DESTINATIONS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One row, written to ``OUT`` (rows of ``dim``, samples ``stride_ob`` apart) or, with a ``TABLE``,
    to each of ``DESTINATIONS`` places at its offsets from ``OUT`` (the ranks' buffers of a gather)."""
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    y = norm_modulate_row(
        X, SHIFT, SCALE, b, s, cols, mask, dim, stride_xb, stride_xs, stride_shift, stride_scale, eps
    ).to(OUT.dtype.element_ty)
    at = b.to(tl.int64) * stride_ob + s * dim + cols
    if TABLE is None:
        tl.store(OUT + at, y, mask=mask)
    else:
        for d in tl.static_range(DESTINATIONS):
            tl.store(OUT + tl.multiple_of(tl.load(TABLE + d), ALIGN) + at, y, mask=mask)


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
def _concat_gelu_kernel(A, B, OUT, dim_a, dim_b, stride_a, stride_b, stride_out, BLOCK: tl.constexpr):
    """One block of one row of ``cat([a, gelu_tanh(b)], -1)`` (rows of every sample ``stride_*`` apart).
    GELU as ``x * sigmoid(2u)``, which is ``0.5 x (1 + tanh(u))`` exactly: one exponential instead of
    CUDA's ``tanhf``, whose arithmetic made the kernel compute-bound (docs/archive/performance-history.md).
    The result is PyTorch's rounded value but for ~1 % of bf16 elements that sit one rounding step away, no
    farther from the float64 GELU (tested)."""
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
    tl.store(OUT + row * stride_out + cols, tl.where(in_a, a.to(dtype), gelu.to(dtype)), mask=cols < dim)


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
    TABLE,
    out_start,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ACROSS_HEADS: tl.constexpr,
    COPY_V: tl.constexpr,
    SCATTER: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """``BLOCK_H`` heads of one token of one segment (all of them ``ACROSS_HEADS``): its q and k normed
    and rotated, and (``COPY_V``) its v copied, each written at the token's place in the joint
    ``[B, S, H, D]`` tensors (each sample's tokens contiguous; k and v laid out alike), or (``SCATTER``)
    where ``TABLE`` puts each head. Heads are read and written whole (coalesced), every load issued before
    the math."""
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
    token = out_start + s
    if SCATTER:
        q_at = _scattered(TABLE, 0, h, heads, b, token, ALIGN)
        k_at = _scattered(TABLE, 1, h, heads, b, token, ALIGN)
        v_at = _scattered(TABLE, 2, h, heads, b, token, ALIGN)
    else:
        at = (token * heads + h) * HEAD_DIM
        q_at = b.to(tl.int64) * stride_out_qb + at
        k_at = b.to(tl.int64) * stride_out_kvb + at
        v_at = k_at
    q = _norm_rope(q, WQ, cos, sin, h, d, mask, heads, eps, HEAD_DIM, BLOCK_H, ACROSS_HEADS)
    tl.store(OUT_Q + q_at + d, q.to(dtype), mask=mask)
    k = _norm_rope(k, WK, cos, sin, h, d, mask, heads, eps, HEAD_DIM, BLOCK_H, ACROSS_HEADS)
    tl.store(OUT_K + k_at + d, k.to(dtype), mask=mask)
    if COPY_V:
        tl.store(OUT_V + v_at + d, v.to(dtype), mask=mask)


@triton.jit
def _scattered(TABLE, which, h, heads, b, token, ALIGN: tl.constexpr):
    """Where head ``h`` of q, k or v (``which``) of sample ``b``'s ``token`` starts: ``TABLE[which]`` holds
    each head's offset, sample stride and token stride (int64, multiples of ``ALIGN``)."""
    row = TABLE + which * 3 * heads + h
    valid = h < heads
    offset = tl.load(row, mask=valid, other=0)
    sample = tl.load(row + heads, mask=valid, other=0)
    step = tl.load(row + 2 * heads, mask=valid, other=0)
    return tl.multiple_of(offset + b * sample + token * step, [ALIGN, ALIGN])


@torch.library.custom_op("omni_accel::norm_modulate", mutates_args=())
def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with first_launches() as launches:
        if not launches.deferred:
            norm_modulate_into(x, shift, scale, eps, [out])
    return fused.norm_modulate_reference(x, shift, scale, eps) if launches.deferred else out


def norm_modulate_into(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, outs: list[torch.Tensor]
) -> None:
    """``norm_modulate`` written into each of ``outs`` (``[B, S, D]`` with contiguous rows, the same
    strides, maybe peers' memory: a gather's buffers)."""
    batch, seq, dim = x.shape
    if not batch * seq:
        return
    wait_for_driver()
    stride_ob = outs[0].stride(0)
    if any(
        out.shape != x.shape or out.stride()[1:] != (dim, 1) or out.stride(0) != stride_ob for out in outs
    ):
        raise ValueError(
            f"norm_modulate: destinations {[tuple(out.stride()) for out in outs]} are not alike rows"
        )
    table, base, align = None, outs[0], 1
    if len(outs) > 1:
        base = min(outs, key=torch.Tensor.data_ptr)
        offsets = tuple((out.data_ptr() - base.data_ptr()) // out.element_size() for out in outs)
        table, align = _table(offsets, x.device), _alignment(offsets, base.element_size())
    _norm_modulate_kernel[(batch * seq,)](
        x, shift, scale, base, table, seq, dim, x.stride(0), x.stride(1), shift.stride(0), scale.stride(0),
        stride_ob, eps, BLOCK=triton.next_power_of_2(dim), DESTINATIONS=len(outs), ALIGN=align,
    )  # fmt: skip


@norm_modulate.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("omni_accel::gated_residual", mutates_args=())
def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    numel = x.numel()
    if numel:
        block = 1024
        with first_launches() as launches:
            if not launches.deferred:
                _gated_residual_kernel[(triton.cdiv(numel, block),)](
                    x, gate, y, out, x.shape[1], x.shape[2], gate.stride(0), numel, BLOCK=block
                )
        if launches.deferred:
            return fused.gated_residual_reference(x, gate, y)
    return out


@gated_residual.register_fake
def _(x, gate, y):
    return torch.empty_like(x)


@torch.library.custom_op("omni_accel::concat_gelu", mutates_args=())
def concat_gelu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows evenly spaced across samples (contiguous, or columns of a packed projection)."""
    out = torch.empty((*b.shape[:2], a.shape[2] + b.shape[2]), dtype=b.dtype, device=b.device)
    with first_launches() as launches:
        if not launches.deferred:
            concat_gelu_into(a, b, out)
    return fused.concat_gelu_reference(a, b) if launches.deferred else out


def concat_gelu_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``concat_gelu`` written into ``out`` (rows evenly spaced across samples, maybe columns of a wider
    tensor: a projection's input whose other columns are written elsewhere)."""
    batch, seq, dim_a = a.shape
    dim_b = b.shape[2]
    if out.numel():
        wait_for_driver()
        block = 1024
        _concat_gelu_kernel[(batch * seq, triton.cdiv(dim_a + dim_b, block))](
            a, b, out, dim_a, dim_b, a.stride(1), b.stride(1), out.stride(1), BLOCK=block
        )


@concat_gelu.register_fake
def _(a, b):
    return b.new_empty(*b.shape[:2], a.shape[2] + b.shape[2])


# A head per program leaves too little in flight, a whole padded row (FLUX's 24 heads as 32) wastes lanes:
# eight heads measured fastest at FLUX's shapes (docs/archive/performance-history.md).
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
    args = (qs, ks, vs, q_weights, k_weights, head_dim, eps, cos, sin, across_heads)
    with first_launches() as launches:
        if not launches.deferred:
            qkv_norm_rope_into(*args, [((0, out),) for out in outs])
    if launches.deferred:  # a segment's launch, or more: the whole from the reference
        return fused.qkv_norm_rope_reference(
            qs, ks, vs, q_weights, k_weights, head_dim, eps, (cos, sin), across_heads
        )
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
    outs: list[HeadPieces],
) -> None:
    """``qkv_norm_rope`` written into ``outs``: for q, k and (with ``vs``) v, ``(first head, destination)``
    pieces covering the heads (``parallel.placement``), each destination ``[B, S, heads, D]`` (maybe a
    peer's memory). One piece per tensor with each sample's tokens contiguous, k and v alike, is written
    with plain strides; any other layout through a table of where each head goes."""
    wait_for_driver()
    first = qs[0]
    batch, heads = first.shape[0], first.shape[2] // head_dim
    eps = torch.finfo(first.dtype).eps if eps is None else eps
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    heads_per_program = heads if across_heads else min(_HEADS_PER_PROGRAM, heads)  # the norm needs the row
    block_h = triton.next_power_of_2(heads_per_program)
    warps = 4 if block_h * head_dim <= 4096 else 8  # Wan 14B's 40 heads: 8192 values per token
    table, bases, align = _destinations(outs if vs else [*outs, outs[1]], heads, head_dim)  # v: unwritten
    start = 0
    for i, (q, k, wq, wk) in enumerate(zip(qs, ks, q_weights, k_weights, strict=True)):
        v = vs[i] if vs else q  # unread without COPY_V
        seq = q.shape[1]
        if batch * seq:
            _qkv_norm_rope_kernel[(batch * seq, triton.cdiv(heads, block_h))](
                q, k, v, wq, wk, cos, sin, *bases, seq, heads,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                bases[0].stride(0), bases[1].stride(0), table, start, eps,
                HEAD_DIM=head_dim, BLOCK_H=block_h, ACROSS_HEADS=across_heads, COPY_V=bool(vs),
                SCATTER=table is not None, ALIGN=align, num_warps=warps,
            )  # fmt: skip
        start += seq


def _destinations(outs: list[HeadPieces], heads: int, head_dim: int):
    """``(table, base tensors of q, k and v, alignment)`` for the kernel: no table where each tensor is one
    piece whose samples hold contiguous ``[S, heads, D]`` rows, k and v with the same strides."""
    for pieces in outs:
        count = 0
        for first, dst in pieces:
            if first != count or dst.shape[-1] != head_dim or dst.stride(-1) != 1:
                raise ValueError(f"qkv_norm_rope: destinations {[(f, tuple(d.shape)) for f, d in pieces]} "
                                 f"do not cover {heads} heads of {head_dim} in order")  # fmt: skip
            count += dst.shape[2]
        if count != heads:
            raise ValueError(f"qkv_norm_rope: destinations cover {count} of {heads} heads")
    lone = [pieces[0][1] for pieces in outs if len(pieces) == 1]
    rows_alike = all(t.stride()[1:] == (heads * head_dim, head_dim, 1) for t in lone)
    if len(lone) == 3 and rows_alike and lone[1].stride(0) == lone[2].stride(0):
        return None, lone, 1
    rows, bases = [], []
    for pieces in outs:
        base = min((dst for _, dst in pieces), key=torch.Tensor.data_ptr)
        bases.append(base)
        heads_of = [
            ((dst.data_ptr() - base.data_ptr()) // dst.element_size() + h * dst.stride(2), *dst.stride()[:2])
            for _, dst in pieces
            for h in range(dst.shape[2])
        ]
        rows += [list(field) for field in zip(*heads_of, strict=True)]
    values = tuple(value for row in rows for value in row)
    return _table(values, bases[0].device), bases, _alignment(values, bases[0].element_size())


def _alignment(values: Sequence[int], itemsize: int) -> int:
    """The largest power of two, up to 16 bytes' worth of elements, dividing every value."""
    align = 16 // itemsize
    while align > 1 and any(value % align for value in values):
        align //= 2
    return align


# Kept for good: a captured CUDA graph reads its table at every replay (and, if it was built inside the
# capture, the pinned host copy too). One per buffer layout, a few hundred bytes each.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The table on ``device``, built once per layout (the buffers it points into live as long)."""
    key = (values, device)
    if key not in _TABLES:
        host = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        _TABLES[key] = host.to(device, non_blocking=True), host
    return _TABLES[key][0]


@qkv_norm_rope.register_fake
def _(qs, ks, vs, q_weights, k_weights, head_dim, eps, cos, sin, across_heads=False):
    first = qs[0]
    total = sum(q.shape[1] for q in qs)
    shape = (first.shape[0], total, first.shape[2] // head_dim, head_dim)
    return [first.new_empty(shape) for _ in range(3 if vs else 2)]
