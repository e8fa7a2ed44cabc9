"""Routes ``F.scaled_dot_product_attention`` as seen by one Diffusers module through our providers.

Target: the name ``F`` (``torch.nn.functional``) inside a Diffusers module, e.g.
``diffusers.models.attention_processor``, whose classic processors (SD3's JointAttnProcessor2_0...) call
``F.scaled_dot_product_attention`` directly. The name is bound to a proxy module that forwards every other
attribute to ``torch.nn.functional``; torch itself is untouched. Outside an accelerated forward the original
function runs, and so it does while Dynamo traces (anywhere in the process: a user's ``torch.compile`` of
another model using these processors must see torch's function; our routing cannot be traced).
"""

from __future__ import annotations

import types
from types import ModuleType

import torch
import torch.nn.functional as F

from omni_accel.attention.routing import route, unsupported_reason

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")
_ORIGINAL = "_omni_accel_original_F"


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """BHSD in and out, like torch's; our providers take BSHD, so the transposes are views."""
    if not torch.compiler.is_dynamo_compiling():
        out = route(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=attn_mask,
            scale=scale,
            unsupported=unsupported_reason(is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa),
        )
        if out is not None:
            return out.transpose(1, 2)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


class _RoutedFunctional(types.ModuleType):
    def __getattr__(self, name: str):
        return getattr(F, name)


def apply(module: ModuleType) -> None:
    proxy = _RoutedFunctional("torch.nn.functional")
    proxy.scaled_dot_product_attention = scaled_dot_product_attention
    setattr(module, _ORIGINAL, module.F)
    module.F = proxy


def revert(module: ModuleType) -> None:
    module.F = getattr(module, _ORIGINAL)
    delattr(module, _ORIGINAL)
