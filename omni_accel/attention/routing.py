"""Routing Diffusers' own attention calls through our providers, for transformers without a native port.

A patched call site (see ``omni_accel.patches``) asks ``route`` first. Outside an accelerated transformer's
forward, or for a call our providers do not model (causal, dropout, GQA, a gradient flowing through it, a
Diffusers backend set on the processor or context-parallel config, a process-wide Diffusers backend no
provider runs), ``route`` returns None and the original function runs unchanged. A key-padding mask that a
model passes to every block is served by dropping the padded keys (``key_padding``): those calls resolve as
unmasked ones.

While Dynamo traces, the context variables cannot be read: an accelerated model's attention modules say
at trace time which role the calls below them belong to (``trace_enter``, see
``patches/attention_roles.py``), and the patched call site puts ``diffusers_attention`` in the graph, a
custom op that routes at run time as ``route`` does, with the selector of the forward in flight. A plain
Diffusers model of the same class that a user compiles elsewhere in the process traces Diffusers' function
as it is; the role is part of Dynamo's guards, so the two never share compiled code. While a model of the
process is split over ranks, a call site traced with no role (a graph break inside an attention module)
puts the op in too, taking the role in scope at run time (``traced_route``).
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..parallel import routed_attention
from ..parallel.routed_attention import attend_split, gradients_refused, split_forward
from .key_padding import attend_kept, kept_keys
from .selection import AttentionSelector

_ACTIVE: contextvars.ContextVar[AttentionSelector | None] = contextvars.ContextVar(
    "omni_accel_route_selector", default=None
)
_ROLE: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar(
    "omni_accel_route_role", default=("diffusers.attention", "self")
)


def enter_role(role: str, category: str) -> contextvars.Token:
    return _ROLE.set((role, category))


def leave_role(token: contextvars.Token) -> None:
    _ROLE.reset(token)


def enter_selector(selector: AttentionSelector) -> contextvars.Token:
    return _ACTIVE.set(selector)


def leave_selector(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def unsupported_reason(*, is_causal: bool, dropout_p: float, enable_gqa: bool) -> str | None:
    """Why a call falls outside what our providers model (they are non-causal, dropout-free, MHA)."""
    if is_causal:
        return "causal attention"
    if dropout_p:
        return "dropout"
    if enable_gqa:
        return "grouped-query attention"
    return None


def processor_backend_reason(backend: Any, parallel_config: Any) -> str | None:
    """Why a call whose processor carries a Diffusers backend (``set_attention_backend``) or a
    context-parallel config runs Diffusers' own function, or None."""
    if backend is not None:
        return f"Diffusers backend {getattr(backend, 'value', backend)!s} set on the processor"
    if parallel_config is not None:
        return "Diffusers context parallelism"
    return None


def gradient_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why a call must run Diffusers' function because a gradient flows through it, or None: some providers'
    kernels (FlashInfer's, SageAttention's) have no backward, and a native block runs Diffusers' forward
    then too, so training gets what plain Diffusers computes whatever provider serves the inference calls."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "gradients flow through it (training or input gradients)"
    return None


def route(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    unsupported: str | None,
    mask_rows: bool = False,
    follows_backend: bool = True,
) -> torch.Tensor | None:
    """Attention over BSHD tensors through the active selector, or None to let the original run.

    ``attn_mask`` broadcasts as SDPA's does against ``[batch, heads, seq_q, kv_len]``; with ``mask_rows``
    a 2-D mask of ``[batch, kv_len]`` is instead one row of keys per sample, broadcast over heads and
    queries, as Diffusers' native backend reads it (``_native_attention`` views it ``[batch, 1, 1, kv_len]``;
    every other shape it hands to SDPA as is). ``follows_backend``: whether the call site's Diffusers code
    reads Diffusers' process-wide attention backend (``dispatch_attention_fn`` does; a processor calling
    torch's SDPA itself does not, so neither do we there)."""
    selector = _ACTIVE.get()
    role, category = _ROLE.get()
    if selector is None:
        _refuse_split_outside_forward(role)
        return None
    args = (query, key, value, attn_mask, scale, unsupported, mask_rows, follows_backend)
    return route_with(selector, role, category, *args)


