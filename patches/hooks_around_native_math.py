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

Where the block's CUDA graphs serve the step (``omni_accel.cuda_graphs.BlockGraphs``), the decision is taken
before the block runs instead (``decide``: the hook's own ``_measure_should_compute``, and its ``predict``
where it predicts), so that a graph per decision can replay the block; ``decided_calls`` then serves
``call_through`` for the block's call, and ``record`` gives the hook the computed outputs, as its
``new_forward`` does. These read TaylorSeer's internals, within the checked versions.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omni_accel.forward_hooks import has_foreign_torch_hooks

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")

_LOCK = threading.RLock()
_DECIDED = threading.local()  # module -> what serves its call_through in the block call in flight


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
    if decided_ahead(module):
        return _DECIDED.calls[module](compute)
    (hook,) = module._diffusers_hook.hooks.values()
    reference = hook.fn_ref
    with _LOCK:
        original = reference.original_forward
        reference.original_forward = lambda *args, **kwargs: compute()
        try:
            return module()
        finally:
            reference.original_forward = original


@dataclass
class Decision:
    """What the hook on ``module`` decided for one call: ``computes``, or its ``predicted`` outputs (a
    tensor or a tuple of them). ``state`` is the hook's state that ``record`` hands the computed outputs."""

    module: nn.Module
    computes: bool
    state: Any
    predicted: Any = None

    def undo(self) -> None:
        """Takes the decision back (the call it was for did not happen): the hook counts the next call as
        this one. ``predict`` changed nothing; the decision only counted the step."""
        self.state.current_step -= 1


def decide(module: nn.Module) -> Decision:
    """The hook's decision for this call of ``module`` (its step counted, as its ``new_forward`` counts it)."""
    (hook,) = module._diffusers_hook.hooks.values()
    computes, state = hook._measure_should_compute()
    if computes:
        return Decision(module, True, state)
    outputs = state.predict()
    return Decision(module, False, state, outputs[0] if len(outputs) == 1 else tuple(outputs))


def record(decision: Decision, outputs: Any) -> None:
    """Hands the hook the outputs computed for a call it decided to compute (its ``new_forward``'s update)."""
    decision.state.update((outputs,) if isinstance(outputs, torch.Tensor) else outputs)


class NotDecidedAhead(Exception):
    """Raised by a block decided ahead (``decided_calls``) that runs Diffusers' forward after all, whose
    modules' hooks then decide themselves: the decisions are taken back (``Decision.undo``)."""


def decided_ahead(module: nn.Module) -> bool:
    """Whether ``module``'s hook decided this call before the block ran (``decided_calls``)."""
    decided = getattr(_DECIDED, "calls", None)
    return decided is not None and module in decided


@contextlib.contextmanager
def decided_calls(calls: Mapping[nn.Module, Callable[[Callable[[], Any]], Any]]) -> Iterator[None]:
    """Within it, ``call_through(module, compute)`` on this thread returns ``calls[module](compute)``."""
    outer = getattr(_DECIDED, "calls", None)
    _DECIDED.calls = calls
    try:
        yield
    finally:
        _DECIDED.calls = outer
