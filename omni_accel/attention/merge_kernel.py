"""The Triton kernel behind ``attention.merge`` (imported only when Triton is installed), a custom op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.triton_builds import wait_for_driver


@triton.jit
def _merge_kernel(
    OA, LA, OB, LB, OUT, LSE, seq, heads,
    s_oa_b, s_oa_s, s_oa_h, s_ob_b, s_ob_s, s_ob_h, s_la_b, s_la_h, s_la_s, s_lb_b, s_lb_h, s_lb_s,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One query token, every head: both partials weighted by their share of the total softmax mass."""
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)[None, :]
    in_h = h < heads
    la = tl.load(LA + b * s_la_b + h * s_la_h + s * s_la_s, mask=in_h, other=0.0).to(tl.float32)
    lb = tl.load(LB + b * s_lb_b + h * s_lb_h + s * s_lb_s, mask=in_h, other=0.0).to(tl.float32)
    top = tl.maximum(la, lb)
    total = top + tl.log(tl.exp(la - top) + tl.exp(lb - top))
    wa = tl.exp(la - total)[:, None]
    wb = tl.exp(lb - total)[:, None]
    mask = in_h[:, None] & (d < HEAD_DIM)
    hh = h[:, None]
    oa = tl.load(OA + b * s_oa_b + s * s_oa_s + hh * s_oa_h + d, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(OB + b * s_ob_b + s * s_ob_s + hh * s_ob_h + d, mask=mask, other=0.0).to(tl.float32)
    merged = oa * wa + ob * wb
    tl.store(OUT + (row * heads + hh) * HEAD_DIM + d, merged.to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE + (b * heads + h) * seq + s, total, mask=in_h)


@torch.library.custom_op("omni_accel::merge_attention", mutates_args=())
def merge_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, head_dim = out.shape
    merged = torch.empty((batch, seq, heads, head_dim), dtype=out_dtype, device=out.device)
    total = torch.empty((batch, heads, seq), dtype=torch.float32, device=out.device)
    if merged.numel():
        wait_for_driver()
        block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
        _merge_kernel[(batch * seq,)](
            out, lse, block_out, block_lse, merged, total, seq, heads,
            *out.stride()[:3], *block_out.stride()[:3], *lse.stride(), *block_lse.stride(),
            HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d <= 4096 else 8,
        )  # fmt: skip
    return merged, total


@merge_attention.register_fake
def _(out, lse, block_out, block_lse, out_dtype):
    batch, seq, heads, head_dim = out.shape
    return out.new_empty(batch, seq, heads, head_dim, dtype=out_dtype), lse.new_empty(
        batch, heads, seq, dtype=torch.float32
    )
