"""Says which accelerated model and attention role a Diffusers attention module's calls belong to.

Target: ``forward`` of a Diffusers attention module class (``Attention``, ``FluxAttention``...), as found
among an accelerated model's modules. Why: the routed call site (``dispatch_attention_fn``,
``F.scaled_dot_product_attention``) does not see the module that calls it. A forward hook could say it
eagerly, but compiled code guards on every hook's id, so each block would compile a graph of its own. The
patched forward reads the instance attribute ``_omni_accel_route`` (the role and its category), which only
accelerated models' modules have: eagerly it enters the role for the call; while Dynamo traces it tells
the trace (``routing.trace_enter``), and Dynamo guards on the attribute's value, so blocks of one role share
one graph and a plain model (no attribute) never shares ours. A module without
the attribute runs the original forward unchanged. Where Dynamo starts a frame at the patched forward (a
graph break inside the attention module resumes there), it skips that frame, so the role is entered eagerly
around the compiled frames below it, as ``scoped_calls.py`` does for the model's call.
"""

from __future__ import annotations

import functools

import torch
from torch._dynamo.eval_frame import skip_code

from omni_accel.attention.routing import enter_role, leave_role, trace_enter, trace_leave

from . import is_ours, ours

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")
ROUTE = "_omni_accel_route"
_ORIGINAL = "_omni_accel_original_forward"


def apply(cls: type) -> None:
    inherited = cls.forward

    @functools.wraps(inherited)
    def forward(self, *args, **kwargs):
        route = self.__dict__.get(ROUTE)
        if route is None:
            return inherited(self, *args, **kwargs)
        if torch.compiler.is_dynamo_compiling():
            trace_enter(*route)
            out = inherited(self, *args, **kwargs)
            trace_leave()
            return out
        token = enter_role(*route)
        try:
            return inherited(self, *args, **kwargs)
        finally:
            leave_role(token)

    skip_code(forward.__code__)  # as a first frame only: the role entered eagerly; traced when called in one
    setattr(cls, _ORIGINAL, cls.__dict__.get("forward"))  # None: inherited
    cls.forward = ours(forward, inherited)


def revert(cls: type) -> None:
    """Puts the class's forward back, unless a user's patch took our wrapper's place since: theirs stays
    (ours inside it runs the original forward for modules without a route, which restore removed)."""
    original = cls.__dict__[_ORIGINAL]
    delattr(cls, _ORIGINAL)
    if not is_ours(cls.__dict__.get("forward")):
        return
    if original is None:
        del cls.forward
    else:
        cls.forward = original
