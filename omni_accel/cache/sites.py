"""Connecting an ExactProjectionCache to a Diffusers model that has no native blocks.

(Native blocks consult the cache themselves, see ``NativeBlock.project_conditioning``.) For a Diffusers
module listed as a cache site in the registry, ``wrap_module`` replaces its ``forward`` on that instance only (undone by ``restore``):
the input is prepared once per tensor and the output goes through ``project``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..forward_hooks import InstanceForward
from .projection import ExactProjectionCache


class _CachedForward(InstanceForward):
    """``module``'s forward through the cache, set on that instance. An object rather than a closure so that
    ``copy.deepcopy`` of the model gives the copy a forward of its own module and its own cache; a Diffusers
    hook registered later wraps it, and ``restore`` then steps it aside rather than drop that hook."""

    def __init__(self, module: nn.Module, name: str, cache: ExactProjectionCache) -> None:
        super().__init__(module)
        self.name, self.cache = name, cache

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        original = self._forward()
        if not self.enabled or args or kwargs:  # only single-input projections are cache sites
            return original(x, *args, **kwargs)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # a replay could not consult the cache
            return original(x)
        self.cache.ensure_prepared(x)
        return self.cache.project(self.name, self.module, x, lambda: original(x))


def wrap_module(module: nn.Module, name: str, cache: ExactProjectionCache) -> Callable[[], None]:
    """Routes ``module(x)`` through the cache; returns the undo."""
    forward = _CachedForward(module, name, cache)
    forward.install()
    return forward.uninstall


def wrap_sites(
    model: nn.Module, patterns: Iterable[str], cache: ExactProjectionCache
) -> list[Callable[[], None]]:
    """Wraps every submodule whose full name matches one of ``patterns`` (regexes matched whole)."""
    compiled = [re.compile(p) for p in patterns]
    return [
        wrap_module(module, name, cache)
        for name, module in model.named_modules()
        if any(p.fullmatch(name) for p in compiled)
    ]
