"""Attention providers: capability-checked kernels, resolved per role inside a scope."""

from .base import AttentionProvider, AttentionProviderError, AttentionRequest, Capabilities
from .registry import get_provider, provider_names, register_provider
from .selection import (
    AttentionConfig,
    AttentionSelector,
    Resolution,
    attention_scope,
    resolve,
)

__all__ = [
    "AttentionConfig",
    "AttentionProvider",
    "AttentionProviderError",
    "AttentionRequest",
    "AttentionSelector",
    "Capabilities",
    "Resolution",
    "attention_scope",
    "get_provider",
    "provider_names",
    "register_provider",
    "resolve",
]
