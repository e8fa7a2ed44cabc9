"""Provider names -> implementations, imported on first use so optional kernels cost nothing unless chosen."""

from __future__ import annotations

import importlib

from .base import AttentionProvider, AttentionProviderError, AttentionRequest

_TARGETS: dict[str, str] = {
    "sdpa": "omni_accel.attention.providers.sdpa:SdpaProvider",
    "sdpa_cudnn": "omni_accel.attention.providers.sdpa:SdpaCudnnProvider",
    "sdpa_flash": "omni_accel.attention.providers.sdpa:SdpaFlashProvider",
    "sdpa_efficient": "omni_accel.attention.providers.sdpa:SdpaEfficientProvider",
    "sdpa_math": "omni_accel.attention.providers.sdpa:SdpaMathProvider",
    "flashinfer": "omni_accel.attention.providers.flashinfer:FlashInferProvider",
    "sage": "omni_accel.attention.providers.sage:SageProvider",
    "flashinfer_fp8": "omni_accel.attention.providers.flashinfer_fp8:FlashInferFp8Provider",
}

# Lossless providers tried in order under "auto". cuDNN leads on CUDA: at FLUX's 4608 tokens it ties
# FlashInfer and beats PyTorch's flash kernel (docs/archive/performance-history.md). Lossy providers (sage,
# flashinfer_fp8) are never automatic.
_PLATFORM_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa", "sdpa_math"),
}
_DEFAULT_PREFERENCE = ("sdpa", "sdpa_math")
# FlashInfer goes first where it is installed and faster than cuDNN (``benchmarks/kernel_bench.py
# attention-shapes``, docs/archive/performance-history.md): long sequences (Wan 14B's 32760 tokens,
# HunyuanVideo 1.5's 35375) and head size 64 (SD3.5-large's 4429 tokens x 38 heads). At head size 128 and
# 4352-6144 tokens (FLUX, Qwen-Image, Z-Image, FLUX.2, LTX-2) cuDNN ties or wins, so it keeps those. Its
# kernel is JIT-compiled on first use; until it is built in the background (``kernel_builds``) the next
# provider serves. Where it is not installed nothing changes.
_LONG_SEQUENCE = 16384
_SMALL_HEAD_DIM, _SMALL_HEADS_FROM = 64, 4096  # head size 64, from this many keys
_FLASHINFER = "flashinfer"
# A masked call goes to PyTorch's own SDPA dispatch first: it picks the kernel plain Diffusers gets for the
# same mask, which measured faster on Qwen-Image's padded text mask than the pinned efficient kernel or cuDNN
# given the mask (docs/archive/performance-history.md), so a routed model is never slower than in Diffusers.
_MASKED_FIRST = "sdpa"

_INSTANCES: dict[str, AttentionProvider] = {}


def provider_names() -> list[str]:
    return sorted(_TARGETS)


def platform_preference(request: AttentionRequest) -> tuple[tuple[str, ...], str]:
    """The lossless providers ``auto`` tries for ``request``, in order, and a note on the order ("" or
    why a faster provider waits: its kernel is being built)."""
    preference = _PLATFORM_PREFERENCE.get(request.device_type, _DEFAULT_PREFERENCE)
    if request.has_mask:
        return (_MASKED_FIRST, *(name for name in preference if name != _MASKED_FIRST)), ""
    if not _flashinfer_first(request):
        return preference, ""
    flashinfer = get_provider(_FLASHINFER)
    if flashinfer.unavailable_reason() is not None or flashinfer.reasons_against(request):
        return preference, ""
    if not flashinfer.kernel_ready(request):
        return preference, f"{_FLASHINFER} waits for its kernel, built in the background"
    return (_FLASHINFER, *preference), ""


def _flashinfer_first(request: AttentionRequest) -> bool:
    if request.device_type != "cuda" or request.kv_len is None:
        return False
    small_heads = request.head_dim == _SMALL_HEAD_DIM and request.kv_len >= _SMALL_HEADS_FROM
    return request.kv_len >= _LONG_SEQUENCE or small_heads


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
