"""FlashInfer's ragged batch prefill (flashinfer-python 0.6.x) behind the provider contract.

A batch of B sequences runs as one ragged batch: q/k/v are flattened to ``[B*S, H, D]`` and described by
indptr arrays ``[0, S, 2S, ...]``, so a CFG pair or several prompts cost one kernel launch, not B. FlashInfer
schedules work on the host in ``plan`` (and JIT-compiles a kernel the first time a configuration is planned),
so a wrapper is planned once per problem shape and kept; the hot path only calls ``run``.

``flashinfer`` is imported lazily: importing omni_accel never needs it, and ``unavailable_reason`` says how to
install it. The kernel call is the custom op ``omni_accel::flashinfer_attention`` so torch.compile traces
through it (its fake implementation gives the shapes) instead of breaking the graph on the wrapper objects.
Inference only: no backward is registered.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ... import kernel_builds
from ...utils.logging import get_logger
from ..base import AttentionProvider, AttentionRequest, Capabilities, bshd_attention_fake

logger = get_logger(__name__)

SUPPORTED_VERSIONS = SpecifierSet(">=0.6.1,<0.7")
INSTALL_HINT = "pip install 'omni-accel[flashinfer]' (flashinfer-python==0.6.1)"
# The head sizes FlashInfer's prefill kernels are instantiated for (the sm90 kernels static_assert these).
HEAD_DIMS = (64, 128, 256)

_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k scratch size
# A planned wrapper holds 8 MiB of device and 8 MiB of pinned host memory; a server that sees many
# resolutions should not keep one per shape forever, so the oldest plans are dropped past this count.
_MAX_PLANS = 32
_LN2 = math.log(2.0)

_WORKSPACES: dict[torch.device, torch.Tensor] = {}
_PLANS: dict[tuple, object] = {}


def installed_version(module: object) -> Version | None:
    """The flashinfer-python distribution's version, else the module's ``__version__`` (source builds)."""
    try:
        text = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        text = getattr(module, "__version__", None)
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def version_problem(version: Version | None) -> str | None:
    """Why this flashinfer version is refused: the wrapper API is only verified for 0.6.x."""
    if version is not None and SUPPORTED_VERSIONS.contains(version, prereleases=True):
        return None
    found = f"flashinfer-python {version}" if version else "a flashinfer of unknown version"
    return f"{found} is installed; omni_accel supports {SUPPORTED_VERSIONS}: {INSTALL_HINT}"


@functools.cache
def _unavailable() -> str | None:
    try:
        import flashinfer
    except ImportError as exc:
        return f"the flashinfer package could not be imported ({exc}); install it with {INSTALL_HINT}"
    except Exception as exc:  # a CUDA/toolkit mismatch surfaces as other errors at import
        return f"flashinfer failed to import ({type(exc).__name__}: {exc}); reinstall with {INSTALL_HINT}"
    return version_problem(installed_version(flashinfer))


def ragged_indptr(batch: int, seq: int) -> torch.Tensor:
    """Row offsets of each sequence in the flattened ``[batch*seq, ...]`` tensor; on the CPU because
    ``plan`` reads them on the host anyway (a device tensor would cost a synchronising copy)."""
    return torch.arange(batch + 1, dtype=torch.int32) * seq


def natural_lse(lse_log2: torch.Tensor, batch: int) -> torch.Tensor:
    """FlashInfer's ``[B*S, H]`` base-2 LSE as the contract's ``[B, H, S]`` natural log."""
    rows, heads = lse_log2.shape
    return lse_log2.view(batch, rows // batch, heads).transpose(1, 2).mul(_LN2).contiguous()


def _backend(device: torch.device) -> str:
    # fa3 is FlashInfer's Hopper kernel; elsewhere FlashInfer knows best (fa2 on Ampere/Ada/Blackwell).
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "auto"


def _new_wrapper(workspace: torch.Tensor, device: torch.device):
    import flashinfer

    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        workspace, kv_layout="NHD", backend=_backend(device)
    )


def _jit_kernel(head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """JIT-compiles (or loads from the disk cache) the module ``_build_kernel``'s plan then finds built: the
    arguments ``plan`` passes FlashInfer's module cache for our calls (no positional encoding, sliding
    window, soft cap or fp16 reduction; int32 indptr). Host work alone (nvcc, a library load), so it runs
    holding nothing, and the plan after it takes milliseconds. These are FlashInfer internals: where they
    moved (another 0.6.x), the plan compiles the kernel itself, as it always can, holding captures off."""
    try:
        from flashinfer.prefill import get_batch_prefill_module
        from flashinfer.utils import PosEncodingMode, determine_attention_backend

        no_rope = PosEncodingMode.NONE.value
        backend = _backend(device)
        if backend == "auto":
            backend = determine_attention_backend(device, no_rope, False, False, dtype, dtype)
        with torch.cuda.device(device):  # the JIT targets the current device's architecture
            get_batch_prefill_module(
                backend, dtype, dtype, dtype, torch.int32, head_dim, head_dim, no_rope, False, False, False
            )
    except (ImportError, AttributeError, TypeError) as exc:  # not a compile error: those fail the build
        logger.warning(
            "flashinfer: its kernel cannot be compiled ahead of its plan here (%s: %s); the plan compiles it, "
            "and CUDA graph captures and compiles wait for it meanwhile",
            type(exc).__name__,
            exc,
        )


def _build_kernel(
    head_dim: int, dtype: torch.dtype, device: torch.device, data_type: torch.dtype | None = None
) -> None:
    """JIT-compiles (or loads from the disk cache) the kernel every plan of ``head_dim`` and the dtypes runs
    (``data_type``: what q/k/v are fed in, ``dtype`` by default; the output is ``dtype``): a plan of a tiny
    problem builds the same module, keyed by head size and dtypes, not by heads or tokens."""
    data_type = dtype if data_type is None else data_type
    with torch.cuda.device(device):
        workspace = torch.empty(16 * 1024 * 1024, dtype=torch.uint8, device=device)
        indptr = ragged_indptr(1, 128)
        _new_wrapper(workspace, device).plan(
            indptr,
            indptr,
            1,
            1,
            head_dim,
            causal=False,
            q_data_type=data_type,
            kv_data_type=data_type,
            o_data_type=dtype,
        )


def _planned_wrapper(
    batch: int,
    seq_q: int,
    seq_kv: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    scale: float,
    data_type: torch.dtype | None = None,
):
    """A wrapper planned for these shapes, output ``dtype`` and q/k/v fed in ``data_type`` (``dtype`` by
    default; float8 for ``flashinfer_fp8``)."""
    data_type = dtype if data_type is None else data_type
    # The scale is part of the plan: ``run`` uses the sm_scale given to ``plan``.
    key = (batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, device, scale, data_type)
    wrapper = _PLANS.get(key)
    if wrapper is not None:
        return wrapper
    workspace = _WORKSPACES.get(device)
    if workspace is None:
        workspace = _WORKSPACES[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = _new_wrapper(workspace, device)
    # The first plan of a process is said at WARNING (shown by default): it may JIT-compile for a minute.
    log = logger.info if _PLANS else logger.warning
    log(
        "flashinfer: planning %s heads x %s, %s x %s tokens (the first plan of a kernel on a machine "
        "JIT-compiles it: about a minute, cached on disk afterwards)",
        heads,
        head_dim,
        seq_q,
        seq_kv,
    )
    wrapper.plan(
        ragged_indptr(batch, seq_q),
        ragged_indptr(batch, seq_kv),
        heads,
        kv_heads,
        head_dim,
        causal=False,
        sm_scale=scale,
        q_data_type=data_type,
        kv_data_type=data_type,
        o_data_type=dtype,
    )
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = wrapper
    return wrapper


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` -> ``[B*S, H, D]``; FlashInfer takes any row/head strides but a unit last stride."""
    rows = tensor.reshape(-1, tensor.shape[2], tensor.shape[3])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@torch.library.custom_op("omni_accel::flashinfer_attention", mutates_args=(), device_types="cuda")
