"""Enters an accelerated module's scopes around its whole call and always leaves them.

Target: ``__call__`` of an accelerated transformer's class. Why: a scope (the forward's runtime, the
routing selector, the marks of a new forward) must hold for the module's whole call, its hooks included,
and end with it however the call ends. Torch's ``always_call`` forward hooks do not run when a
``BaseException`` leaves the call (``Module._call_impl`` catches ``Exception``): a notebook's interrupt
in the middle of a step left the scopes entered, and a plain pipeline run afterwards in the same thread
went through the accelerated one's attention providers. The patched ``__call__`` reads the instance
attribute ``_omni_accel_scopes`` (``forward_hooks.add_scope``), which only accelerated modules have, and
enters them in a ``try``/``finally``; a module without it runs the original ``__call__`` unchanged.
Nothing is entered while Dynamo traces (a context variable cannot be entered there; see
``attention_roles.py`` for what a trace is told). So that a ``torch.compile(module)`` wrapper still runs
the module in its scopes, Dynamo skips the patched ``__call__``'s own frame where the wrapper starts (its
first frame): the scopes are entered eagerly, and the frames below it are compiled, as Dynamo does for
``Module.__call__`` itself. Called inside a larger compiled function, the patched ``__call__`` is traced
as any code is (no graph break; its scopes are then not entered).
"""

from __future__ import annotations

import functools

import torch
from torch._dynamo.eval_frame import skip_code

from . import is_ours, ours

PACKAGE = "torch"
CHECKED_VERSIONS = ("2.4.0", "2.14.0")

SCOPES = "_omni_accel_scopes"
_ORIGINAL = "_omni_accel_original_call"


def apply(cls: type) -> None:
    inherited = cls.__call__
    # A base class patched before (a subclass's instance accelerated beside one of its base): its wrapper,
    # which stays valid after its own revert, enters the scopes; entered twice, a forward would be marked twice.
    nested = is_ours(inherited)

    @functools.wraps(inherited)
    def __call__(self, *args, **kwargs):
        scopes = self.__dict__.get(SCOPES)
        if nested or not scopes or torch.compiler.is_dynamo_compiling():
            return inherited(self, *args, **kwargs)
        entered = []
        try:
            for scope in tuple(scopes):  # a restore during the call leaves what this call entered
                entered.append((scope.leave, scope.enter()))
            return inherited(self, *args, **kwargs)
        finally:
            for leave, token in reversed(entered):
                leave(token)

    skip_code(__call__.__code__)  # as a first frame only; traced when called in one
    setattr(cls, _ORIGINAL, cls.__dict__.get("__call__"))  # None: inherited
    cls.__call__ = ours(__call__, inherited)


def revert(cls: type) -> None:
    """Puts the class's ``__call__`` back, unless a user's patch took our wrapper's place since: theirs stays
    (ours inside it runs the original for modules without scopes, which restore removed)."""
    original = cls.__dict__[_ORIGINAL]
    delattr(cls, _ORIGINAL)
    if not is_ours(cls.__dict__.get("__call__")):
        return
    if original is None:
        del cls.__call__
    else:
        cls.__call__ = original
