"""PyTorch scaled_dot_product_attention: automatic dispatch, and each of its kernels pinned by name.

Pinning matters because PyTorch's own choice on Hopper is the flash kernel, while cuDNN's fused attention
ran FLUX-sized attention at 617 TFLOP/s against flash's 318 on an H200 in this workplace (the whole FLUX
step: docs/PERFORMANCE.md); pinning also makes a run reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..base import AttentionProvider, Capabilities

_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
_HALF = frozenset({torch.float16, torch.bfloat16})


def _to_bhsd(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2) for t in tensors]


class SdpaProvider(AttentionProvider):
    """PyTorch picks the kernel per call: the portable lossless baseline."""

    name = "sdpa"
    capabilities = Capabilities(
        dtypes=_FLOATS,
        devices=frozenset({"cpu", "cuda", "xpu", "mps"}),
        max_head_dim=1024,
        supports_mask=True,
    )
    backends: list[SDPBackend] | None = None

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        q, k, v = _to_bhsd(query, key, value)
        if self.backends is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        else:
            with sdpa_kernel(self.backends):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        return out.transpose(1, 2)


class SdpaMathProvider(SdpaProvider):
    """The reference math path; also the one provider that returns the LSE on every device."""

    name = "sdpa_math"
    capabilities = Capabilities(
        dtypes=_FLOATS,
        devices=frozenset({"cpu", "cuda", "xpu", "mps"}),
        max_head_dim=1024,
        supports_mask=True,
        returns_lse=True,
    )
    backends = [SDPBackend.MATH]

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if not return_lse:
            return super().forward(query, key, value, attn_mask=attn_mask, scale=scale)
        q, k, v = _to_bhsd(query, key, value)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask.float()
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(query.dtype)
        return out.transpose(1, 2), lse


class SdpaFlashProvider(SdpaProvider):
    name = "sdpa_flash"
    capabilities = Capabilities(
        dtypes=_HALF,
        devices=frozenset({"cuda"}),
        max_head_dim=256,
        head_dim_multiple=8,
        returns_lse=True,
        min_compute_capability=(8, 0),
    )
    backends = [SDPBackend.FLASH_ATTENTION]

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if not return_lse:
            return super().forward(query, key, value, attn_mask=attn_mask, scale=scale)
        q, k, v = _to_bhsd(query, key, value)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale
        )[:2]
        return out.transpose(1, 2), lse.reshape(q.shape[:3])


class SdpaCudnnProvider(SdpaProvider):
    name = "sdpa_cudnn"
    capabilities = Capabilities(
        dtypes=_HALF,
        devices=frozenset({"cuda"}),
        max_head_dim=128,
        head_dim_multiple=8,
        returns_lse=True,
        min_compute_capability=(8, 0),
    )
    backends = [SDPBackend.CUDNN_ATTENTION]

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if not return_lse:
            return super().forward(query, key, value, attn_mask=attn_mask, scale=scale)
        q, k, v = _to_bhsd(query, key, value)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, False, False, scale=scale
        )[:2]
        return out.transpose(1, 2), lse.reshape(q.shape[:3])


class SdpaEfficientProvider(SdpaProvider):
    name = "sdpa_efficient"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        max_head_dim=512,
        head_dim_multiple=8,
        supports_mask=True,
        min_compute_capability=(5, 0),
    )
    backends = [SDPBackend.EFFICIENT_ATTENTION]
