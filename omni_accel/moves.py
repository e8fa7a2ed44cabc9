"""What an accelerated module derived from its weights, let go of as the module moves.

A Diffusers user moves a pipeline to the CPU (``pipe.to("cpu")``, model CPU offload between requests) to
free its GPU memory for something else; plain Diffusers then holds nothing there. Our stores keep device
tensors made from the weights: the exact projection cache's outputs, the FP8 copies, the CUDA graphs and
their memory pool, the calls queued for a background compile. Each would see at its next use that the
weights moved, but the memory is wanted now, and a pipeline moved away may never be called again. So the
accelerated module gets an instance ``_apply`` (where ``Module.to``, ``cpu``, ``half``, ``to_empty``... end,
and what ``pipe.to`` and accelerate's offload hooks call), which runs the module's own and then has each
store drop what it made of tensors the move replaced (a ``to`` a device and dtype the weights already have
replaces none: nothing is dropped). Nothing but our stores is touched; ``restore`` removes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import nn


class DropsMoved(Protocol):
    def drop_moved(self) -> None:
        """Drops what was made of tensors that are no longer the module's, where they were."""


class AfterMoves:
    """The instance ``_apply`` of an accelerated module (see the module docstring). ``inner``: an
    instance ``_apply`` set before ours, called instead of the class's."""

    def __init__(self, module: nn.Module, stores: Sequence[DropsMoved]) -> None:
        self.module = module
        self.stores = tuple(stores)
        self.inner: Callable[..., Any] | None = module.__dict__.get("_apply")
        self.enabled = True

    def install(self) -> None:
        self.module._apply = self

    def uninstall(self) -> None:
        """Removes ours, or where something set since wraps it, makes it pass through."""
        if self.module.__dict__.get("_apply") is not self:
            self.enabled = False
        elif self.inner is None:
            del self.module._apply
        else:
            self.module._apply = self.inner

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> nn.Module:
        apply = self.inner if self.inner is not None else type(self.module)._apply.__get__(self.module)
        result = apply(fn, *args, **kwargs)
        if self.enabled:
            for store in self.stores:
                store.drop_moved()
        return result
