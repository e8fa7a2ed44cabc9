"""Rotary position embedding on interleaved (even, odd) channel pairs."""

from __future__ import annotations

import torch


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rotates each (even, odd) channel pair of BSHD ``x``; math in ``dtype`` (by default float32, or the
    tables' float64), result in ``x``'s dtype. ``cos``/``sin`` are ``[S, D]`` (FLUX) or broadcastable
    ``[1, S, 1, D]`` (Wan), each frequency repeated for both channels of its pair."""
    if cos.ndim == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    dtype = torch.promote_types(torch.float32, cos.dtype) if dtype is None else dtype
    return (x.to(dtype) * cos + rotated.to(dtype) * sin).to(x.dtype)
