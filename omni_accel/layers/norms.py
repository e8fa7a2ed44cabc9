"""Norms the native blocks compute themselves (PyTorch's fused kernels, a reduction over the TP ranks
where a norm spans heads they split)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..parallel.comm import all_reduce_sum


def layer_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm without affine parameters, as used before every AdaLN modulation."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_across_heads(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, tp_group: Any = None, width: int = 0
) -> torch.Tensor:
    """RMSNorm over the last dim, all heads at once (Wan's norm_q / norm_k). Under tensor parallelism
    (``tp_group``) this rank holds some heads of the ``width`` channels (and the matching slice of
    ``weight``): the mean square is summed over the ranks."""
    if tp_group is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    squares = all_reduce_sum(x.float().pow(2).sum(-1, keepdim=True), tp_group)
    normed = (x.float() * torch.rsqrt(squares / width + eps)).type_as(x)
    return normed if weight is None else normed * weight
