"""Key-padding masks served without a dense mask: the padded keys are dropped and an unmasked kernel runs.

A boolean mask that only says which keys exist (``[B, 1, 1, S_k]``, the same for every head and query: a
padded text prompt joined with image tokens) gives every padded key a weight of exactly zero, so attention
over the kept keys alone is the same function, and unmasked it runs the fastest kernel for the shape,
faster than the dense mask plain Diffusers runs, gathers included (``benchmarks/kernel_bench.py
masked-attention``; docs/archive/performance-history.md).

Which keys a mask keeps must be read on the host, and that synchronisation costs more than the kernel saves
when it happens at every call (Qwen-Image builds a new mask in every block, and reading each made it slower
than Diffusers). No kernel that takes the count on the device beats the dense mask (PyTorch's ragged cuDNN
call, FlashAttention-2's varlen call, nvidia-cudnn-frontend's padded-batch call: the figures are in
docs/archive/performance-history.md). So a mask is read only when the same tensor comes back unchanged (models
that build it once per forward and pass it to every block): the first call runs with the dense mask, the mask
is read at the second, and the rest drop the padded keys, one synchronisation per forward. Never where the
host may not wait (compilation, CUDA graph capture).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from ..utils.versions import version_of

_LAST = threading.local()  # the last mask seen in this thread: (weak reference, version, what it keeps)


@dataclass(frozen=True)
class KeptKeys:
    """Per sample (or once for every sample: a mask of one row), the indices of the keys a mask keeps, or
    None where it keeps them all."""

    per_sample: tuple[torch.Tensor | None, ...]

    @property
    def all_kept(self) -> bool:
        return all(kept is None for kept in self.per_sample)


def kept_keys(
    mask: torch.Tensor | None, batch: int, kv_len: int, rows: bool = False, first_sight: bool = False
) -> KeptKeys | None:
    """What a key-padding ``mask`` keeps for a ``batch`` of queries over ``kv_len`` keys, or None (use the
    dense mask) when the mask is not one (another dtype or shape), is seen for the first time (see the
    module docstring), keeps no key of a sample (what a kernel does then is its own convention), or when
    the host must not synchronise. ``mask``: ``[B or 1, 1, 1, kv_len]`` as SDPA takes it, or with ``rows``
    the ``[B or 1, kv_len]`` rows Diffusers' native backend broadcasts so (a 2-D mask is SDPA's per-query
    one otherwise): the tensor the model passes, so that it is recognised when it comes back.
    ``first_sight``: read a mask the first time it is seen too (a caller that passes one tensor to every
    block of a forward, and across steps: one synchronisation per mask, and every call served alike)."""
    if not _is_key_padding(mask, kv_len, rows) or mask.shape[0] not in (1, batch):
        return None
    if torch.compiler.is_dynamo_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    last = getattr(_LAST, "entry", None)
    if last is None or last[0]() is not mask or last[1] != version_of(mask):
        _LAST.entry = (weakref.ref(mask), version_of(mask), None)  # read if it comes back
        if not first_sight:
            return None
        last = _LAST.entry
    kept = last[2]
    if kept is None:
        kept = _read(mask.reshape(mask.shape[0], kv_len))
        _LAST.entry = (last[0], last[1], kept)
    return None if kept is _KEEPS_NO_KEY_OF_A_SAMPLE else kept


def _is_key_padding(mask: torch.Tensor | None, kv_len: int, rows: bool) -> bool:
    return (
        mask is not None
        and mask.dtype == torch.bool
        and (mask.ndim == 2 if rows else mask.ndim == 4 and mask.shape[1] == mask.shape[2] == 1)
        and mask.shape[-1] == kv_len
    )


_KEEPS_NO_KEY_OF_A_SAMPLE = KeptKeys(())


def _read(rows: torch.Tensor) -> KeptKeys:
    counts = rows.sum(dim=1).tolist()  # the one synchronisation
    if min(counts) == 0:
        return _KEEPS_NO_KEY_OF_A_SAMPLE
    kv_len = rows.shape[1]
    per_sample = []
    for row, count in zip(rows, counts, strict=True):
        # The kept keys' indices in order: a stable sort puts them first, and their count is known.
        first_kept = row.logical_not().to(torch.uint8).argsort(stable=True)
        per_sample.append(None if count == kv_len else first_kept[:count])
    return KeptKeys(tuple(per_sample))


def attend_kept(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kept: KeptKeys, attend
) -> torch.Tensor:
    """``attend(q, k, v)`` (unmasked, BSHD) over the kept keys of each sample: one call for the batch when
    every sample keeps the same keys, else one per sample."""
    if kept.all_kept:
        return attend(query, key, value)
    if len(kept.per_sample) == 1:
        (index,) = kept.per_sample
        return attend(query, key.index_select(1, index), value.index_select(1, index))
    outputs = []
    for sample, index in enumerate(kept.per_sample):
        q, k, v = (t[sample : sample + 1] for t in (query, key, value))
        if index is not None:
            k, v = k.index_select(1, index), v.index_select(1, index)
        outputs.append(attend(q, k, v))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
