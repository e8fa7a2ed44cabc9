"""Routing Diffusers' own attention calls through our providers, for transformers without a native port.

A patched call site (see ``omni_accel.patches``) asks ``route`` first. Outside an accelerated transformer's
forward, or for a call our providers do not model (causal, dropout, GQA, a Diffusers backend set on the
processor or context-parallel config, a process-wide Diffusers backend no provider runs), ``route`` returns
None and the original function runs unchanged. A key-padding mask that a model passes to every block is
served by dropping the padded keys (``key_padding``): those calls resolve as unmasked ones.

The patched call sites never reach ``route`` while Dynamo traces (they call the original directly): the
context variables read here cannot be traced, and a compiled model of the same class elsewhere in the
process must see Diffusers' function as it is.
"""

from __future__ import annotations

import contextvars

import torch

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
    mask_rows: bool = False,
) -> torch.Tensor | None:
    """Attention over BSHD tensors through the active selector, or None to let the original run.

    ``attn_mask`` broadcasts as SDPA's does against ``[batch, heads, seq_q, kv_len]``; with ``mask_rows``
    a 2-D mask of ``[batch, kv_len]`` is instead one row of keys per sample, broadcast over heads and
    queries, as Diffusers' native backend reads it (``_native_attention`` views it ``[batch, 1, 1, kv_len]``;
    every other shape it hands to SDPA as is)."""
    selector = _ACTIVE.get()
    if selector is None:
        return None
    role, category = _ROLE.get()
    unsupported = unsupported or selector.unserved_reason(role, category)
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
        return attend_kept(
            query, key, value, kept, lambda q, k, v: selector.attend(role, category, q, k, v, scale=scale)
        )
    return selector.attend(role, category, query, key, value, attn_mask=attn_mask, scale=scale)
