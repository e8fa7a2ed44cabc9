"""omni_accel: one line makes a Diffusers pipeline faster, with the same outputs and the same API.

    pipe = omni_accel.accelerate(pipe)
"""

from .api import accelerate, describe, restore
from .attention import AttentionConfig, AttentionProviderError, attention_scope, provider_names
from .config import AccelConfig
from .models.tiny_pipelines import tiny_flux_pipeline, tiny_qwenimage_pipeline, tiny_sd3_pipeline, tiny_wan_pipeline
from .report import AccelerationReport
from .weights import WeightLoadError

__version__ = "0.1.0"

__all__ = [
    "AccelConfig",
    "AccelerationReport",
    "AttentionConfig",
    "AttentionProviderError",
    "WeightLoadError",
    "accelerate",
    "attention_scope",
    "describe",
    "provider_names",
    "restore",
    "tiny_flux_pipeline",
    "tiny_qwenimage_pipeline",
    "tiny_sd3_pipeline",
    "tiny_wan_pipeline",
]
