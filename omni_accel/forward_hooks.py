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
    registry = getattr(module, "_diffusers_hook", None)
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or hasattr(module, "_hf_hook")
        or (registry is not None and registry.hooks)
    )


def hooked_submodule(block: nn.Module) -> str | None:
    """The name of a submodule of ``block`` (not ``block`` itself) with a forward hook, or "a global forward
    hook"; None when nothing below ``block`` is hooked."""
    if global_hooks_active():
        return "a global forward hook"
    for name, module in block.named_modules():
        if name and is_hooked(module):
            return name
    return None


def has_hooks(module: nn.Module) -> bool:
    """A hook on ``module`` or anything below it, or a global one."""
    return global_hooks_active() or any(is_hooked(m) for m in module.modules())
