"""Routing Diffusers' own attention calls through our providers, for transformers without a native port.

A patched call site (see ``omni_accel.patches``) asks ``route`` first. Outside an accelerated transformer's
forward, or for a call our providers do not model (causal, dropout, GQA, an explicit Diffusers backend or
context-parallel config), ``route`` returns None and the original function runs unchanged. A key-padding
mask that a model passes to every block is served by dropping the padded keys (``key_padding``): those
calls resolve as unmasked ones.
"""

from __future__ import annotations

import contextvars

import torch

from .base import AttentionRequest
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


def route(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    unsupported: str | None,
) -> torch.Tensor | None:
    """Attention over BSHD tensors through the active selector, or None to let the original run."""
    selector = _ACTIVE.get()
    if selector is None:
        return None
    role, category = _ROLE.get()
    if unsupported:
        selector.note_unrouted(role, unsupported)
        return None
    kept = kept_keys(attn_mask, query.shape[0], key.shape[1])
    if kept is not None:  # a key-padding mask: the padded keys dropped, an unmasked kernel
        selector.note_served_without_mask(role)
        provider = selector.resolve(role, category, AttentionRequest.for_call(query, key)).provider
        return attend_kept(query, key, value, kept, lambda q, k, v: provider.forward(q, k, v, scale=scale))
    request = AttentionRequest.for_call(query, key, has_mask=attn_mask is not None)
    provider = selector.resolve(role, category, request).provider
    return provider.forward(query, key, value, attn_mask=attn_mask, scale=scale)
