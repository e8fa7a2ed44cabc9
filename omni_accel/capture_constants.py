"""Tensors a forward makes from Python values on the GPU, served while a CUDA graph is captured.

``torch.tensor(values, device="cuda")`` and ``torch.as_tensor`` build the tensor on the host and copy it
from pageable memory, which a capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph
capture unless the CPU tensor is pinned"). Diffusers' Qwen-Image makes its text length so, and LTX-2 its
patch sizes and scale factors, so their steps never captured. ``CaptureConstants`` is the torch-function
mode a capture that failed so is retried under: such calls build their values in pinned host memory, kept
alive with the graph, and the graph copies them from there at every replay. They are the same values at
every replay, since a graph's key names everything the host decides a step with (its arguments, which are
all on the GPU, the modules' attributes, the global switches).

Compiled code runs outside the mode (``outside_capture_constants``): Dynamo guards the torch-function mode
stack, so a compiled block called under it would compile again, inside the capture.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily

_FACTORIES = {torch.tensor: ("data",), torch.as_tensor: ("data", "dtype", "device")}
_ACTIVE = threading.local()  # the mode this thread captures under, if any
REFUSED_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"


class CaptureConstants(TorchFunctionMode):
    """Serves ``torch.tensor`` / ``torch.as_tensor`` of host values onto a GPU from pinned memory; the
    pinned tensors are in ``pinned``, for the graph to keep."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[torch.Tensor] = []

    def __enter__(self) -> CaptureConstants:
        _ACTIVE.mode = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.mode = None
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            served = self._from_pinned(func, args, kwargs)
            if served is not None:
                return served
        return func(*args, **kwargs)

    def _from_pinned(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
        bound = dict(zip(_FACTORIES[func], args, strict=False)) | kwargs
        device, data = bound.get("device"), bound.get("data")
        if device is None or torch.device(device).type != "cuda" or bound.get("requires_grad"):
            return None
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(data)):
            return None  # a tensor's values are not host constants of this step
        pinned = func(data, dtype=bound.get("dtype")).pin_memory()
        self.pinned.append(pinned)
        return pinned.to(device, non_blocking=True)


def outside_capture_constants(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with this thread's ``CaptureConstants`` (if any) off: for compiled code."""
    mode = getattr(_ACTIVE, "mode", None)
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        return fn(*args, **kwargs)
    with _pop_mode_temporarily():
        return fn(*args, **kwargs)
