"""Shared building blocks of native transformers: parallel linears, norms, RoPE, modulation, attention."""

from .attention import Attention
from .embeddings import MLPEmbedder, timestep_sinusoid
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .modulation import Modulation, modulate
from .norms import RMSNorm, layer_norm
from .rope import apply_rope, rope_cos_sin

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MLPEmbedder",
    "Modulation",
    "RMSNorm",
    "ReplicatedLinear",
    "RowParallelLinear",
    "apply_rope",
    "layer_norm",
    "modulate",
    "rope_cos_sin",
    "timestep_sinusoid",
]
