"""The attention layer models call: provider resolution by role, around one kernel call.

``Attention`` is the seam where sequence parallelism plugs in (pre-communication -> provider kernel ->
post-communication); the provider never knows about the layout, and the model never knows the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionRequest
from ..attention.selection import AttentionSelector, default_selector


class Attention(nn.Module):
    """Non-causal multi-head attention over BSHD tensors.

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
        self.scale = head_dim**-0.5 if scale is None else scale
        self.selector: AttentionSelector | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        request = AttentionRequest.for_call(query, key, has_mask=attn_mask is not None)
        selector = self.selector or default_selector()
        provider = selector.resolve(self.role, self.role_category, request).provider
        return provider.forward(query, key, value, attn_mask=attn_mask, scale=self.scale)

    def extra_repr(self) -> str:
        return f"role={self.role!r}, category={self.role_category!r}, head_dim={self.head_dim}"
