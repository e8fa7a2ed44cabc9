"""Routing Diffusers' own attention calls through our providers, for transformers without a native port.

A patched call site (see ``omni_accel.patches``) asks ``route`` first. Outside an accelerated transformer's
forward, or for a call our providers do not model (causal, dropout, GQA, an explicit Diffusers backend or
context-parallel config), ``route`` returns None and the original function runs unchanged. A key-padding
mask is served without the dense mask where that is exact and faster (``key_padding``): those calls
resolve as unmasked ones.
"""

from __future__ import annotations

import contextvars

import torch

from .base import AttentionRequest
from .key_padding import attend_kept, is_key_padding, kept_keys, padded_call_available, padded_on_device
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
    if is_key_padding(attn_mask, key.shape[1]):
        out = _without_dense_mask(selector, role, category, query, key, value, attn_mask, scale)
        if out is not None:
            return out
    request = AttentionRequest.for_call(query, key, has_mask=attn_mask is not None)
    provider = selector.resolve(role, category, request).provider
    return provider.forward(query, key, value, attn_mask=attn_mask, scale=scale)


def _without_dense_mask(
    selector: AttentionSelector,
    role: str,
    category: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor | None:
    """A key-padding mask served without the dense mask (see ``key_padding``), or None."""
    unmasked = AttentionRequest.for_call(query, key)
    cudnn_padded = query.is_cuda and padded_call_available()
    if cudnn_padded and selector.resolve(role, category, unmasked).name == "sdpa_cudnn":
        out = padded_on_device(query, key, value, mask, scale)  # the unmasked call would run cuDNN
        if out is not None:
            selector.note_served_without_mask(role, "cuDNN's padded call")
            return out
    kept = kept_keys(mask, query.shape[0], key.shape[1])
    if kept is None:
        return None
    selector.note_served_without_mask(role, "padded keys dropped")
    provider = selector.resolve(role, category, unmasked).provider
    return attend_kept(query, key, value, kept, lambda q, k, v: provider.forward(q, k, v, scale=scale))
