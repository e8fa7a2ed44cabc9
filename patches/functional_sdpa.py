"""Routes ``F.scaled_dot_product_attention`` as seen by one Diffusers module through our providers.

Target: the name ``F`` (``torch.nn.functional``) inside a Diffusers module, e.g.
``diffusers.models.attention_processor``, whose classic processors (SD3's JointAttnProcessor2_0...) call
``F.scaled_dot_product_attention`` directly. The name is bound to a proxy module that forwards every other
attribute to ``torch.nn.functional``; torch itself is untouched. Outside an accelerated forward the original
function runs. While Dynamo traces, a call below an accelerated model's role hook becomes our
``diffusers_attention`` op, and any other traces torch's function (a user's ``torch.compile`` of another
model using these processors sees torch's function; see ``omni_accel.attention.routing``).
"""

from __future__ import annotations

import types
from types import ModuleType

import torch
import torch.nn.functional as F

from omni_accel.attention.routing import (
    register_call_site,
    route,
    traced_call,
    traced_route,
    traced_unsupported,
    unsupported_reason,
)

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")
_ORIGINAL = "_omni_accel_original_F"


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """BHSD in and out, like torch's; our providers take BSHD, so the transposes are views."""
    unsupported = unsupported_reason(is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa)
    bshd = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    if torch.compiler.is_dynamo_compiling():
        if unsupported and traced_route() is not None:
            traced_unsupported(unsupported)
        out = None if unsupported else traced_call(_SITE, *bshd, attn_mask, scale)
    else:
        out = route(*bshd, attn_mask=attn_mask, scale=scale, unsupported=unsupported, follows_backend=False)
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


_SITE = "torch.nn.functional"


def _original(query, key, value, attn_mask, scale):
    """torch's function over BSHD tensors (the op's fallback)."""
    bhsd = (t.transpose(1, 2) for t in (query, key, value))
    return F.scaled_dot_product_attention(*bhsd, attn_mask=attn_mask, scale=scale).transpose(1, 2)


class _RoutedFunctional(types.ModuleType):
    def __getattr__(self, name: str):
        return getattr(F, name)


def binds_functional(module: ModuleType) -> bool:
    """Whether ``module`` calls torch's functions as ``F.<name>`` (also while this patch holds its ``F``)."""
    return vars(module).get(_ORIGINAL, vars(module).get("F")) is F


def apply(module: ModuleType) -> None:
    # Diffusers' code here calls torch's SDPA, never its process-wide backend: neither do we.
    register_call_site(_SITE, _original, lambda: False, follows_backend=False)
    proxy = _RoutedFunctional("torch.nn.functional")
    proxy.scaled_dot_product_attention = scaled_dot_product_attention
    setattr(module, _ORIGINAL, module.F)
    module.F = proxy


def revert(module: ModuleType) -> None:
    module.F = getattr(module, _ORIGINAL)
    delattr(module, _ORIGINAL)
