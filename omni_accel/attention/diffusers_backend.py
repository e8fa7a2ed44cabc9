"""Diffusers' process-wide attention backend, as omni_accel honours it.

Diffusers keeps one active backend per process (``_AttentionBackendRegistry._active_backend``): read from
``DIFFUSERS_ATTN_BACKEND`` at import, set by ``attention_backend(...)`` inside a ``with`` block, and by any
model's ``set_attention_backend(...)``, which ``reset_attention_backend()`` does not undo. A user who set it
asked for that kernel, so an accelerated model must run it or say why not, never silently run another:
where one of our providers is the same kernel the selector serves the call with it (below an explicit
choice in omni_accel's own config, above "auto"); where none is, Diffusers' own code must run the call.

Diffusers' module is only read if it is loaded: a process that never imported it has made no choice there.
"""

from __future__ import annotations

import sys
from types import MappingProxyType

DEFAULT = "native"  # what Diffusers' registry holds unless someone chose another backend
_DISPATCH_MODULE = "diffusers.models.attention_dispatch"

# Diffusers backends that run the same kernel as one of our providers (diffusers 0.42,
# models/attention_dispatch.py): the native five call torch's scaled_dot_product_attention, the four
# ``_native_*`` ones inside ``sdpa_kernel`` pinned to one kernel, as our pinned providers do (``_native_cudnn``
# on contiguous copies of the BHSD views, the same kernel on the same values); "sage" calls
# sageattention's ``sageattn(q, k, v, tensor_layout="NHD", sm_scale=scale)``, which our sage provider calls
# too for the versions Diffusers accepts (>= 2.1.1).
PROVIDER_FOR = MappingProxyType(
    {
        "native": "sdpa",
        "_native_cudnn": "sdpa_cudnn",
        "_native_flash": "sdpa_flash",
        "_native_efficient": "sdpa_efficient",
        "_native_math": "sdpa_math",
        "sage": "sage",
    }
)


def explicit_choice() -> str | None:
    """The backend the user chose process-wide in Diffusers, or None while its registry holds the default
    ("native"). Read at every call (an attribute read): ``attention_backend`` blocks come and go."""
    module = sys.modules.get(_DISPATCH_MODULE)
    if module is None:
        return None
    active = module._AttentionBackendRegistry._active_backend
    name = getattr(active, "value", active)  # an AttentionBackendName, or a str set directly
    return None if name == DEFAULT else name


def provider_for(backend: str) -> str | None:
    """Our provider that runs the same kernel as Diffusers' ``backend``, or None."""
    return PROVIDER_FOR.get(backend)


def unserved_reason() -> str | None:
    """Why Diffusers' own code must run attention: a message naming the process-wide backend the user
    chose, which no provider of ours runs; None when a provider serves it (or no choice was made).

    A caller that gets a message runs Diffusers' code for the call: the routed patch calls the original
    ``dispatch_attention_fn``, a native block runs Diffusers' forward of the block."""
    choice = explicit_choice()
    if choice is None or choice in PROVIDER_FOR:
        return None
    return no_provider(choice)


def no_provider(backend: str) -> str:
    """The message for a Diffusers backend no provider of ours runs."""
    return (
        f"{describe(backend)} has no omni_accel provider running the same kernel, so Diffusers' own code "
        "runs it"
    )


def describe(backend: str) -> str:
    """How reports and errors name the choice."""
    return f"Diffusers attention backend {backend!r} (process-wide)"


def how_to_change(backend: str) -> str:
    """The fix named in errors: where the choice comes from and what overrides it."""
    return (
        f"{backend!r} was set by Diffusers' attention_backend(...), the DIFFUSERS_ATTN_BACKEND environment "
        "variable or a model's set_attention_backend(...) (which reset_attention_backend() does not undo; "
        "set_attention_backend('native') does): choose a Diffusers backend that can serve this call, or "
        "name a provider for this role in omni_accel's AttentionConfig or attention_scope, which takes "
        "precedence"
    )
