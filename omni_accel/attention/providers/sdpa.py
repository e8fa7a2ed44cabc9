"""PyTorch scaled_dot_product_attention: automatic dispatch, and each of its kernels pinned by name.

Pinning matters because PyTorch's own choice on Hopper is the flash kernel, while cuDNN's fused attention
is faster at the models' shapes (docs/archive/performance-history.md); pinning also makes a run
reproducible.

A pinned kernel has limits the declared capabilities cannot hold (they depend on the call's tensors and on
process-wide switches): on an H200 with torch 2.11 and cuDNN 9.19, cuDNN refuses any sequence of length 1
and every call while deterministic algorithms are on (what Diffusers' own tests turn on), and PyTorch then
raises "No available kernel". PyTorch's ``can_use_*`` checks agree with what its three kernels run
(tests/test_gpu_sdpa_kernels.py sweeps dtypes, head sizes, lengths, batches and layouts), so a pinned
provider asks its check in ``forward``, on the BHSD views the call makes anyway, and raises
``KernelRefusal`` instead of launching. The check costs no more than a cache keyed by the tensors'
geometry would, and such a cache could not see the switches (docs/archive/performance-history.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.backends.cuda as cuda_backends
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..base import AttentionProvider, AttentionRequest, Capabilities, KernelRefusal

_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
_HALF = frozenset({torch.float16, torch.bfloat16})


def _to_bhsd(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2) for t in tensors]


# Per pinned kernel: PyTorch's check and its name, the switch that turns the kernel off process-wide (the
# check says no while it is off, though our pinned call would turn it on) and its reading.
_CHECKS: dict[SDPBackend, tuple[Callable[..., bool], str, str, Callable[[], bool]]] = {
    SDPBackend.CUDNN_ATTENTION: (
        cuda_backends.can_use_cudnn_attention,
        "can_use_cudnn_attention",
        "enable_cudnn_sdp",
        cuda_backends.cudnn_sdp_enabled,
    ),
    SDPBackend.FLASH_ATTENTION: (
        cuda_backends.can_use_flash_attention,
        "can_use_flash_attention",
        "enable_flash_sdp",
        cuda_backends.flash_sdp_enabled,
    ),
    SDPBackend.EFFICIENT_ATTENTION: (
        cuda_backends.can_use_efficient_attention,
        "can_use_efficient_attention",
        "enable_mem_efficient_sdp",
        cuda_backends.mem_efficient_sdp_enabled,
    ),
}


def _refusal_message(backend: SDPBackend, tensors: dict[str, torch.Tensor | None]) -> str:
    """What a refused call was (BSHD shapes and strides, as our providers take them) and the likely cause."""
    _, check, switch, switched_on = _CHECKS[backend]
    described = ", ".join(
        f"{name} {list(t.shape)} strides {list(t.stride())}" for name, t in tensors.items() if t is not None
    )
    query = tensors["q"]
    causes = []
    if not switched_on():
        causes.append(f"it is switched off process-wide (torch.backends.cuda.{switch}(False))")
    if torch.are_deterministic_algorithms_enabled():
        causes.append("deterministic algorithms are on (torch.use_deterministic_algorithms)")
    if backend == SDPBackend.CUDNN_ATTENTION and min(query.shape[1], tensors["k"].shape[1]) == 1:
        causes.append("a sequence of length 1")
    cause = (
        "likely: " + "; ".join(causes)
        if causes
        else f"torch.backends.cuda.{check}(params, debug=True) prints PyTorch's reason"
    )
    return (
        f"these tensors ({str(query.dtype).removeprefix('torch.')}, {described}): PyTorch's {check} says "
        f"its kernel does not take them ({cause})"
    )


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
    # The pinned kernel called as the SDPA dispatcher calls the one it chose (BHSD in, the output first),
    # not inside ``sdpa_kernel``: that context sets process-wide flags, which a thread compiling or running
    # compiled blocks beside the caller (a background compile) would see mid-call. None: ``sdpa_kernel``.
    kernel: Callable[..., torch.Tensor] | None = None

    def refusal(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> str | None:
        return self._refusal(*_to_bhsd(query, key, value), attn_mask)

    def _refusal(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> str | None:
        """PyTorch's own check of the one kernel this provider pins, over the BHSD views SDPA is given
        (PyTorch's dispatch, and the math kernel, take every call the capabilities admit). Skipped while
        Dynamo traces: the check cannot be traced, and unmasked compiled attention runs in our custom op."""
        # Traced, nothing below may be looked at: Dynamo cannot guard on a dict keyed by an enum member.
        if torch.compiler.is_dynamo_compiling() or self.backends is None or self.backends[0] not in _CHECKS:
            return None
        if _CHECKS[self.backends[0]][0](
            cuda_backends.SDPAParams(q, k, v, attn_mask, 0.0, False, False), False
        ):
            return None
        bshd = {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2), "mask": attn_mask}
        return _refusal_message(self.backends[0], bshd)

    def _checked_bhsd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The BHSD views of a call, after the pinned kernel's check (one per call, cheap: see the module)."""
        q, k, v = _to_bhsd(query, key, value)
        refused = self._refusal(q, k, v, attn_mask)
        if refused is not None:
            raise KernelRefusal(self.name, refused)
        return q, k, v

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        q, k, v = self._checked_bhsd(query, key, value, attn_mask)
        if self.backends is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        elif self.kernel is not None:  # its own check (``_refusal``) has passed
            out = self.kernel(q, k, v, attn_mask, scale)
        else:  # the math kernel, or a masked call of the efficient one: SDPA prepares the mask for them
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


# PyTorch's flash kernel for the CPU: what Diffusers' ``_native_flash`` backend runs on a CPU (its dtype check
# is off unless DIFFUSERS_ATTN_CHECKS is set), so a process-wide choice of it is served there too.
_CPU_FLASH = Capabilities(dtypes=_FLOATS, devices=frozenset({"cpu"}), max_head_dim=1024, returns_lse=True)


class SdpaFlashProvider(SdpaProvider):
    name = "sdpa_flash"
    capabilities = Capabilities(
        dtypes=_HALF,
        devices=frozenset({"cuda", "cpu"}),
        max_head_dim=256,
        head_dim_multiple=8,
        returns_lse=True,
        min_compute_capability=(8, 0),
    )
    backends = [SDPBackend.FLASH_ATTENTION]

    def reasons_against(self, request: AttentionRequest) -> list[str]:
        if request.device_type == "cpu":
            return _CPU_FLASH.reasons_against(request)
        return super().reasons_against(request)

    @staticmethod
    def kernel(q, k, v, attn_mask, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[0]

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if query.device.type == "cpu":  # the kernel raises for what it cannot take, as it does in Diffusers
            q, k, v = _to_bhsd(query, key, value)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, scale=scale
            )
            return (out.transpose(1, 2), lse) if return_lse else out.transpose(1, 2)
        if not return_lse:
            return super().forward(query, key, value, attn_mask=attn_mask, scale=scale)
        q, k, v = self._checked_bhsd(query, key, value, attn_mask)
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
        supports_mask=True,
        returns_lse=True,
        min_compute_capability=(8, 0),
    )
    backends = [SDPBackend.CUDNN_ATTENTION]

    @staticmethod
    def kernel(q, k, v, attn_mask, scale):
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA hands a boolean mask to cuDNN
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                attn_mask.logical_not(), float("-inf")
            )
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, attn_mask, False, 0.0, False, False, scale=scale
        )[0]

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if not return_lse:
            return super().forward(query, key, value, attn_mask=attn_mask, scale=scale)
        q, k, v = self._checked_bhsd(query, key, value, attn_mask)
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

    @classmethod
    def kernel(cls, q, k, v, attn_mask, scale):
        if attn_mask is not None:  # SDPA converts and aligns the mask for this kernel
            with sdpa_kernel(cls.backends):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, False, 0.0, False, scale=scale
        )[0]
