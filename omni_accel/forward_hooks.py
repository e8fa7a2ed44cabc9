"""Whether anything wraps a module's forward: torch hooks, accelerate's ``_hf_hook``, Diffusers' HookRegistry.

Native blocks and the projection cache both skip work a hook may observe or change, so both ask here.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as module_globals


def global_hooks_active() -> bool:
    return bool(
        module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
        or module_globals._global_forward_hooks_always_called
    )


def is_hooked(module: nn.Module) -> bool:
    """A hook on this module itself (not its children)."""
    # Read the instance dict: hasattr() on a missing attribute runs Module.__getattr__ and raises, which
    # is most of the cost when this runs over every submodule of every block at every call.
    state = module.__dict__
    registry = state.get("_diffusers_hook")
    return bool(
        state["_forward_hooks"]
        or state["_forward_pre_hooks"]
        or "_hf_hook" in state
        or (registry is not None and registry.hooks)
    )


def _first_hooked_below(module: nn.Module) -> nn.Module | None:
    stack = [m for m in module._modules.values() if m is not None]
    while stack:
        child = stack.pop()
        if is_hooked(child):
            return child
        stack.extend(m for m in child._modules.values() if m is not None)
    return None


def hooked_submodule(block: nn.Module) -> str | None:
    """The name of a submodule of ``block`` (not ``block`` itself) with a forward hook, or "a global forward
    hook"; None when nothing below ``block`` is hooked."""
    if global_hooks_active():
        return "a global forward hook"
    hooked = _first_hooked_below(block)
    if hooked is None:
        return None
    return next(name for name, module in block.named_modules() if module is hooked)


def has_hooks(module: nn.Module) -> bool:
    """A hook on ``module`` or anything below it, or a global one."""
    return global_hooks_active() or is_hooked(module) or _first_hooked_below(module) is not None
