"""Every SDPA provider, and "auto", over the dtypes, head sizes, lengths, batches and layouts that Diffusers'
tiny test models and real ones produce, on the GPU: each call serves with the math kernel's result, or (an
explicit choice only) raises our AttentionProviderError naming why; never PyTorch's "No available kernel".

Needs only torch: on a machine without Diffusers the package's top level (which imports it) can be skipped
by pre-registering ``omni_accel`` as a bare package; the attention subpackage does not import Diffusers.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.backends.cuda as cuda_backends

from omni_accel.attention.base import AttentionProviderError
from omni_accel.attention.selection import AttentionConfig, AttentionSelector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHOICES = ("auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (8, 16, 24, 64, 72, 128, 256)
LENGTHS = (1, 7, 64, 333)
BATCHES = (1, 2)
LAYOUTS = ("bshd", "packed", "transposed")
HEADS = 2
# Relative to the reference's largest magnitude: one rounding of the output in the input's precision, and
# some for the kernels' own accumulation order.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _inputs(layout: str, batch: int, length: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as ``[B, S, H, D]``: contiguous ("bshd"), views of one packed QKV projection ("packed", what
    native blocks and fused projections hand over), or contiguous ``[B, H, S, D]`` transposed ("transposed",
    what SDPA-layout processors hold)."""
    g = torch.Generator("cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    if layout == "bshd":
        return [randn(batch, length, HEADS, head_dim) for _ in range(3)]
    if layout == "packed":
        return list(randn(batch, length, 3 * HEADS * head_dim).unflatten(-1, (3, HEADS, head_dim)).unbind(2))
    return [randn(batch, HEADS, length, head_dim).transpose(1, 2) for _ in range(3)]


def _reference(q, k, v, mask=None):
    """The math kernel in float32 (what ``sdpa_math`` runs, upcast)."""
    selector = AttentionSelector(AttentionConfig(default="sdpa_math"))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    return selector.attend("reference", "self", q.float(), k.float(), v.float(), attn_mask=mask)


def _serve(selector, q, k, v, dtype, expected, mask=None, return_lse=False):
    """None when the call served right or raised our error (an explicit choice); else what went wrong."""
    try:
        out = selector.attend("r", "self", q, k, v, attn_mask=mask, return_lse=return_lse)
    except AttentionProviderError as exc:
        return None if selector.config.default != "auto" else f"auto raised: {exc}"
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    if return_lse:
        out, lse = out
        if lse.shape != (q.shape[0], q.shape[2], q.shape[1]):
            return f"lse shape {tuple(lse.shape)}"
    err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    return None if err <= TOLERANCE[dtype] else f"relative error {err:.2e}"


def test_every_provider_serves_or_refuses_clearly():
    selectors = {choice: AttentionSelector(AttentionConfig(default=choice)) for choice in CHOICES}
    failures, served = [], dict.fromkeys(CHOICES, 0)
    for dtype, head_dim, length, batch, layout in itertools.product(
        DTYPES, HEAD_DIMS, LENGTHS, BATCHES, LAYOUTS
    ):
        q, k, v = _inputs(layout, batch, length, head_dim, dtype)
        expected = _reference(q, k, v)
        for choice, selector in selectors.items():
            problem = _serve(selector, q, k, v, dtype, expected)
            if problem:
                failures.append((choice, str(dtype)[6:], head_dim, length, batch, layout, problem))
            served[choice] += problem is None
    assert not failures, f"{len(failures)} calls went wrong, e.g. {failures[:10]}"
    # Each pinned kernel served what its PyTorch check admits (the check is not refusing everything).
    assert all(served.values())
    # Where cuDNN refuses a length-1 call (torch 2.11, cuDNN 9.19 on an H200 did), auto recorded why.
    if not _cudnn_takes(*_inputs("bshd", 1, 1, 64, torch.bfloat16)):
        reasons = [reason for *_, reason in selectors["auto"].decisions() if "sdpa_cudnn refused" in reason]
        assert reasons, selectors["auto"].decisions()


def _cudnn_takes(q, k, v) -> bool:
    params = cuda_backends.SDPAParams(*(t.transpose(1, 2) for t in (q, k, v)), None, 0.0, False, False)
    return cuda_backends.can_use_cudnn_attention(params)


def test_masked_calls_serve_or_refuse_clearly():
    failures = []
    selectors = {choice: AttentionSelector(AttentionConfig(default=choice)) for choice in CHOICES}
    for dtype, head_dim, length, batch, kind in itertools.product(
        DTYPES, (16, 72, 128), (7, 333), BATCHES, ("bool", "float")
    ):
        q, k, v = _inputs("bshd", batch, length, head_dim, dtype)
        keys = torch.ones(batch, 1, 1, length, dtype=torch.bool, device="cuda")
        keys[-1, ..., length // 2 :] = False
        mask = (
            keys
            if kind == "bool"
            else torch.zeros(keys.shape, dtype=dtype, device="cuda").masked_fill(~keys, float("-inf"))
        )
        expected = _reference(q, k, v, mask)
        for choice, selector in selectors.items():
            problem = _serve(selector, q, k, v, dtype, expected, mask=mask)
            if problem:
                failures.append((choice, str(dtype)[6:], head_dim, length, batch, kind, problem))
    assert not failures, f"{len(failures)} calls went wrong, e.g. {failures[:10]}"


def test_lse_calls_serve_or_refuse_clearly():
    """Ring attention asks for the log-sum-exp: cuDNN's and flash's LSE paths call their aten ops directly,
    which check nothing themselves."""
    failures = []
    selectors = {
        choice: AttentionSelector(AttentionConfig(default=choice))
        for choice in ("auto", "sdpa_cudnn", "sdpa_flash", "sdpa_math")
    }
    for dtype, head_dim, length, layout in itertools.product(DTYPES, (16, 64, 128), LENGTHS, LAYOUTS):
        q, k, v = _inputs(layout, 2, length, head_dim, dtype)
        expected = _reference(q, k, v)
        for choice, selector in selectors.items():
            problem = _serve(selector, q, k, v, dtype, expected, return_lse=True)
            if problem:
                failures.append((choice, str(dtype)[6:], head_dim, length, layout, problem))
    assert not failures, f"{len(failures)} calls went wrong, e.g. {failures[:10]}"


def test_deterministic_algorithms_never_reach_a_kernel_that_refuses_them():
    """Diffusers' tests turn deterministic algorithms on (``enable_full_determinism``); PyTorch's cuDNN
    attention may then refuse every call: auto serves with the next kernel, an explicit cuDNN raises ours."""
    q, k, v = _inputs("bshd", 2, 64, 64, torch.bfloat16)
    expected = _reference(q, k, v)
    auto = AttentionSelector()
    cudnn = AttentionSelector(AttentionConfig(default="sdpa_cudnn"))
    torch.use_deterministic_algorithms(True)
    try:
        refused = not _cudnn_takes(q, k, v)
        assert _serve(auto, q, k, v, torch.bfloat16, expected) is None
        if refused:
            with pytest.raises(AttentionProviderError, match="deterministic algorithms are on"):
                cudnn.attend("r", "self", q, k, v)
        else:
            assert _serve(cudnn, q, k, v, torch.bfloat16, expected) is None
    finally:
        torch.use_deterministic_algorithms(False)
    ((_, _, provider, reason),) = auto.decisions()
    print(f"deterministic: cuDNN refused={refused}; auto -> {provider} ({reason})")
    assert (provider != "sdpa_cudnn") == refused
