"""Norms with the loader interface; fused kernels come from PyTorch's own F.rms_norm/F.layer_norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import default_weight_exporter, default_weight_loader


class RMSNorm(nn.Module):
    """RMS norm over the last dimension (per head for QK-norm, so it never spans a TP split)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.weight_exporter = default_weight_exporter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def layer_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm without affine parameters, as used before every AdaLN modulation."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)
