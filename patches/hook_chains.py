"""Points the forward that hook chains wrap at a block's new class after its class is swapped.

Target: the bound ``forward`` a hook chain captured when it was installed on a block: Diffusers'
``HookRegistry`` (``module._diffusers_hook._fn_refs[i].forward`` / ``.original_forward``), accelerate's
``module._old_forward`` and a ``forward`` left on the instance by either. Why: a native block is the Diffusers
block with its class swapped; a hook installed before the swap (a step cache, group offload, a device map)
holds the Diffusers class's forward bound to the block and would keep running it. ``apply`` points those
references at the native forward, ``revert`` points them back, so hooks installed before, during or after
acceleration all wrap the forward of the block's current class.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")


def _retarget(block: nn.Module, old: Callable, new: Callable) -> None:
    def swap(bound):
        if isinstance(bound, types.MethodType) and bound.__func__ is old and bound.__self__ is block:
            return types.MethodType(new, block)
        return bound

    if "forward" in block.__dict__:
        block.__dict__["forward"] = swap(block.__dict__["forward"])
    if "_old_forward" in block.__dict__:
        block.__dict__["_old_forward"] = swap(block.__dict__["_old_forward"])
    registry = block.__dict__.get("_diffusers_hook")
    for ref in getattr(registry, "_fn_refs", ()):
        ref.forward = swap(ref.forward)
        ref.original_forward = swap(ref.original_forward)


def apply(block: nn.Module, old_class: type, new_class: type) -> None:
    _retarget(block, old_class.forward, new_class.forward)


def revert(block: nn.Module, old_class: type, new_class: type) -> None:
    _retarget(block, new_class.forward, old_class.forward)