def flashinfer_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """BSHD attention as one ragged FlashInfer launch; the LSE is ``[B, H, S]`` natural log, or empty."""
    batch, seq_q, heads, head_dim = query.shape
    seq_kv, kv_heads = key.shape[1], key.shape[2]
    with torch.cuda.device(query.device):
        wrapper = _planned_wrapper(
            batch, seq_q, seq_kv, heads, kv_heads, head_dim, query.dtype, query.device, scale
        )
        result = wrapper.run(_rows(query), _rows(key), _rows(value), return_lse=return_lse)
    if return_lse:
        out, lse = result
        return out.view(query.shape), natural_lse(lse, batch)
    return result.view(query.shape), query.new_empty(0, dtype=torch.float32)


flashinfer_attention.register_fake(bshd_attention_fake)


class FlashInferProvider(AttentionProvider):
    """FlashInfer ragged batch prefill: lossless, one launch per batch, returns the LSE. ``auto`` picks it
    where it beats cuDNN (long sequences, head size 64: ``registry``), once its kernel is built
    (``kernel_ready``); anywhere else it is an explicit choice."""

    name = "flashinfer"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        head_dims=HEAD_DIMS,
        returns_lse=True,
        min_compute_capability=(8, 0),
    )

    def unavailable_reason(self) -> str | None:
        return _unavailable()

    def kernel_ready(self, request: AttentionRequest) -> bool:
        """Whether the kernel ``request`` runs is built in this process; if not, its build starts in the
        background (``kernel_builds``): an explicit choice plans, and so builds, at its first call instead."""
        device = torch.device("cuda", torch.cuda.current_device())
        key = ("flashinfer", request.head_dim, request.dtype, torch.cuda.get_device_capability(device))
        what = f"flashinfer's kernel for head size {request.head_dim} in {str(request.dtype).removeprefix('torch.')}"
        return kernel_builds.ready(
            key,
            lambda: _build_kernel(request.head_dim, request.dtype, device),
            what,
            jit=lambda: _jit_kernel(request.head_dim, request.dtype, device),
        )

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        if attn_mask is not None:
            raise ValueError("The flashinfer provider cannot apply an attention mask; choose one that can.")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = flashinfer_attention(query, key, value, scale, return_lse)
        return (out, lse) if return_lse else out
