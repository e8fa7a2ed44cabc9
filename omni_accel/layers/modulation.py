"""AdaLN modulation of a normalised activation."""

from __future__ import annotations

import torch


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift``; per-sample ``[B, D]`` vectors broadcast over the sequence, per-token
    ``[B, S, D]`` ones apply as they are."""
    if shift.ndim == 2:
        shift, scale = shift[:, None], scale[:, None]
    return x * (1 + scale) + shift
