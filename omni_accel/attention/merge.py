"""Merging attention over disjoint key blocks: what ring attention does with each block's partial result.

Each partial is softmax-normalised over its own keys; rescaling by ``exp(lse_part - lse_total)`` turns them
into weights of the softmax over all keys, so the merge is exact. The math runs in (at least) float32
because the weights are differences of large logits. On CUDA with Triton the merge is one kernel (a pass
over both partials, no float32 copies of them, the result stored in the dtype asked for); elsewhere, and
while compiling, the reference below runs.
"""

from __future__ import annotations

import torch

from ..utils.kernels import HAS_TRITON, kernels_can_run


def merge_partials(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folds attention over one more key block into the running ``(out, lse)`` (``None`` before the first
    block). ``out`` is BSHD, ``lse`` ``[batch, heads, seq]``. The merged output has ``out_dtype``, by
    default float32 (or wider) so further merges do not round in between."""
    if out is None or lse is None:
        return block_out if out_dtype is None else block_out.to(out_dtype), block_lse
    dtype = torch.promote_types(torch.promote_types(out.dtype, block_out.dtype), torch.float32)
    out_dtype = dtype if out_dtype is None else out_dtype
    if _use_kernel(out, lse, block_out, block_lse, dtype):
        return torch.ops.omni_accel.merge_attention(out, lse, block_out, block_lse, out_dtype)
    out, lse, block_out, block_lse = (t.to(dtype) for t in (out, lse, block_out, block_lse))
    total = torch.logaddexp(lse, block_lse)

    def weight(part_lse: torch.Tensor) -> torch.Tensor:
        return torch.exp(part_lse - total).transpose(1, 2).unsqueeze(-1)

    return (out * weight(lse) + block_out * weight(block_lse)).to(out_dtype), total


def _use_kernel(out, lse, block_out, block_lse, dtype: torch.dtype) -> bool:
    return (
        dtype == torch.float32
        and kernels_can_run(out, lse, block_out, block_lse)
        and out.shape == block_out.shape
        and out.stride(-1) == block_out.stride(-1) == 1
    )


if HAS_TRITON:
    from . import merge_kernel  # noqa: F401  (registers the custom op)
