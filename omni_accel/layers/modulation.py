"""AdaLN modulation: a projection of SiLU(conditioning) chunked into shift/scale/gate vectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.projection import ExactProjectionCache
from .linear import ReplicatedLinear


class Modulation(nn.Module):
    """Replicated on every rank: its output indexes the full hidden size.

    Its input repeats (the same timestep embedding across requests and CFG branches), so it is a
    projection-cache site: with ``projection_cache`` set, the output is reused when provably identical.
    """

    projection_cache: ExactProjectionCache | None = None
    projection_name: str = "modulation"

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.linear = ReplicatedLinear(dim, chunks * dim)

    def forward(self, conditioning: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def compute() -> torch.Tensor:
            return self.linear(F.silu(conditioning))

        cache = self.projection_cache
        out = (
            compute()
            if cache is None
            else cache.project(self.projection_name, self.linear, conditioning, compute)
        )
        return out.chunk(self.chunks, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift`` with per-sample vectors broadcast over the sequence."""
    return x * (1 + scale[:, None]) + shift[:, None]
