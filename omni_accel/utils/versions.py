"""A tensor's version counter, for keying what was computed from it."""

from __future__ import annotations

import torch


def version_of(tensor: torch.Tensor) -> int | None:
    """``tensor._version`` (an in-place write bumps it), or None for an inference tensor, which has none:
    such a tensor is keyed by its identity alone."""
    return None if tensor.is_inference() else tensor._version
