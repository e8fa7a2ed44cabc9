"""A deep copy of an object's attributes into a new instance of its class, as ``copy.deepcopy`` makes one:
for classes whose ``__reduce_ex__`` refuses pickling (so deepcopy cannot go through it) or that adjust
``memo`` before copying (shared process groups)."""

from __future__ import annotations

import copy
from typing import Any


def deepcopy_instance(obj: Any, memo: dict) -> Any:
    """A new instance of ``type(obj)`` holding deep copies of ``obj``'s attributes (registered in ``memo``
    first, so that cycles back to ``obj`` reach the copy)."""
    twin = object.__new__(type(obj))
    memo[id(obj)] = twin
    vars(twin).update(copy.deepcopy(vars(obj), memo))
    return twin
