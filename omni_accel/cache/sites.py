"""Connecting an ExactProjectionCache to a model: native layers opt in, Diffusers modules are wrapped.

Native layers that can reuse a projection carry a ``projection_cache`` attribute (None by default);
``attach`` hands them the model's cache and a stable name. For a Diffusers module listed as a cache site
in the registry, ``wrap_module`` replaces its ``forward`` on that instance only (undone by ``restore``):
the input is prepared once per tensor and the output goes through ``project``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from torch import nn

from .projection import ExactProjectionCache


def attach(model: nn.Module, cache: ExactProjectionCache | None) -> int:
    """Gives every opted-in layer of ``model`` the cache; returns how many layers use it."""
    count = 0
    for name, module in model.named_modules():
        if hasattr(module, "projection_cache"):
            module.projection_cache = cache
            module.projection_name = name
            count += cache is not None
    return count


def wrap_module(module: nn.Module, name: str, cache: ExactProjectionCache) -> Callable[[], None]:
    """Routes ``module(x)`` through the cache; returns the undo."""
    original = module.forward

    def forward(x, *args, **kwargs):
        if args or kwargs:  # only single-input projections are cache sites
            return original(x, *args, **kwargs)
        cache.ensure_prepared(x)
        return cache.project(name, module, x, lambda: original(x))

    module.forward = forward

    def undo() -> None:
        del module.forward

    return undo


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
