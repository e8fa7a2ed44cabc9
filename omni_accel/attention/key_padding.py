"""Key-padding masks served without a dense mask: the padded keys are dropped and an unmasked kernel runs.

A boolean mask that only says which keys exist (``[B, 1, 1, S_k]``, the same for every head and query: a
padded text prompt joined with image tokens) gives every padded key a weight of exactly zero, so attention
over the kept keys alone is the same function, and unmasked it runs the fastest kernel for the shape
(Qwen-Image at 1024x1024 with 212 of 512 text tokens padded, one H200: cuDNN 0.61 ms over the kept keys,
gathers included, against 0.81 ms for the dense mask, the kernel plain Diffusers runs;
``benchmarks/masked_attention.py``). Which keys a mask keeps is read on the host: one synchronisation per
mask tensor (a mask passed again unchanged is not read again), so it is skipped where the host may not wait
(compilation, CUDA graph capture) and the dense mask is used there.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

_LAST = threading.local()  # the last mask read in this thread, and what it kept


@dataclass(frozen=True)
class KeptKeys:
    """Per sample, the indices of the keys a mask keeps, or None where it keeps them all."""

    per_sample: tuple[torch.Tensor | None, ...]

    @property
    def all_kept(self) -> bool:
        return all(kept is None for kept in self.per_sample)


def kept_keys(mask: torch.Tensor | None, batch: int, kv_len: int) -> KeptKeys | None:
    """What a key-padding ``mask`` keeps for a ``batch`` of queries over ``kv_len`` keys, or None when the
    mask is not one (another dtype or shape), when a sample keeps no key (left to the dense mask: what a
    kernel does then is its own convention), or when the host must not synchronise."""
    if not _is_key_padding(mask, kv_len) or mask.shape[0] not in (1, batch):
        return None
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    last = getattr(_LAST, "entry", None)
    if last is not None and last[0]() is mask and last[1] == mask._version:
        kept = last[2]
    else:
        kept = _read(mask.reshape(mask.shape[0], kv_len))
        _LAST.entry = (weakref.ref(mask), mask._version, kept)
    if kept is None:
        return None
    return KeptKeys(kept.per_sample * batch if len(kept.per_sample) == 1 else kept.per_sample)


def _is_key_padding(mask: torch.Tensor | None, kv_len: int) -> bool:
    return (
        mask is not None
        and mask.dtype == torch.bool
        and mask.ndim == 4
        and mask.shape[1] == mask.shape[2] == 1
        and mask.shape[3] == kv_len
    )


def _read(rows: torch.Tensor) -> KeptKeys | None:
    counts = rows.sum(dim=1).tolist()  # the one synchronisation
    if min(counts) == 0:
        return None
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
    """``attend(q, k, v)`` (unmasked, BSHD) over the kept keys of each sample; samples that keep the same
    keys go together (all of them, when no key is padded)."""
    if kept.all_kept:
        return attend(query, key, value)
    outputs = []
    for sample, index in enumerate(kept.per_sample):
        q, k, v = (t[sample : sample + 1] for t in (query, key, value))
        if index is not None:
            k, v = k.index_select(1, index), v.index_select(1, index)
        outputs.append(attend(q, k, v))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
