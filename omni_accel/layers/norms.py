"""Norms the native blocks compute themselves (PyTorch's fused F.layer_norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm without affine parameters, as used before every AdaLN modulation."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)
