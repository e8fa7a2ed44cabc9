"""Diffusers' TaylorSeer hook on a native block's attention module, run around the native math of it.

Target: ``TaylorSeerCacheHook.fn_ref.original_forward`` (``diffusers.hooks.taylorseer_cache``), the forward
the hook's ``new_forward`` calls on the steps it computes (on the others it returns its Taylor prediction).
Why: a native block computes its attention module's math fused, over the module's weights, and never calls
the module, so a hook on it would never run: the block had to run Diffusers' forward instead. The hook reads
none of the module's arguments and records only what the forward returns, so for one call ``call_through``
points it at the native computation and calls the module with no arguments: the hook decides as it does on
Diffusers' module, records the native outputs or predicts, and the original forward is back before the call
returns (under a lock, so that two threads calling one module cannot leave each other's computation behind).
Nothing stays patched between calls.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from torch import nn

from omni_accel.forward_hooks import has_foreign_torch_hooks

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")

_LOCK = threading.RLock()


@functools.cache
def _hook_class() -> type | None:
    """TaylorSeer's hook class, where the installed Diffusers is one this patch was checked against."""
    from omni_accel import patches

    if not patches.applicable(__name__.rsplit(".", 1)[1]):
        return None
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook

    return TaylorSeerCacheHook


def runs_around(module: nn.Module) -> bool:
    """Whether ``module``'s hooks are what ``call_through`` can run around a computation: one Diffusers
    hook, TaylorSeer's, and no torch hook of anyone else's (those see the arguments; this call has none)."""
    registry = module.__dict__.get("_diffusers_hook")
    if registry is None or len(registry.hooks) != 1 or has_foreign_torch_hooks(module):
        return False
    hook_class = _hook_class()
    return hook_class is not None and all(type(hook) is hook_class for hook in registry.hooks.values())


def call_through(module: nn.Module, compute: Callable[[], Any]) -> Any:
    """What ``module``'s hook returns with ``compute`` as the module's forward: ``compute()``'s outputs,
    recorded, on the steps it computes; its prediction on the others, where ``compute`` is not called."""
    (hook,) = module._diffusers_hook.hooks.values()
    reference = hook.fn_ref
    with _LOCK:
        original = reference.original_forward
        reference.original_forward = lambda *args, **kwargs: compute()
        try:
            return module()
        finally:
            reference.original_forward = original
