"""The attention layer models call: provider resolution by role, around one kernel call.

``Attention`` is where sequence parallelism plugs in: pre-communication -> provider kernel ->
post-communication. The provider never knows about the layout, and the model never knows the kernel: any
provider with the needed capability (the log-sum-exp, for ring attention) works under any layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.base import AttentionRequest
from ..attention.selection import AttentionSelector, default_selector, selector_by_index
from ..parallel.sequence import SequenceParallel


def _attend(
    selector: AttentionSelector,
    role: str,
    category: str,
    scale: float,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    need_lse: bool = False,
    attn_mask: torch.Tensor | None = None,
):
    request = AttentionRequest.for_call(query, key, has_mask=attn_mask is not None, needs_lse=need_lse)
    provider = selector.resolve(role, category, request).provider
    return provider.forward(query, key, value, attn_mask=attn_mask, scale=scale, return_lse=need_lse)


@torch.library.custom_op("omni_accel::routed_attention", mutates_args=())
def _routed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selector: int,
    role: str,
    category: str,
    scale: float,
) -> torch.Tensor:
    """Provider resolution and the kernel call as one opaque op: inside a compiled graph the choice still
    follows the pipeline's config and any active ``attention_scope`` at run time, and the graph around it
    (norms, RoPE, projections) fuses without a break."""
    out = _attend(selector_by_index(selector), role, category, scale, query, key, value)
    # Contiguous, as the fake promises: the graph may view the output (the eager path copies it there anyway).
    return out.contiguous()


@_routed_attention.register_fake
def _(query, key, value, selector, role, category, scale):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@dataclass(frozen=True)
class AttentionSite:
    """One attention call site of a native block: ``role`` names it (users target it in
    ``AttentionConfig.per_role``), ``category`` ("self" or "cross") is the fallback key."""

    role: str
    category: str
    scale: float | None = None  # None: 1 / sqrt(head size)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    site: AttentionSite,
    selector: int,
    sp: SequenceParallel | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over BSHD tensors through the provider the selector (by ``AttentionSelector.index``, which
    a compiled graph can carry) resolves for ``site``; under sequence parallelism (``sp``) the layout's
    communication wraps the kernel."""
    scale = site.scale if site.scale is not None else 1 / math.sqrt(query.shape[-1])

    def attend(q, k, v, need_lse=False):
        return _attend(
            selector_by_index(selector), site.role, site.category, scale, q, k, v, need_lse, attn_mask
        )

    if sp is not None and sp.degree > 1:
        if attn_mask is not None:
            raise NotImplementedError(
                f"Attention role {site.role!r}: masked attention under sequence parallelism is not supported; "
                "run this model with ulysses=1 and ring=1."
            )
        return sp.attention(query, key, value, attend)
    if torch.compiler.is_compiling() and attn_mask is None:
        return _routed_attention(query, key, value, selector, site.role, site.category, scale)
    return attend(query, key, value)


class Attention(nn.Module):
    """``attention`` as a module, for the legacy native FLUX module that parallel layouts still run.

    ``role`` names the site (users target it in ``AttentionConfig.per_role``); ``role_category`` ("self" or
    "cross") is the fallback key so a generic choice covers model-specific roles.
    """

    def __init__(
        self, head_dim: int, *, role: str, role_category: str = "self", scale: float | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.role = role
        self.role_category = role_category
        self.site = AttentionSite(role, role_category, head_dim**-0.5 if scale is None else scale)
        self.selector: AttentionSelector | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        sp: SequenceParallel | None = None,
    ) -> torch.Tensor:
        """``sp``: the sequence-parallel plan of this forward, when the sequence is split over ranks."""
        index = (self.selector or default_selector()).index
        return attention(query, key, value, self.site, index, sp, attn_mask)

    def extra_repr(self) -> str:
        return f"role={self.role!r}, category={self.role_category!r}, head_dim={self.head_dim}"
