"""omni_accel: one line makes a Diffusers pipeline faster, with the same outputs and the same API.

pipe = omni_accel.accelerate(pipe)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _checkout  # noqa: F401  (first: omni_accel.patches from a plain checkout)

__version__ = "0.1.0"

# Where each public name lives. Nothing heavy is imported until a name is used, so ``import omni_accel``
# (and ``omni-accel --help``) costs no torch or Diffusers import.
_PUBLIC = {
    "accelerate": "api",
    "describe": "api",
    "restore": "api",
    "AttentionConfig": "attention",
    "AttentionProviderError": "attention",
    "attention_scope": "attention",
    "provider_names": "attention",
    "disable": "auto",
    "enable": "auto",
    "load_ipython_extension": "auto",
    "unload_ipython_extension": "auto",
    "ExactProjectionCache": "cache",
    "AccelConfig": "config",
    "LayoutTuning": "parallel.config",
    "ParallelConfig": "parallel.config",
    "is_main_process": "parallel.mesh",
    "AccelerationReport": "report",
    "random_flux_dev_pipeline": "models.random_pipelines",
    # The offline pipelines import text encoders from transformers.
    "tiny_flux2_klein_pipeline": "models.tiny_pipelines",
    "tiny_flux_pipeline": "models.tiny_pipelines",
    "tiny_qwenimage_controlnet_pipeline": "models.tiny_pipelines",
    "tiny_qwenimage_edit_pipeline": "models.tiny_pipelines",
    "tiny_qwenimage_pipeline": "models.tiny_pipelines",
    "tiny_sd3_pipeline": "models.tiny_pipelines",
    "tiny_wan_pipeline": "models.tiny_pipelines",
    "tiny_zimage_pipeline": "models.tiny_pipelines",
}

if TYPE_CHECKING:
    from .api import accelerate, describe, restore
    from .attention import AttentionConfig, AttentionProviderError, attention_scope, provider_names
    from .auto import disable, enable, load_ipython_extension, unload_ipython_extension
    from .cache import ExactProjectionCache
    from .config import AccelConfig
    from .models.random_pipelines import random_flux_dev_pipeline
    from .models.tiny_pipelines import (
        tiny_flux2_klein_pipeline,
        tiny_flux_pipeline,
        tiny_qwenimage_controlnet_pipeline,
        tiny_qwenimage_edit_pipeline,
        tiny_qwenimage_pipeline,
        tiny_sd3_pipeline,
        tiny_wan_pipeline,
        tiny_zimage_pipeline,
    )
    from .parallel.config import LayoutTuning, ParallelConfig
    from .parallel.mesh import is_main_process
    from .report import AccelerationReport


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    try:  # a submodule used as an attribute (``omni_accel.api``) after a bare ``import omni_accel``
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'omni_accel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "AccelConfig",
    "AccelerationReport",
    "AttentionConfig",
    "AttentionProviderError",
    "ExactProjectionCache",
    "LayoutTuning",
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