def _refuse_split_outside_forward(role: str) -> None:
    """Raises where a routed call runs in a split forward (its tokens split over the ranks) with no accelerated
    forward's selector in scope: the model's call was traced inside a larger compiled function or module,
    where its scopes are not entered (``patches/scoped_calls.py``), and Diffusers' function would attend over
    this rank's tokens only (silently wrong)."""
    if split_forward() is not None:
        raise RuntimeError(
            f"Attention role {role!r} runs split over the ranks outside the accelerated forward: the model's call "
            "was traced inside a larger torch.compile (a compiled function or module that calls it), where the "
            "accelerated forward's scopes are not entered, and Diffusers' attention would see this rank's "
            "tokens only. Compile the model itself instead (pipe.transformer = torch.compile(pipe.transformer), "
            "or pipe.transformer.compile()), or pass compile=True to accelerate."
        )


def route_with(
    selector: AttentionSelector,
    role: str,
    category: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    unsupported: str | None = None,
    mask_rows: bool = False,
    follows_backend: bool = True,
) -> torch.Tensor | None:
    """``route`` for a known selector and role; under a split forward (the generic tier under ulysses /
    ring), the call's exchanges too, and no call falls back to Diffusers' function."""
    if follows_backend:
        unsupported = unsupported or selector.unserved_reason(role, category)
    attend_as = functools.partial(selector.attend, role, category, follows_backend=follows_backend)
    layout = split_forward()
    if layout is not None:
        if unsupported:
            raise NotImplementedError(
                f"Attention role {role!r}: {unsupported} cannot run split over the ranks through our "
                "providers; run this model with ulysses=1 and ring=1."
            )
        if mask_rows and attn_mask is not None and attn_mask.ndim == 2:
            attn_mask = attn_mask[:, None, None, :]

        def attend(q, k, v, mask, scale, need_lse):
            return attend_as(q, k, v, attn_mask=mask, scale=scale, return_lse=need_lse)

        return attend_split(layout, attend, role, category, query, key, value, attn_mask, scale)
    unsupported = unsupported or gradient_reason(query, key, value)
    if unsupported:
        selector.note_unrouted(role, unsupported)
        return None
    batch, kv_len = query.shape[0], key.shape[1]
    rows = mask_rows and attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (batch, kv_len)
    kept = kept_keys(attn_mask, batch, kv_len, rows)  # the tensor the model passes: known when it comes back
    if rows:
        attn_mask = attn_mask[:, None, None, :]
    if kept is not None:  # a key-padding mask: the padded keys dropped, an unmasked kernel
        selector.note_served_without_mask(role)
        return attend_kept(query, key, value, kept, lambda q, k, v: attend_as(q, k, v, scale=scale))
    return attend_as(query, key, value, attn_mask=attn_mask, scale=scale)


# While Dynamo traces: which role the attention calls being traced belong to. Set by the accelerated
# model's attention modules (``patches/attention_roles.py``) through functions Dynamo runs at trace time
# (``assume_constant_result``), tagged with the trace's context so that a trace that stopped between an
# enter and its leave leaves nothing a later trace reads.
_TRACED = threading.local()


@torch.compiler.assume_constant_result
def trace_enter(role: str, category: str) -> bool:
    """At trace time: the attention calls traced from now on belong to ``role``."""
    _TRACED.route = (torch._guards.TracingContext.try_get(), role, category)
    return True


@torch.compiler.assume_constant_result
def trace_leave() -> bool:
    _TRACED.route = None
    return True


# The role a traced call takes at run time, from the context variable (``diffusers_attention``).
RUNTIME_ROLE = ("", "")


def traced_route() -> tuple[str, str] | None:
    """At trace time: (role, category) of the attention call being traced; ``RUNTIME_ROLE`` when no
    accelerated model's attention module entered one in this trace while a model of the process is split;
    else None (the call site traces Diffusers' function). A graph break inside an attention module (a
    processor's own, a hook's) compiles the call site in a frame of its own, where the trace knows no role
    while the forward in flight may be split: Diffusers' function would attend over one rank's tokens
    only, so the call routes at run time as an eager one does. Traced, not run at trace time, so that
    ``LIVE_SPLITS`` is in the guards."""
    entry = _entered_route()
    if entry is None and routed_attention.LIVE_SPLITS:
        return RUNTIME_ROLE
    return entry


@torch.compiler.assume_constant_result
def _entered_route() -> tuple[str, str] | None:
    entry = getattr(_TRACED, "route", None)
    if entry is None or entry[0] is not torch._guards.TracingContext.try_get():
        return None
    return entry[1:]


# Each patched call site's Diffusers function, BSHD in and out: what the op runs for a call no provider
# serves at run time (outside an accelerated forward, or under a process-wide Diffusers backend chosen after
# the trace).
_ORIGINALS: dict[str, Callable[..., torch.Tensor]] = {}
_READS_ROWS: dict[str, Callable[[], bool]] = {}
_FOLLOWS_BACKEND: dict[str, bool] = {}


