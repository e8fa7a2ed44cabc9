"""Whether anything wraps a module's forward: torch hooks, accelerate's ``_hf_hook``, Diffusers' HookRegistry.

Native blocks, CUDA graphs, the generic tier's compiled blocks and the projection cache all skip work a hook
may observe or change, so they ask here. Hooks of ours that rewrite an argument into another form of the
same thing (``OurHook``) do not count. Our scopes (``add_scope``: which pipeline and attention role a call
belongs to) are not hooks: ``patches/scoped_calls.py`` enters them around the module's call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from torch import nn
from torch.nn.modules import module as module_globals

from omni_accel.patches import scoped_calls

_OURS = "_omni_accel_scope"


def global_hooks_active() -> bool:
    return bool(
        module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
        or module_globals._global_forward_hooks_always_called
    )


def is_hooked(module: nn.Module) -> bool:
    """A hook on this module itself (not its children), or a ``forward`` set on the instance."""
    # Read the instance dict: hasattr() on a missing attribute runs Module.__getattr__ and raises, which
    # is most of the cost when this runs over every submodule of every block at every call.
    state = module.__dict__
    registry = state.get("_diffusers_hook")
    return (
        has_foreign_torch_hooks(module)
        or bool(registry is not None and registry.hooks)
        or ("forward" in state and foreign_forward(module, state["forward"]))
    )


def foreign_forward(module: nn.Module, forward: Callable | None) -> bool:
    """``forward``, set on ``module``'s instance, is not its class's: an attention-map recorder's
    ``attn.forward = types.MethodType(record, attn)``, a closure. Not foreign: ours (``InstanceForward``)
    over nothing foreign, and the class's own forward bound to the module, which Diffusers' hooks and
    accelerate's leave behind when they are removed."""
    if isinstance(forward, InstanceForward):
        return forward.inner is not None and foreign_forward(module, forward.inner)
    bound_to = getattr(forward, "__self__", None)
    return not (bound_to is module and getattr(forward, "__func__", None) is type(module).forward)


def has_foreign_torch_hooks(module: nn.Module) -> bool:
    """A forward (pre-)hook on this module that is not ours, or accelerate's (Accelerate's ``_hf_hook``)."""
    state = module.__dict__
    return _foreign(state["_forward_hooks"]) or _foreign(state["_forward_pre_hooks"]) or "_hf_hook" in state


def _foreign(hooks: dict) -> bool:
    return bool(hooks) and any(not hasattr(hook, _OURS) for hook in hooks.values())


class OurHook:
    """Base of a hook object of ours that does not count as a hook (see the module docstring)."""


setattr(OurHook, _OURS, True)


_Forward = TypeVar("_Forward", bound="InstanceForward")


class InstanceForward:
    """A callable installed as one module's instance ``forward``: it travels with the module through
    ``deepcopy`` and pickling, and a Diffusers hook registered later wraps it like any forward. ``inner``
    is a hook's forward installed before us (what we call instead of the class's), and ``uninstall`` only
    steps aside (``enabled`` False) where a hook registered later wraps us."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner: Callable | None = module.__dict__.get("forward")
        self.enabled = True

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        if self.module.__dict__.get("forward") is not self:
            self.enabled = False
        elif self.inner is None:
            del self.module.forward
        else:
            self.module.forward = self.inner

    def _forward(self) -> Callable:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    @property
    def __wrapped__(self) -> Callable:  # inspect.signature(module.forward) finds the real signature
        return self._forward()


def installed(module: nn.Module, kind: type[_Forward]) -> _Forward | None:
    """The ``kind`` of ours installed as ``module``'s forward and not uninstalled, found under the wrappers of
    hooks registered since (Diffusers' and accelerate's keep what they wrap as ``__wrapped__``) and under
    others of ours; None where there is none."""
    forward = module.__dict__.get("forward")
    while forward is not None and not (isinstance(forward, kind) and forward.enabled):
        if isinstance(forward, InstanceForward):
            forward = forward.inner
        else:
            forward = getattr(forward, "__dict__", {}).get("__wrapped__")
    return forward


class Scope:
    """A context a module's call runs in: ``enter()`` returns the token ``leave`` takes. Entered and left
    around the module's whole call by ``patches/scoped_calls.py``, in the calling thread, however the call
    ends; picklable where ``enter`` and ``leave`` are, so that a pickled model keeps its scope."""

    def __init__(self, enter: Callable[[], Any], leave: Callable[[Any], None]) -> None:
        self.enter, self.leave = enter, leave


def add_scope(
    module: nn.Module, enter: Callable[[], Any], leave: Callable[[Any], None]
) -> Callable[[], None]:
    """Runs ``module``'s calls in ``Scope(enter, leave)`` (scopes on one module nest: the one added first is
    entered first and left last); returns the undo. The caller holds ``patches.scoped_calls`` on the
    module's class."""
    scope = Scope(enter, leave)
    scopes = module.__dict__.get(scoped_calls.SCOPES)
    if scopes is None:
        scopes = []
        object.__setattr__(module, scoped_calls.SCOPES, scopes)
    scopes.append(scope)
    # A partial, not a closure: the undo a deep copy of the model holds removes the copy's scope.
    return functools.partial(_remove_scope, module, scope)


def _remove_scope(module: nn.Module, scope: Scope) -> None:
    scopes = module.__dict__.get(scoped_calls.SCOPES, [])
    scopes[:] = [s for s in scopes if s is not scope]
    if not scopes and scoped_calls.SCOPES in module.__dict__:
        object.__delattr__(module, scoped_calls.SCOPES)


# Set on a Diffusers hook (a class attribute) whose forward belongs to the computation of the block above its
# module, so that our compiled blocks trace it in (a row-split linear's reduction under tp).
TRACED = "_omni_accel_traced"


def _traced_only(module: nn.Module) -> bool:
    """Every hook on ``module`` is a Diffusers hook marked ``TRACED``."""
    state = module.__dict__
    registry = state.get("_diffusers_hook")
    return (
        registry is not None
        and all(getattr(hook, TRACED, False) for hook in registry.hooks.values())
        and not (
            _foreign(state["_forward_hooks"]) or _foreign(state["_forward_pre_hooks"]) or "_hf_hook" in state
        )
    )


def _first_hooked_below(
    module: nn.Module, count_traced: bool = True, around: Collection[nn.Module] = ()
) -> nn.Module | None:
    stack = [m for m in module._modules.values() if m is not None]
    while stack:
        child = stack.pop()
        if is_hooked(child) and (count_traced or not _traced_only(child)) and child not in around:
            return child
        stack.extend(m for m in child._modules.values() if m is not None)
    return None


def hooked_submodule(block: nn.Module, around: Collection[nn.Module] = ()) -> str | None:
    """The name of a submodule of ``block`` (not ``block`` itself) with a forward hook, or "a global forward
    hook"; None when nothing below ``block`` is hooked but by hooks marked ``TRACED`` and the hooks of the
    modules in ``around`` (which the block's math runs around the part that is theirs)."""
    if global_hooks_active():
        return "a global forward hook"
    hooked = _first_hooked_below(block, count_traced=False, around=around)
    if hooked is None:
        return None
    return next(name for name, module in block.named_modules() if module is hooked)


def has_hooks(module: nn.Module) -> bool:
    """A hook on ``module`` or anything below it, or a global one."""
    return global_hooks_active() or is_hooked(module) or _first_hooked_below(module) is not None
