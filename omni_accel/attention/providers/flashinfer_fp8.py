"""FlashInfer's FP8 attention (its FA3 Hopper kernel with e4m3 q/k/v) behind the provider contract: lossy,
so only ever used when named explicitly (``attention="flashinfer_fp8"``).

q, k and v are quantized here to e4m3 with one scale per (batch element, head): ``amax / 448`` over that
head's tokens and channels, the values multiplied by the scale's reciprocal in float32.
FlashInfer's scales are per head of a launch, so each batch element is its own launch: a CFG pair or a
batch of prompts gets the scales each element would get alone, and so the same output as alone. The
kernel multiplies the scores by ``scale_q * scale_k`` and the output by ``scale_v``; its softmax
probabilities go to e4m3 for the P·V product as well (FlashInfer's design), which is most of its error.

Over fewer than ``MIN_KEYS`` keys it is refused (a clear error for an explicit choice): there the
kernel's output runs low. Measured on an H100 (random q/k/v, 24 heads of 128), the output's norm against
fp64 attention of the same e4m3 inputs: 0.942 over 333 keys, 0.954 over 1024, 0.988 over 2048 and 4096,
0.999 over 4608, 0.996 over 8192; FlashInfer's bf16 kernel on those inputs matches fp64 exactly, so the
loss is the kernel's e4m3 softmax probabilities, worst where the softmax is flat over few keys (with
scores three times as large, within 0.5 % at every length).

The call is the custom op ``omni_accel::flashinfer_fp8_attention`` (quantization included) so that
torch.compile traces through it. Inference only: no backward is registered.
"""

from __future__ import annotations

import math

import torch

from ...layers.fp8 import _AMAX_FLOOR, E4M3, E4M3_MAX
from ..base import AttentionProvider, AttentionRequest, Capabilities, bshd_attention_fake
from .flashinfer import HEAD_DIMS, _planned_wrapper, _unavailable, natural_lse


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[B, S, H, D]`` -> e4m3 ``[B, S, H, D]`` (contiguous) and float32 scales ``[B, H]``."""
    amax = torch.linalg.vector_norm(x, ord=math.inf, dim=(1, 3)).float()
    scale = amax.clamp_min(_AMAX_FLOOR) * (1 / E4M3_MAX)
    # float32 (a float32 tensor operand promotes). No clamp, a pass of float32 saved: |x| <= amax, so
    # |x| * (1 / scale) exceeds 448 by a few float32 ulps at most and rounds to 448, e4m3's largest value.
    values = x * scale.reciprocal()[:, None, :, None]
    return values.to(E4M3), scale


@torch.library.custom_op("omni_accel::flashinfer_fp8_attention", mutates_args=(), device_types="cuda")
def flashinfer_fp8_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """BSHD attention with e4m3 inputs, one FlashInfer launch per batch element; the output in the
    query's dtype, the LSE ``[B, H, S]`` natural log, or empty."""
    batch, seq_q, heads, head_dim = query.shape
    seq_kv, kv_heads = key.shape[1], key.shape[2]
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_heads(t) for t in (query, key, value))
    out = query.new_empty(query.shape)
    lse = query.new_empty((batch, seq_q, heads), dtype=torch.float32) if return_lse else None
    with torch.cuda.device(query.device):
        wrapper = _planned_wrapper(
            1, seq_q, seq_kv, heads, kv_heads, head_dim, query.dtype, query.device, scale, E4M3
        )
        for b in range(batch):
            wrapper.run(
                q8[b],
                k8[b],
                v8[b],
                q_scale[b],
                k_scale[b],
                v_scale[b],
                out=out[b],
                lse=None if lse is None else lse[b],
                return_lse=return_lse,
            )
    if lse is None:
        return out, query.new_empty(0, dtype=torch.float32)
    return out, natural_lse(lse.view(batch * seq_q, heads), batch)


flashinfer_fp8_attention.register_fake(bshd_attention_fake)

MIN_KEYS = 2048  # fewer keys: the output's norm runs 5-6 % low (the module docstring)


class FlashInferFp8Provider(AttentionProvider):
    """FlashInfer's FA3 kernel on e4m3 q/k/v (Hopper only): lossy, an explicit choice only. Returns the LSE,
    so ring attention can merge its parts."""

    name = "flashinfer_fp8"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        head_dims=HEAD_DIMS,
        returns_lse=True,
        lossless=False,
        min_compute_capability=(9, 0),
    )

    def unavailable_reason(self) -> str | None:
        return _unavailable()

    def reasons_against(self, request: AttentionRequest) -> list[str]:
        reasons = super().reasons_against(request)
        capability = request.compute_capability
        if request.kv_len is not None and request.kv_len < MIN_KEYS:
            reasons.append(
                f"attends over at least {MIN_KEYS} keys, not {request.kv_len} (over fewer, FlashInfer's FP8 "
                "kernel's output runs up to 6 % low in norm; choose it per role for the long self-attention "
                "only)"
            )
        if request.device_type == "cuda" and capability is not None and capability[0] > 9:
            reasons.append(
                f"runs FlashInfer's FA3 kernel, built for compute capability 9.x (Hopper), not "
                f"{capability[0]}.{capability[1]}"
            )
        return reasons

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if attn_mask is not None:
            raise ValueError(
                "The flashinfer_fp8 provider cannot apply an attention mask; choose one that can."
            )
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = flashinfer_fp8_attention(query, key, value, scale, return_lse)
        return (out, lse) if return_lse else out
