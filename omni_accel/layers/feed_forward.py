"""The transformer MLP: up projection, activation, down projection (each maybe LoRA, maybe TP-split)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..parallel.token_rows import Rows
from .fused import gelu_tanh
from .projection import LinearWeights, apply_one, finish_projections, start_projection


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


def feed_forwards_together(
    items: Sequence[tuple[torch.Tensor, LinearWeights, LinearWeights, Rows | None, bool]],
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
) -> list[torch.Tensor]:
    """``feed_forward`` of each ``(x, up, down, rows, gathered)`` (independent streams of a block, of one TP
    group) one after the other, each MLP's partial sums travelling while the next MLP runs, and one barrier
    ending them all."""
    last = len(items) - 1
    started = [
        start_projection(
            activation(apply_one(x, up, None if gathered else rows)), down, rows, beside=i < last
        )
        for i, (x, up, down, rows, gathered) in enumerate(items)
    ]
    return finish_projections(started)
