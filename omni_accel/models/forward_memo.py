"""What every block of one forward shares and a native model hands each block in another form (RoPE
tables converted for our kernels, a key mask): made at the first block that needs it and reused by the
next ones. The same mask tensor at every block also lets attention drop the padded keys (see
``attention.key_padding``).

A memo is a class attribute of a native block class, shared by every pipeline of that class: what it holds
must not outlive its use. A value is let go of as soon as one of the tensors it was made from dies (the
forward that made them ended), and ``drop`` lets go of every thread's when a module moves or is restored
(``NativeBlock.memos``), so the memo pins no device memory and no tensor of a pipeline the user dropped.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..utils.versions import version_of


class _Slot:
    """One thread's last value: ``state`` is (weak refs to the key tensors, their versions, ``extra``, the
    value), or None. Replaced whole, so a reader in the owning thread sees all of one state or None."""

    __slots__ = ("state", "__weakref__")

    def __init__(self) -> None:
        self.state: tuple[tuple[weakref.ref, ...], tuple[Hashable, ...], Hashable, Any] | None = None


def _forget_dead(slot_ref: weakref.ref, _dead: weakref.ref) -> None:
    """A key tensor died: the slot lets go of its value if the tensor was one of its keys (the callback
    of an older state's key finds the keys of the current one alive and leaves it)."""
    slot = slot_ref()
    state = None if slot is None else slot.state
    if state is not None and any(ref() is None for ref in state[0]):
        slot.state = None


class ForwardMemo:
    """Per thread, the last value made, keyed by the tensors it was made from (alive and unwritten) and an
    ``extra`` value."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._slots: weakref.WeakSet[_Slot] = weakref.WeakSet()  # every thread's, for ``drop``
        self._lock = threading.Lock()

    def get(self, key: tuple[torch.Tensor, ...], extra: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, or what it made for the same ``key`` tensors and ``extra`` value last time."""
        versions = tuple(version_of(t) for t in key)
        slot = getattr(self._local, "slot", None)
        state = None if slot is None else slot.state
        if (
            state is not None
            and state[1:3] == (versions, extra)
            and len(state[0]) == len(key)
            and all(ref() is t for ref, t in zip(state[0], key, strict=True))
        ):
            return state[3]
        if slot is None:
            slot = self._local.slot = _Slot()
            with self._lock:
                self._slots.add(slot)
        value = make()
        forget = functools.partial(_forget_dead, weakref.ref(slot))  # the slot held weakly: no cycle
        slot.state = (tuple(weakref.ref(t, forget) for t in key), versions, extra, value)
        return value

    def drop(self) -> None:
        """Lets go of every thread's value (the next ``get`` of each makes it again)."""
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            slot.state = None
