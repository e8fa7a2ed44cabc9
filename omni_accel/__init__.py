"""omni_accel: one line makes a Diffusers pipeline faster, with the same outputs and the same API.

pipe = omni_accel.accelerate(pipe)
"""

from . import _checkout  # noqa: F401  (first: omni_accel.patches from a plain checkout)
from .api import accelerate, describe, restore
from .attention import AttentionConfig, AttentionProviderError, attention_scope, provider_names
from .auto import disable, enable, load_ipython_extension, unload_ipython_extension
from .cache import ExactProjectionCache
from .config import AccelConfig
from .parallel.config import ParallelConfig
from .parallel.mesh import is_main_process
from .report import AccelerationReport

__version__ = "0.1.0"

_TINY_BUILDERS = (
    "tiny_flux2_klein_pipeline",
    "tiny_flux_pipeline",
    "tiny_qwenimage_controlnet_pipeline",
    "tiny_qwenimage_edit_pipeline",
    "tiny_qwenimage_pipeline",
    "tiny_sd3_pipeline",
    "tiny_wan_pipeline",
    "tiny_zimage_pipeline",
)
_RANDOM_BUILDERS = ("random_flux_dev_pipeline",)


def __getattr__(name: str):
    # The offline pipelines import text encoders from transformers: load them only when asked for.
    if name in _TINY_BUILDERS:
        from .models import tiny_pipelines

        return getattr(tiny_pipelines, name)
    if name in _RANDOM_BUILDERS:
        from .models import random_pipelines

        return getattr(random_pipelines, name)
    raise AttributeError(f"module 'omni_accel' has no attribute {name!r}")


__all__ = [
    "AccelConfig",
    "AccelerationReport",
    "AttentionConfig",
    "AttentionProviderError",
    "ExactProjectionCache",
    "ParallelConfig",
    "accelerate",
    "attention_scope",
    "describe",
    "disable",
    "enable",
    "is_main_process",
    "load_ipython_extension",
    "provider_names",
    "random_flux_dev_pipeline",
    "restore",
    "tiny_flux2_klein_pipeline",
    "tiny_flux_pipeline",
    "tiny_qwenimage_controlnet_pipeline",
    "tiny_qwenimage_edit_pipeline",
    "tiny_qwenimage_pipeline",
    "tiny_sd3_pipeline",
    "tiny_wan_pipeline",
    "tiny_zimage_pipeline",
    "unload_ipython_extension",
]
