"""The transformer MLP: up projection, activation, down projection (each maybe LoRA, maybe TP-split)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .fused import gelu_tanh
from .projection import LinearWeights, apply_one


def feed_forward(
    x: torch.Tensor,
    up: LinearWeights,
    down: LinearWeights,
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
) -> torch.Tensor:
    """``down(activation(up(x)))``; under tensor parallelism ``up`` splits its outputs and ``down`` its
    inputs, so the activation runs on the local slice and one all-reduce ends the MLP."""
    return apply_one(activation(apply_one(x, up)), down)
