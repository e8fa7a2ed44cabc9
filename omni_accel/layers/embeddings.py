"""Conditioning embedders: sinusoidal timesteps and two-layer MLP projections."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ReplicatedLinear


def timestep_sinusoid(
    t: torch.Tensor,
    dim: int,
    *,
    flip_sin_to_cos: bool = True,
    freq_shift: float = 0.0,
    max_period: int = 10000,
) -> torch.Tensor:
    """Sinusoidal features of a 1-D tensor of (possibly fractional) timesteps, in float32."""
    half = dim // 2
    exponent = (
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - freq_shift)
    )
    angles = t[:, None].float() * torch.exp(exponent)[None, :]
    sin, cos = torch.sin(angles), torch.cos(angles)
    features = torch.cat([cos, sin] if flip_sin_to_cos else [sin, cos], dim=-1)
    return F.pad(features, (0, 1)) if dim % 2 else features


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2 (timestep, guidance and pooled-text embedders all have this shape)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear_1 = ReplicatedLinear(in_features, out_features)
        self.linear_2 = ReplicatedLinear(out_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))
