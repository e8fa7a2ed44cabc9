"""Rotary position embedding over several position axes (text/height/width), interleaved pairs."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _frequency_dtype(device: torch.device) -> torch.dtype:
    # float64 keeps high positions exact; backends without float64 fall back to float32.
    return torch.float32 if device.type in ("mps", "npu") else torch.float64


def rope_cos_sin(
    ids: torch.Tensor, axes_dim: Sequence[int], theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` is ``[seq, n_axes]``; returns float32 ``cos, sin`` of shape ``[seq, sum(axes_dim)]`` in which
    every frequency appears twice in a row, matching the interleaved (even, odd) pairs of ``apply_rope``."""
    dtype = _frequency_dtype(ids.device)
    positions = ids.to(torch.float32)
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dim):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim))
        angles = torch.outer(positions[:, axis].to(dtype), inv_freq)
        cos_parts.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin_parts.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (even, odd) channel pair of BSHD ``x``; math in float32, result in ``x``'s dtype."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
