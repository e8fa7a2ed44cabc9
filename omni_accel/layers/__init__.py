"""Shared pieces of native blocks: projections over a Diffusers module's own linears (packed, LoRA,
tensor-parallel), the MLP, norms, modulation, RoPE and the provider-routed attention call."""

from .attention import AttentionSite, attention
from .feed_forward import feed_forward, gelu_tanh
from .modulation import modulate
from .norms import layer_norm
from .projection import LinearWeights, apply_linear, apply_one, read_linear, read_packed
from .rope import apply_rope

__all__ = [
    "AttentionSite",
    "LinearWeights",
    "apply_linear",
    "apply_one",
    "apply_rope",
    "attention",
    "feed_forward",
    "gelu_tanh",
    "layer_norm",
    "modulate",
    "read_linear",
    "read_packed",
]
