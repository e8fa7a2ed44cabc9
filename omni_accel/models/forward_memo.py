"""What every block of one forward shares and a native model hands each block in another form (RoPE
tables converted for our kernels, a key mask): made at the first block that needs it and reused by the
next ones. The same mask tensor at every block also lets attention drop the padded keys (see
``attention.key_padding``)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..utils.versions import version_of


class ForwardMemo:
    """Per thread, the last value made, keyed by the tensors it was made from (alive and unwritten) and an
    ``extra`` value."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, key: tuple[torch.Tensor, ...], extra: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, or what it made for the same ``key`` tensors and ``extra`` value last time."""
        versions = tuple(version_of(t) for t in key)
        entry = getattr(self._local, "entry", None)
        if (
            entry is not None
            and entry[1:3] == (versions, extra)
            and len(entry[0]) == len(key)
            and all(ref() is t for ref, t in zip(entry[0], key, strict=True))
        ):
            return entry[3]
        value = make()
        self._local.entry = (tuple(weakref.ref(t) for t in key), versions, extra, value)
        return value
