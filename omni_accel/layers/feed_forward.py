"""The transformer MLP: up projection, activation, down projection (each maybe LoRA, maybe TP-split)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.token_rows import Rows
from .fused import gelu_tanh
from .projection import LinearWeights, apply_one


def feed_forward(
    x: torch.Tensor,
    up: LinearWeights,
    down: LinearWeights,
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
    rows: Rows | None = None,
    gathered: bool = False,
) -> torch.Tensor:
    """``down(activation(up(x)))``; under tensor parallelism ``up`` splits its outputs and ``down`` its
    inputs, so the activation runs on the local slice and one all-reduce (with the tokens split, ``rows``:
    a gather before and a reduce-scatter after) frames the MLP. ``gathered``: ``x`` holds every rank's
    tokens already (``norm_modulate_gathered``)."""
    return apply_one(activation(apply_one(x, up, None if gathered else rows)), down, rows)
