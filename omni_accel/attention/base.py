"""The provider contract: what an attention kernel declares, and the request it is checked against.

Layout everywhere in omni_accel: ``q, k, v`` are ``[batch, seq, heads, head_dim]`` ("BSHD", the layout the
projections produce without a transpose); the output has the query's shape; the log-sum-exp, when asked for,
is ``[batch, heads, seq_q]`` in float32 (natural log).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


class AttentionProviderError(ValueError):
    """An attention provider was asked for that does not exist or cannot serve a call; the message says
    why and what would."""


class KernelRefusal(AttentionProviderError):
    """Raised by ``AttentionProvider.forward``, before anything is launched, when the installed kernel
    refuses these exact tensors though the request passed the capabilities (see ``refusal``):
    ``AttentionSelector.attend`` then serves an automatic choice with the next provider. ``reason``: what
    ``refusal`` says."""

    def __init__(self, provider: str, reason: str) -> None:
        super().__init__(f"Attention provider {provider!r} cannot serve {reason}.")
        self.provider, self.reason = provider, reason

    def __reduce__(self):
        return KernelRefusal, (self.provider, self.reason)


@dataclass(frozen=True)
class AttentionRequest:
    """Everything about one attention call that decides which providers may serve it (hashable, so
    resolution is cached per distinct request and never repeated on the hot path)."""

    dtype: torch.dtype
    device_type: str
    head_dim: int
    has_mask: bool = False
    needs_lse: bool = False
    compute_capability: tuple[int, int] | None = None
    kv_len: int | None = None  # None: not known yet (planning before the first call)

    @classmethod
    def for_call(
        cls,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        *,
        has_mask: bool = False,
        needs_lse: bool = False,
    ) -> AttentionRequest:
        device = query.device
        capability = _compute_capability(device) if device.type == "cuda" else None
        kv_len = key.shape[1] if key is not None else None
        return cls(query.dtype, device.type, query.shape[-1], has_mask, needs_lse, capability, kv_len)

    def describe(self) -> str:
        parts = [str(self.dtype).removeprefix("torch."), self.device_type, f"head_dim={self.head_dim}"]
        if self.compute_capability:
            parts.append("sm{}{}".format(*self.compute_capability))
        if self.has_mask:
            parts.append("masked")
        if self.needs_lse:
            parts.append("lse")
        return ", ".join(parts)


_CAPABILITY_BY_INDEX: dict[int, tuple[int, int]] = {}


def _compute_capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY_BY_INDEX:
        _CAPABILITY_BY_INDEX[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY_BY_INDEX[index]


@dataclass(frozen=True)
class Capabilities:
    """What a provider can serve; selection enforces every field, so a flag nobody checks cannot exist."""

    dtypes: frozenset[torch.dtype]
    devices: frozenset[str]
    max_head_dim: int = 256
    head_dim_multiple: int = 1
    head_dims: tuple[int, ...] | None = None  # the exact sizes, for kernels instantiated per head size
    supports_mask: bool = False
    returns_lse: bool = False
    lossless: bool = True
    min_compute_capability: tuple[int, int] | None = None
    kv_len_multiple: int = 1

    def reasons_against(self, request: AttentionRequest) -> list[str]:
        """Why this capability set cannot serve ``request`` (empty when it can)."""
        reasons = []
        if request.device_type not in self.devices:
            reasons.append(f"runs on {sorted(self.devices)}, not {request.device_type}")
        if request.dtype not in self.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"takes {names}, not {str(request.dtype).removeprefix('torch.')}")
        if self.head_dims is not None:
            if request.head_dim not in self.head_dims:
                reasons.append(
                    f"takes head sizes {', '.join(map(str, self.head_dims))}, not {request.head_dim}"
                )
        elif request.head_dim > self.max_head_dim or request.head_dim % self.head_dim_multiple:
            reasons.append(
                f"takes head sizes up to {self.max_head_dim} in multiples of {self.head_dim_multiple}, "
                f"not {request.head_dim}"
            )
        if request.has_mask and not self.supports_mask:
            reasons.append("cannot apply an attention mask")
        if request.kv_len is not None and request.kv_len % self.kv_len_multiple:
            reasons.append(
                f"needs a key length that is a multiple of {self.kv_len_multiple}, not {request.kv_len}"
            )
        if request.needs_lse and not self.returns_lse:
            reasons.append("does not return the log-sum-exp")
        if (
            self.min_compute_capability
            and request.device_type == "cuda"
            and request.compute_capability is not None
            and request.compute_capability < self.min_compute_capability
        ):
            need, have = self.min_compute_capability, request.compute_capability
            reasons.append(
                f"needs compute capability >= {need[0]}.{need[1]}, this GPU has {have[0]}.{have[1]}"
            )
        return reasons


class AttentionProvider(abc.ABC):
    """One attention kernel behind a uniform call. Subclasses declare ``name`` and ``capabilities``."""

    name: str
    capabilities: Capabilities

    def unavailable_reason(self) -> str | None:
        """Why the provider cannot run in this process at all (a missing package...), or None."""
        return None

    def kernel_ready(self, request: AttentionRequest) -> bool:
        """Whether the kernel serving ``request`` is built in this process. A provider that compiles its
        kernels on first use says False while one builds in the background, so ``auto`` lets the next
        provider serve meanwhile (``kernel_builds``)."""
        return True

    def reasons_against(self, request: AttentionRequest) -> list[str]:
        missing = self.unavailable_reason()
        return ([missing] if missing else []) + self.capabilities.reasons_against(request)

    def refusal(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> str | None:
        """Why the installed kernel would refuse these exact tensors although the request passed
        ``reasons_against`` (limits no request can tell: lengths, strides, process-wide switches such as
        deterministic algorithms), or None. A provider with such limits also checks them in ``forward``,
        where the call's own layout is at hand, and raises ``KernelRefusal`` with this message; one whose
        kernel takes whatever its capabilities admit keeps this default."""
        return None

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention over BSHD tensors; returns the output, or ``(output, lse)`` when ``return_lse``. Raises
        ``KernelRefusal`` (launching nothing) where ``refusal`` would give a reason."""


def bshd_attention_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake (meta) implementation of every provider custom op of the signature ``(query, key, value,
    scale, return_lse) -> (out, lse)``: the output like the query, the LSE ``[B, H, S]`` float32 or empty."""
    batch, seq_q, heads, _ = query.shape
    lse_shape = (batch, heads, seq_q) if return_lse else (0,)
    return query.new_empty(query.shape), query.new_empty(lse_shape, dtype=torch.float32)
