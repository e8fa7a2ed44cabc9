"""Sequence parallelism for routed Diffusers attention calls (the generic tier under ulysses / ring).

A model spread by the plan it declares (``diffusers_plan``) runs its own attention processors on this
rank's tokens; each call they make reaches ``attention.routing``, which hands it here while a split
forward is in flight. The queries are this rank's share of some split streams (or tokens every rank holds
whole: attention over their copies is attention over them); K/V are the same tokens (self and joint
attention), a split stream of their own (a cross-attention whose text the plan splits) or whole on every
rank (a cross-attention whose text it does not split: no exchange). Before the forward has split anything
(a text refiner ahead of the first split) every token is whole and attention is local. A key mask travels
with its keys (one more head column). No call may fall back to Diffusers' function here: that would attend
over this rank's tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .sequence_hooks import SequenceState, forward_state

RoutedAttend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float | None, bool],
    torch.Tensor | tuple[torch.Tensor, torch.Tensor],
]
"""``attend(q, k, v, attn_mask, scale, need_lse)`` over BSHD tensors through the call's provider."""


# How many accelerated models in the process are spread over ranks by their token split. Read while Dynamo
# traces an attention call our providers cannot serve (``attention.routing.traced_unsupported``): a plain
# int global, so that compiled code depends on it through Dynamo's guards.
LIVE_SPLITS = 0


class LiveSplit:
    """One model spread by its token split, counted in ``LIVE_SPLITS`` from its making; calling it (the
    layout's undo) uncounts it once. A deep copy of the model is one more."""

    def __init__(self) -> None:
        global LIVE_SPLITS
        LIVE_SPLITS += 1
        self.live = True

    def __call__(self) -> None:
        global LIVE_SPLITS
        if self.live:
            LIVE_SPLITS -= 1
            self.live = False

    def __deepcopy__(self, memo: dict) -> LiveSplit:
        return LiveSplit() if self.live else self


def split_forward() -> SequenceState | None:
    """The layout of the split forward in flight on this thread, or None (no layout, or one of one rank)."""
    state = forward_state()
    return state if state is not None and state.degree > 1 else None


def gradients_refused(role: str) -> NotImplementedError:
    """What a call that gradients flow through raises under a split forward, eager or compiled."""
    return NotImplementedError(
        f"Attention role {role!r}: gradients under sequence parallelism are not supported (its exchanges "
        "are not differentiable); run the training step on one GPU."
    )


def attend_split(
    state: SequenceState,
    attend: RoutedAttend,
    role: str,
    category: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys (BSHD), exact. ``attend`` takes an explicit
    ``scale`` (None: the kernel's own, ``1/sqrt(head size)``)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise gradients_refused(role)
    if not state.streams:  # nothing split yet: every rank holds every token
        return attend(query, key, value, attn_mask, scale, False)
    q_len, kv_len = query.shape[1], key.shape[1]
    layout = state.layout_of(q_len, None if kv_len == q_len else kv_len)
    if category == "cross" and layout.kv_sizes is not None and state.whole(kv_len, layout.kv_sizes):
        return attend(query, key, value, attn_mask, scale, False)  # K/V whole here: no exchange needed
    if attn_mask is not None:
        batch, heads = query.shape[0], query.shape[2]
        if (
            attn_mask.ndim != 4
            or attn_mask.shape[0] not in (1, batch)
            or attn_mask.shape[1] not in (1, heads)
            or attn_mask.shape[-1] != kv_len
        ):
            raise NotImplementedError(
                f"Attention role {role!r}: a mask of shape {tuple(attn_mask.shape)} cannot be split over the "
                "ranks; run this model with ulysses=1 and ring=1."
            )
        if attn_mask.shape[2] != 1:
            raise NotImplementedError(
                f"Attention role {role!r}: a mask per query (shape {tuple(attn_mask.shape)}) cannot be split "
                "over the ranks, only one row of keys per sample and head; run this model with ulysses=1 and "
                "ring=1."
            )
        return with_mask_column(layout, attend, query, key, value, attn_mask, scale)

    def attend_here(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool):
        return attend(q, k, v, attn_mask, scale, need_lse)

    return layout.attention(query, key, value, attend_here)


# A masked key's logit offset (below): exact in half precision (fp16's largest power of two under its
# 65504), and times any head size's scale far below the ~ -104 at which exp() is 0 in fp32.
_MASKED = -(2.0**14)
_PAD = 8  # the extra head columns: one carries the mask, the rest keep the head size a multiple of 8


def with_mask_column(layout, attend, query, key, value, mask, scale) -> torch.Tensor:
    """Attention under a key mask (per sample and head), with the mask travelling with its keys through
    Ulysses' exchange and the ring as one more head column: ``q = 1`` against ``k = mask / scale`` (a
    boolean mask: 0 kept, ``_MASKED`` masked; an additive one: its value, ``-inf`` as ``_MASKED``), so a
    kept key's logit is its own and a masked key's weight is 0 in every block that is merged."""
    head = query.shape[-1]
    scale = 1.0 / math.sqrt(head) if scale is None else scale
    batch, kv_len, heads = key.shape[0], key.shape[1], key.shape[2]
    if mask.dtype == torch.bool:
        column = torch.where(mask, 0.0, _MASKED)
    else:
        column = mask.float().clamp(min=_MASKED * scale) / scale
    column = column.reshape(mask.shape[0], mask.shape[1], kv_len).transpose(1, 2)[..., None]
    column = column.to(key.dtype).expand(batch, kv_len, heads, 1)
    q = torch.cat(
        [query, query.new_ones(*query.shape[:3], 1), query.new_zeros(*query.shape[:3], _PAD - 1)], -1
    )
    k = torch.cat([key, column, key.new_zeros(*key.shape[:3], _PAD - 1)], -1)
    v = torch.cat([value, value.new_zeros(*value.shape[:3], _PAD)], -1)

    def attend_here(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool):
        return attend(q, k, v, None, scale, need_lse)

    return layout.attention(q, k, v, attend_here)[..., : value.shape[-1]]
