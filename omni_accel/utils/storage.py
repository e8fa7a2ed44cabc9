"""Tensors that lie one after another in one storage, read as one (packed projections' weights)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def contiguous_run(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one 2-D (or 1-D) tensor when each starts where the previous ends in one storage."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
            or not t.is_contiguous()
            or t.dtype != first.dtype
            or t.shape[1:] != first.shape[1:]
        ):
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.detach().as_strided(shape, first.stride())  # rows of a contiguous run: same strides