def register_call_site(
    site: str,
    original: Callable[..., torch.Tensor],
    reads_rows: Callable[[], bool],
    follows_backend: bool = True,
) -> None:
    """``original(query, key, value, attn_mask, scale)``: the site's Diffusers function over BSHD tensors;
    ``reads_rows()``: whether it reads a 2-D mask as one row of keys per sample now; ``follows_backend``:
    whether it reads Diffusers' process-wide backend (see ``route``)."""
    _ORIGINALS[site] = original
    _READS_ROWS[site] = reads_rows
    _FOLLOWS_BACKEND[site] = follows_backend


def unregister_call_site(site: str) -> None:
    _ORIGINALS.pop(site, None)
    _READS_ROWS.pop(site, None)
    _FOLLOWS_BACKEND.pop(site, None)


@torch.library.custom_op("omni_accel::diffusers_attention", mutates_args=())
def diffusers_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    role: str,
    category: str,
    scale: float | None,
    site: str,
) -> torch.Tensor:
    """A routed Diffusers attention call inside a compiled graph (BSHD): served at run time as ``route``
    serves an eager one, by the selector of the accelerated forward in flight (its scope, Diffusers'
    process-wide backend, a kernel refusing the tensors), else by the call site's Diffusers function. The
    graph names no pipeline, so models of one class share it. ``RUNTIME_ROLE``: the role in scope now."""
    if (role, category) == RUNTIME_ROLE:
        role, category = _ROLE.get()
    selector = _ACTIVE.get()
    out = None
    if selector is None:
        _refuse_split_outside_forward(role)
    else:
        rows, follows = _READS_ROWS[site](), _FOLLOWS_BACKEND[site]
        out = route_with(selector, role, category, query, key, value, attn_mask, scale, None, rows, follows)
    if out is None:
        out = _ORIGINALS[site](query, key, value, attn_mask, scale)
    return out.contiguous()  # as the fake promises


@diffusers_attention.register_fake
def _(query, key, value, attn_mask, role, category, scale, site):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


def traced_unsupported(reason: str) -> None:
    """While Dynamo traces an accelerated model's call that our providers do not model (``reason``): it is
    traced as Diffusers' own function, unless an accelerated model in the process is split over ranks by
    its tokens. Then the trace stops here (the compile fails and the block runs eagerly, where a split
    forward raises for the call), since compiled code of one block class serves every model of that class,
    and Diffusers' function would attend over one rank's tokens only. ``LIVE_SPLITS`` is in the guards."""
    if routed_attention.LIVE_SPLITS:
        raise NotImplementedError(
            f"{reason} cannot run split over the ranks through our providers, so it is not compiled while "
            "a model of this process is split; run this model with ulysses=1 and ring=1."
        )


def traced_call(
    site: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor | None:
    """While Dynamo traces a call site: the op for an accelerated model's call (BSHD), or None to trace
    Diffusers' function (no role entered, or a gradient flows through it: the op has no backward). Where
    a gradient flows while a model of the process is split, Diffusers' function is traced behind
    ``refuse_split_gradient``: under a split forward it would attend over this rank's tokens only, and an
    eager call there raises (``attend_split``). Whether a gradient flows is known at trace time (Dynamo
    guards on the inputs' ``requires_grad``); ``LIVE_SPLITS`` is in the guards."""
    traced = traced_route()
    if traced is None:
        return None
    if gradient_reason(query, key, value) is None:
        return diffusers_attention(query, key, value, attn_mask, *traced, scale, site)
    if not routed_attention.LIVE_SPLITS:
        return None
    return _ORIGINALS[site](refuse_split_gradient(query, traced[0]), key, value, attn_mask, scale)


@torch.library.custom_op("omni_accel::refuse_split_gradient", mutates_args=())
def refuse_split_gradient(query: torch.Tensor, role: str) -> torch.Tensor:
    """In a compiled graph, ahead of Diffusers' function for a call a gradient flows through: raises as the
    eager call does where a split forward is in flight at run time, else passes ``query`` on (a copy: an
    op's output may not alias its input). A check in the graph, not a graph break, so that the call
    stays in the trace that knows its role."""
    if split_forward() is not None:
        raise gradients_refused(role or _ROLE.get()[0])
    return query.clone()


@refuse_split_gradient.register_fake
def _(query, role):
    return torch.empty_like(query)


refuse_split_gradient.register_autograd(lambda ctx, grad: (grad, None))
