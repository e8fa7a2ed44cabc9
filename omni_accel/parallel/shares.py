"""How many tokens of a sequence each rank holds, where the layout alone cannot tell.

A plan taken from Diffusers' (``diffusers_plan``) says which tensors are split, not which of them an
attention call joins, and some tokens are never split (LTX-2's audio). Where every stream splits evenly,
every rank holds as many tokens of any sequence as this one. Where some stream splits unevenly, the ranks
tell each other their lengths: once per attention call of a forward with given input shapes, keyed by the
call's place in that forward (the ranks run the same calls in the same order), then cached, so that later
steps, and CUDA graph captures, exchange nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .sequence import SequenceParallel

_KEPT = 4096  # cached lengths per layout: many shapes' worth of calls


class SequenceShares:
    """Every rank's lengths for each attention call of a forward, exchanged once per input shapes."""

    def __init__(self) -> None:
        self._known: dict[tuple, list[tuple[int, ...]]] = {}
        self._signature: tuple = ()
        self._call = 0

    def begin(self, signature: tuple) -> None:
        self._signature, self._call = signature, 0

    def exchange(self, lengths: tuple[int, ...], groups: dict[str, Any]) -> list[tuple[int, ...]]:
        """Per sequence slice (``SequenceParallel.index`` order), its rank's ``lengths``."""
        key = (self._signature, self._call)
        self._call += 1
        known = self._known.get(key)
        if known is None:
            if len(self._known) >= _KEPT:
                self._known.clear()
            known = self._known[key] = _all_lengths(lengths, groups)
        if known[_index(groups)] != lengths:
            raise RuntimeError(
                f"sequence parallelism: an attention call holds {lengths} tokens here, but {known[_index(groups)]} "
                "in an earlier forward with the same input shapes; the model's shapes depend on more than its "
                "inputs' shapes. Run it with ulysses=1 and ring=1."
            )
        return known


def _index(groups: dict[str, Any]) -> int:
    return SequenceParallel((1,) * _degree(groups), None, **groups).index


def _degree(groups: dict[str, Any]) -> int:
    degree = 1
    for group in groups.values():
        degree *= 1 if group is None else dist.get_world_size(group)
    return degree


def _all_lengths(lengths: tuple[int, ...], groups: dict[str, Any]) -> list[tuple[int, ...]]:
    some = next(g for g in groups.values() if g is not None)
    device = "cuda" if "nccl" in str(dist.get_backend(some)) else "cpu"
    mine = torch.tensor([lengths], dtype=torch.int64, device=device)
    every = SequenceParallel((1,) * _degree(groups), None, **groups).gather(mine, 0)
    return [tuple(row) for row in every.tolist()]


def signature(arguments: dict[str, Any]) -> tuple:
    """What decides a forward's shapes, the same on every rank: its arguments' shapes and plain values."""
    return tuple((name, _shape(value)) for name, value in sorted(arguments.items()))


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, list | tuple):
        return tuple(_shape(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _shape(item)) for key, item in sorted(value.items(), key=lambda kv: str(kv[0])))
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return type(value).__name__
