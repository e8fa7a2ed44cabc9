"""Registering our layout hooks through Diffusers' ``HookRegistry``: named, composable with the user's own
hooks (step caches, offload, layerwise casting) and removable."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from diffusers.hooks import HookRegistry, ModelHook
from torch import nn


class LayoutHook(ModelHook):
    """A hook of a parallel layout. It decides from the arguments' shapes alone, so a CUDA graph captured
    with it stays right for every call with the same key; ``replay_key`` adds what else it decided for the
    call in flight (see ``omni_accel.cuda_graphs``)."""

    def replay_key(self) -> tuple:
        return ()


def register(module: nn.Module, hook: ModelHook, name: str) -> Callable[[], None]:
    """Registers ``hook`` on ``module`` as ``name``; returns the undo."""
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(hook, name)
    return lambda: registry.remove_hook(name, recurse=False)


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def bound_arguments(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward call's arguments by name (pipelines pass most by keyword, some positionally)."""
    signature = _forward_signature(type(module))
    arguments = signature.bind(module, *args, **kwargs).arguments
    arguments.pop(next(iter(signature.parameters)))  # self
    return dict(arguments)
