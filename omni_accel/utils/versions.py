"""A tensor's version counter, for keying what was computed from it."""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

_FORWARDS = threading.local()  # ``serial``: how many accelerated forwards began on this thread


def new_forward() -> None:
    """An accelerated transformer's forward begins on this thread (see ``version_of``)."""
    _FORWARDS.serial = getattr(_FORWARDS, "serial", 0) + 1


def forward_serial() -> int:
    """How many accelerated forwards began on this thread: what is checked once per forward keys on it."""
    return getattr(_FORWARDS, "serial", 0)


def version_of(tensor: torch.Tensor) -> Hashable:
    """``tensor._version`` (an in-place write bumps it). An inference tensor has none, and a write to it
    under inference mode leaves no trace: its version is the forward in flight instead, so what was made
    from it is reused within one forward only."""
    if tensor.is_inference():
        return ("inference", forward_serial())
    return tensor._version
