"""Routes ``dispatch_attention_fn`` as seen by one Diffusers transformer module through our providers.

Target: the module-level name ``dispatch_attention_fn`` inside a Diffusers transformer module (e.g.
``diffusers.models.transformers.transformer_wan``); only that module's lookups change, not Diffusers'
function. Why: Diffusers picks its attention backend per processor or globally, with no per-pipeline scope
and no capability record; routing the call lets a non-native model use the providers chosen for this
pipeline. Outside an accelerated forward the original function runs, and so it does while Dynamo traces
(anywhere in the process: a user compiling another model of this module with ``fullgraph=True`` must see
Diffusers' function, and our routing reads context variables Dynamo cannot trace).

The routed call computes what Diffusers would: under its default backend ("native") a 2-D mask of
``[batch, kv_len]`` is one row of keys per sample (``_native_attention`` broadcasts it over heads and
queries); the pinned ``_native_*`` backends hand every mask to SDPA as is, and so do we when one of them is
the process-wide choice.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from omni_accel.attention.diffusers_backend import explicit_choice
from omni_accel.attention.routing import (
    processor_backend_reason,
    register_call_site,
    route,
    traced_call,
    traced_route,
    traced_unsupported,
    unregister_call_site,
    unsupported_reason,
)

from . import is_ours, ours

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")
_ORIGINAL = "_omni_accel_original_dispatch_attention_fn"


def _unsupported(dropout_p, is_causal, enable_gqa, attention_kwargs, backend, parallel_config) -> str | None:
    reason = unsupported_reason(is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa)
    if reason is None and attention_kwargs:
        reason = f"backend-specific arguments {sorted(attention_kwargs)}"
    return reason or processor_backend_reason(backend, parallel_config)


def apply(module: ModuleType) -> None:
    original = module.dispatch_attention_fn

    @functools.wraps(original)
    def dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        attention_kwargs=None,
        *,
        backend=None,
        parallel_config=None,
    ):
        if torch.compiler.is_dynamo_compiling():
            if traced_route() is not None:  # below an accelerated model's role hook (else: as Diffusers')
                args = (dropout_p, is_causal, enable_gqa, attention_kwargs, backend, parallel_config)
                unsupported = _unsupported(*args)
                if unsupported:
                    traced_unsupported(unsupported)
                out = None if unsupported else traced_call(site, query, key, value, attn_mask, scale)
                if out is not None:
                    return out
        else:
            out = route(
                query,
                key,
                value,
                attn_mask=attn_mask,
                scale=scale,
                # a backend set on the processor runs Diffusers' own code
                unsupported=_unsupported(
                    dropout_p, is_causal, enable_gqa, attention_kwargs, backend, parallel_config
                ),
                mask_rows=explicit_choice() is None,  # Diffusers' "native" reads 2-D masks as key rows
            )
            if out is not None:
                return out
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            attention_kwargs=attention_kwargs,
            backend=backend,
            parallel_config=parallel_config,
        )

    site = module.__name__
    register_call_site(
        site,
        lambda query, key, value, attn_mask, scale: original(
            query, key, value, attn_mask=attn_mask, scale=scale
        ),
        lambda: explicit_choice() is None,
    )
    setattr(module, _ORIGINAL, original)
    module.dispatch_attention_fn = ours(dispatch_attention_fn, original)


def revert(module: ModuleType) -> None:
    """Puts Diffusers' function back, unless a user's patch took our wrapper's place since: theirs stays
    (ours inside it passes calls through while no accelerated model's role is active)."""
    unregister_call_site(module.__name__)
    if is_ours(module.dispatch_attention_fn):
        module.dispatch_attention_fn = getattr(module, _ORIGINAL)
    delattr(module, _ORIGINAL)
