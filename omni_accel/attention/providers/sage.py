"""SageAttention (INT8 Q·K with a smoothed K, low-precision P·V) behind the provider contract: lossy, so only
ever used when named explicitly.

Two APIs are supported, told apart by the installed distribution's version (never by comparing strings):

* 1.0.6, PyPI's wheel: Triton kernels, head sizes 64/96/128, no LSE. Its K smoothing subtracts the mean from
  the caller's key *in place*, so the smoothing is done here, out of place, and the kernel is told not to.
* 2.x, built from source: CUDA kernels per architecture, head sizes up to 128 (padded), and the LSE, which
  is trusted from 2.1.1 on (the release diffusers requires; earlier sm90 LSEs were reported wrong).

``sageattention`` is imported lazily; the call is the custom op ``omni_accel::sage_attention`` so
torch.compile traces through it. Inference only: no backward is registered.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

import torch
from packaging.version import InvalidVersion, Version

from ..base import AttentionProvider, AttentionRequest, Capabilities, bshd_attention_fake

MIN_VERSION = Version("1.0.6")
LSE_VERSION = Version("2.1.1")
INSTALL_HINT = "pip install 'omni-accel[sage]' (sageattention>=1.0.6; >=2.1.1 for the LSE)"
V1_HEAD_DIMS = (64, 96, 128)

# What every supported version serves (1.0.6's limits); 2.x adds the other head sizes up to 128, then the LSE.
CAPABILITIES_V1 = Capabilities(
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    devices=frozenset({"cuda"}),
    head_dims=V1_HEAD_DIMS,
    lossless=False,
    min_compute_capability=(8, 0),
    # 1.0.6 loads the keys past the end of the last 64-key block as zeros and gives them softmax weight
    # (a wrong output: docs/archive/performance-history.md); 2.x is held to the same rule until shown
    # otherwise.
    kv_len_multiple=64,
)
CAPABILITIES_V2 = dataclasses.replace(CAPABILITIES_V1, head_dims=None, max_head_dim=128)
CAPABILITIES_V2_LSE = dataclasses.replace(CAPABILITIES_V2, returns_lse=True)


@functools.cache
def installed_version() -> Version | None:
    try:
        return Version(importlib.metadata.version("sageattention"))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def capabilities_for(version: Version | None) -> Capabilities:
    """What ``version`` serves; without one, what every supported version serves."""
    if version is None or version.major < 2:
        return CAPABILITIES_V1
    return CAPABILITIES_V2_LSE if version >= LSE_VERSION else CAPABILITIES_V2


@functools.cache
def _unavailable() -> str | None:
    version = installed_version()
    if version is None:
        return f"the sageattention package is not installed: {INSTALL_HINT}"
    if version < MIN_VERSION:
        return f"sageattention {version} is older than {MIN_VERSION}: {INSTALL_HINT}"
    try:
        import sageattention  # noqa: F401
    except Exception as exc:  # Triton or a CUDA extension can fail with more than ImportError
        return f"sageattention {version} failed to import ({type(exc).__name__}: {exc}); reinstall with {INSTALL_HINT}"
    return None


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@torch.library.custom_op("omni_accel::sage_attention", mutates_args=(), device_types="cuda")
def sage_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """BSHD ("NHD" to sage) attention; the LSE is ``[B, H, S]`` natural log (2.x only), or empty."""
    from sageattention import sageattn

    version = installed_version()
    if return_lse and not capabilities_for(version).returns_lse:
        raise ValueError(
            f"sageattention {version} does not return a trusted LSE; {LSE_VERSION} or newer does."
        )
    query, key, value = (_unit_last_stride(t) for t in (query, key, value))
    # 2.x calls torch.cuda.set_device on every call; the context restores the caller's device afterwards.
    with torch.cuda.device(query.device):
        if version is not None and version.major >= 2:
            result = sageattn(
                query, key, value, tensor_layout="NHD", is_causal=False, sm_scale=scale, return_lse=return_lse
            )
        else:
            smoothed_key = key - key.mean(dim=1, keepdim=True)
            result = sageattn(
                query,
                smoothed_key,
                value,
                tensor_layout="NHD",
                is_causal=False,
                sm_scale=scale,
                smooth_k=False,
            )
    out, lse = (result[0], result[1]) if return_lse else (result, query.new_empty(0, dtype=torch.float32))
    # 2.x slices padded head sizes back with a view; the fake output (and callers) expect dense tensors.
    return out.contiguous(), lse.float().contiguous()


sage_attention.register_fake(bshd_attention_fake)


class SageProvider(AttentionProvider):
    """SageAttention: fast and lossy (INT8 Q·K); ``capabilities`` holds for every supported version, and
    ``reasons_against`` judges by the version installed."""

    name = "sage"
    capabilities = CAPABILITIES_V1

    def unavailable_reason(self) -> str | None:
        return _unavailable()

    def reasons_against(self, request: AttentionRequest) -> list[str]:
        missing = self.unavailable_reason()
        capabilities = capabilities_for(installed_version())
        return ([missing] if missing else []) + capabilities.reasons_against(request)

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if attn_mask is not None:
            raise ValueError("The sage provider cannot apply an attention mask; choose one that can.")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = sage_attention(query, key, value, scale, return_lse)
        return (out, lse) if return_lse else out
