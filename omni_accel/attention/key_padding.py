"""Key-padding masks served without a dense mask, exactly: every padded key has a weight of exactly zero.

A boolean mask that only says which keys exist (``[B, 1, 1, S_k]``, the same for every head and query: a
padded text prompt joined with image tokens) can be served two ways, both faster than the dense mask
(Qwen-Image's shape at 1024x1024 with 212 of 512 text tokens padded, one H200, ``benchmarks/
masked_attention.py``: 0.69-0.81 ms for the dense mask, the kernel plain Diffusers runs):

* ``padded_on_device``: the kept keys sorted first on the device and their count per sample handed to
  cuDNN's padded-batch call (``nvidia-cudnn-frontend``'s ``torch.ops.cudnn.sdpa_fwd`` with ``seq_len_kv``),
  which skips the rest. No host synchronisation. Used where the unmasked call would run cuDNN anyway.
* ``kept_keys`` + ``attend_kept``: the kept keys' indices read on the host, the padded keys dropped, and
  any unmasked provider runs (cuDNN 0.54-0.61 ms, gathers included). The read is a synchronisation, which
  cost more than the kernel saves when it happened at every call (Qwen-Image builds a new mask in every
  block: 213.6 against 200.1 ms per forward), so a mask is read only when the same tensor comes back
  unchanged (models that build it once per forward and pass it to every block): the first call runs with
  the dense mask, the mask is read at the second, the rest drop the padded keys. Never where the host may
  not wait (compilation, CUDA graph capture). PyTorch's own ragged cuDNN call takes the count on the
  device too, but ran 38-66 ms.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass

import torch

_LAST = threading.local()  # the last mask seen in this thread: (weak reference, version, what it keeps)


@dataclass(frozen=True)
class KeptKeys:
    """Per sample (or once for every sample: a mask of one row), the indices of the keys a mask keeps, or
    None where it keeps them all."""

    per_sample: tuple[torch.Tensor | None, ...]

    @property
    def all_kept(self) -> bool:
        return all(kept is None for kept in self.per_sample)


def kept_keys(mask: torch.Tensor | None, batch: int, kv_len: int) -> KeptKeys | None:
    """What a key-padding ``mask`` keeps for a ``batch`` of queries over ``kv_len`` keys, or None (use the
    dense mask) when the mask is not one (another dtype or shape), is seen for the first time (see the
    module docstring), keeps no key of a sample (what a kernel does then is its own convention), or when
    the host must not synchronise."""
    if not is_key_padding(mask, kv_len) or mask.shape[0] not in (1, batch):
        return None
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    last = getattr(_LAST, "entry", None)
    if last is None or last[0]() is not mask or last[1] != mask._version:
        _LAST.entry = (weakref.ref(mask), mask._version, None)  # read if it comes back
        return None
    kept = last[2]
    if kept is None:
        kept = _read(mask.reshape(mask.shape[0], kv_len))
        _LAST.entry = (last[0], last[1], kept)
    return None if kept is _KEEPS_NO_KEY_OF_A_SAMPLE else kept


def is_key_padding(mask: torch.Tensor | None, kv_len: int) -> bool:
    return (
        mask is not None
        and mask.dtype == torch.bool
        and mask.ndim == 4
        and mask.shape[1] == mask.shape[2] == 1
        and mask.shape[3] == kv_len
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


def padded_on_device(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor | None:
    """Attention over BSHD tensors with a key-padding ``mask`` through cuDNN's padded-batch call, or None
    where that call is not available (see the module docstring). A sample that keeps no key gets what
    cuDNN gives for an empty sequence (the dense mask's kernels disagree there too)."""
    if not (padded_call_available() and mask.is_cuda and mask.shape[0] in (1, query.shape[0])):
        return None
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    rows = mask.reshape(mask.shape[0], -1)
    order = rows.logical_not().to(torch.uint8).argsort(dim=1, stable=True)  # kept keys first, in order
    if rows.shape[0] == 1:
        key, value = key.index_select(1, order[0]), value.index_select(1, order[0])
    else:
        index = order[:, :, None, None].expand(-1, -1, *key.shape[2:])
        key, value = key.gather(1, index), value.gather(1, index)
    batch = query.shape[0]
    kept = rows.sum(dim=1, dtype=torch.int32).expand(batch).contiguous()
    queries = torch.full((batch,), query.shape[1], dtype=torch.int32, device=query.device)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, _ = torch.ops.cudnn.sdpa_fwd(q, k, v, scale, seq_len_q=queries, seq_len_kv=kept, return_lse=False)
    return out.transpose(1, 2)


@functools.cache
def padded_call_available() -> bool:
    """``torch.ops.cudnn.sdpa_fwd`` registered (importing ``cudnn.sdpa_torch`` registers it)."""
    try:
        import cudnn

        cudnn.sdpa_torch  # noqa: B018  (the lazy export registers the op)
    except Exception:  # not installed, or a build that cannot load here
        return False
    return hasattr(torch.ops.cudnn, "sdpa_fwd")
