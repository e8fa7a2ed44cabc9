"""Provider names -> implementations, imported on first use so optional kernels cost nothing unless chosen."""

from __future__ import annotations

import importlib

from .base import AttentionProvider, AttentionProviderError

_TARGETS: dict[str, str] = {
    "sdpa": "omni_accel.attention.providers.sdpa:SdpaProvider",
    "sdpa_cudnn": "omni_accel.attention.providers.sdpa:SdpaCudnnProvider",
    "sdpa_flash": "omni_accel.attention.providers.sdpa:SdpaFlashProvider",
    "sdpa_efficient": "omni_accel.attention.providers.sdpa:SdpaEfficientProvider",
    "sdpa_math": "omni_accel.attention.providers.sdpa:SdpaMathProvider",
    "flashinfer": "omni_accel.attention.providers.flashinfer:FlashInferProvider",
    "sage": "omni_accel.attention.providers.sage:SageProvider",
}

# Lossless providers tried in order under "auto". cuDNN leads on CUDA: on an H200 it ties FlashInfer's fa3
# at FLUX's 4608 tokens and beats PyTorch's flash kernel by 1.6x (docs/PERFORMANCE.md). Lossy providers
# (sage) are never automatic.
_PLATFORM_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa", "sdpa_math"),
}
_DEFAULT_PREFERENCE = ("sdpa", "sdpa_math")
# Long sequences go to FlashInfer first where it is installed: at Wan 14B's 32760 tokens its fa3 kernel ran
# 648 TFLOP/s on an H200 against cuDNN's 567 (the same at 20 heads, a ulysses=2 rank's share). Its first
# use on a machine JIT-compiles the kernel (~75 s, then cached on disk), a price a video model pays once.
# Where it is not installed nothing changes. The threshold sits between the measured points (4608: a tie).
_LONG_SEQUENCE = 16384
_LONG_SEQUENCE_FIRST = "flashinfer"
# A masked call goes to PyTorch's own SDPA dispatch first: it picks the kernel plain Diffusers gets for the
# same mask (on an H200, Qwen-Image's padded text mask ran 1.4x faster there than pinned to the efficient
# kernel; cuDNN given the mask made the compiled Qwen-Image forward 90.1 ms against 84.3 with SDPA's choice,
# benchmarks/generic_step.py), so a routed model is never slower than in Diffusers.
_MASKED_FIRST = "sdpa"

_INSTANCES: dict[str, AttentionProvider] = {}


def provider_names() -> list[str]:
    return sorted(_TARGETS)


def platform_preference(device_type: str, masked: bool = False, kv_len: int | None = None) -> tuple[str, ...]:
    """The lossless providers ``auto`` tries, in order, for a call on ``device_type``."""
    preference = _PLATFORM_PREFERENCE.get(device_type, _DEFAULT_PREFERENCE)
    if masked:
        return (_MASKED_FIRST, *(name for name in preference if name != _MASKED_FIRST))
    long = device_type == "cuda" and kv_len is not None and kv_len >= _LONG_SEQUENCE
    if long and get_provider(_LONG_SEQUENCE_FIRST).unavailable_reason() is None:
        return (_LONG_SEQUENCE_FIRST, *preference)
    return preference


def check_provider_name(name: str, *, where: str) -> None:
    if name != "auto" and name not in _TARGETS:
        raise AttentionProviderError(
            f"Unknown attention provider {name!r} in {where}. Valid names: 'auto', "
            + ", ".join(repr(n) for n in provider_names())
            + "."
        )


def get_provider(name: str) -> AttentionProvider:
    check_provider_name(name, where="get_provider")
    if name not in _INSTANCES:
        module_name, class_name = _TARGETS[name].split(":")
        _INSTANCES[name] = getattr(importlib.import_module(module_name), class_name)()
    return _INSTANCES[name]


def register_provider(name: str, target: str) -> None:
    """Adds an out-of-tree provider given as ``"package.module:ClassName"``."""
    if name in _TARGETS and _TARGETS[name] != target:
        raise ValueError(f"Attention provider {name!r} is already registered as {_TARGETS[name]!r}.")
    _TARGETS[name] = target
