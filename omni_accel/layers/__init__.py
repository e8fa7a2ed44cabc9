"""Shared pieces of native blocks: projections over a Diffusers module's own linears (packed, LoRA,
tensor-parallel), the MLP, norms, modulation, RoPE and the provider-routed attention call."""

from .attention import AttentionSite, attention
from .feed_forward import feed_forward, feed_forwards_together
from .fused import (
    concat_gelu,
    concat_gelu_fp8,
    gated_residual,
    gelu_tanh,
    norm_modulate,
    norm_modulate_gathered,
    norm_modulate_gathered_together,
    qkv_norm_rope,
)
from .modulation import modulate
from .norms import layer_norm
from .projection import LinearWeights, apply_linear, apply_one, apply_together, read_linear, read_packed
from .rope import apply_rope

__all__ = [
    "AttentionSite",
    "LinearWeights",
    "apply_linear",
    "apply_one",
    "apply_together",
    "apply_rope",
    "attention",
    "concat_gelu",
    "concat_gelu_fp8",
    "feed_forward",
    "feed_forwards_together",
    "gated_residual",
    "gelu_tanh",
    "layer_norm",
    "modulate",
    "norm_modulate",
    "norm_modulate_gathered",
    "norm_modulate_gathered_together",
    "qkv_norm_rope",
    "read_linear",
    "read_packed",
]
