"""Every registered attention provider on a real GPU, against fp64 attention computed from the same bf16 inputs.

Skipped without CUDA; a provider whose package is missing (or that cannot serve bf16, head size 128 on this
GPU) is skipped with its own reason. FlashInfer JIT-compiles each kernel configuration on first use, so its
first tests take tens of seconds.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from omni_accel.attention.base import AttentionProvider, AttentionRequest
from omni_accel.attention.registry import get_provider, provider_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BATCH, HEADS, HEAD_DIM = 2, 24, 128
DTYPE = torch.bfloat16
# (seq_q, seq_kv): FLUX.1 at 1024x1024 (4096 image + 512 text tokens), a smaller square, an odd length that
# leaves every kernel a partial tile, and cross-attention.
SHAPES = [(4608, 4608), (1024, 1024), (333, 333), (1024, 333)]
CUSTOM_OPS = {
    "flashinfer": "flashinfer_attention",
    "flashinfer_fp8": "flashinfer_fp8_attention",
    "sage": "sage_attention",
}
# Same computation, different launch (batched vs alone, strided vs dense, compiled vs eager): at most a
# couple of bf16 ulps apart.
SAME = {"atol": 2e-3, "rtol": 2e-2}


def _request(*, needs_lse: bool = False, kv_len: int | None = None) -> AttentionRequest:
    capability = torch.cuda.get_device_capability()
    return AttentionRequest(
        DTYPE, "cuda", HEAD_DIM, needs_lse=needs_lse, compute_capability=capability, kv_len=kv_len
    )


def _usable(name: str, *, needs_lse: bool = False, kv_len: int | None = None) -> AttentionProvider:
    provider = get_provider(name)
    reasons = provider.reasons_against(_request(needs_lse=needs_lse, kv_len=kv_len))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    return provider


@functools.cache
def _inputs(seq_q: int, seq_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seq_q * 10007 + seq_kv)

    def sample(seq: int) -> torch.Tensor:
        return torch.randn(BATCH, seq, HEADS, HEAD_DIM, generator=generator, device="cuda", dtype=DTYPE)

    return sample(seq_q), sample(seq_kv), sample(seq_kv)


@functools.cache
def _reference(seq_q: int, seq_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 output (BSHD) and natural-log LSE (BHS), one batch element at a time to bound memory."""
    query, key, value = _inputs(seq_q, seq_kv)
    outs, lses = [], []
    for q, k, v in zip(query, key, value, strict=True):
        q, k, v = (t.transpose(0, 1).double() for t in (q, k, v))
        scores = q @ k.transpose(1, 2) * HEAD_DIM**-0.5
        lse = torch.logsumexp(scores, dim=-1)
        outs.append((torch.exp(scores - lse[..., None]) @ v).transpose(0, 1))
        lses.append(lse)
        del scores
    return torch.stack(outs), torch.stack(lses)


def _max_abs_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return (out.double() - reference).abs().max().item()


@functools.cache
def _flash_error(seq_q: int, seq_kv: int) -> float:
    """What PyTorch's flash kernel itself is off by here: the yardstick for every lossless provider."""
    flash = get_provider("sdpa_flash")
    if flash.reasons_against(_request()):
        return 2e-3
    query, key, value = _inputs(seq_q, seq_kv)
    return _max_abs_error(flash.forward(query, key, value), _reference(seq_q, seq_kv)[0])


@pytest.mark.parametrize("seq_q, seq_kv", SHAPES)
@pytest.mark.parametrize("name", provider_names())
def test_output_matches_fp64_reference(name, seq_q, seq_kv):
    provider = _usable(name, kv_len=seq_kv)
    query, key, value = _inputs(seq_q, seq_kv)
    out = provider.forward(query, key, value)
    assert out.shape == query.shape and out.dtype == DTYPE
    assert torch.isfinite(out).all()
    reference = _reference(seq_q, seq_kv)[0]
    if provider.capabilities.lossless:
        error, flash = _max_abs_error(out, reference), _flash_error(seq_q, seq_kv)
        assert error <= 2 * flash + 1e-3, f"max abs error {error:.2e}; sdpa_flash's is {flash:.2e}"
    else:
        cosine = F.cosine_similarity(out.double().flatten(), reference.flatten(), dim=0).item()
        assert cosine > 0.99, f"cosine similarity {cosine:.5f}"
        # Quantisation noise is unbiased; a kernel whose softmax weights do not sum to one (keys beyond
        # the sequence counted as zeros, say) shrinks every row while keeping the cosine near 1.
        norm_ratio = (out.double().norm() / reference.norm()).item()
        assert 0.97 < norm_ratio < 1.03, f"output norm / reference norm = {norm_ratio:.4f}"


@pytest.mark.parametrize("seq_q, seq_kv", [(333, 333), (1024, 333)])
@pytest.mark.parametrize("name", provider_names())
def test_batch_equals_each_sequence_alone(name, seq_q, seq_kv):
    provider = _usable(name, kv_len=seq_kv)
    query, key, value = _inputs(seq_q, seq_kv)
    batched = provider.forward(query, key, value)
    for b in range(BATCH):
        alone = provider.forward(query[b : b + 1], key[b : b + 1], value[b : b + 1])
        torch.testing.assert_close(batched[b : b + 1], alone, **SAME, msg=f"batch element {b}")


@pytest.mark.parametrize("seq_q, seq_kv", SHAPES)
@pytest.mark.parametrize("name", provider_names())
def test_lse_matches_fp64_reference(name, seq_q, seq_kv):
    provider = _usable(name, needs_lse=True, kv_len=seq_kv)
    query, key, value = _inputs(seq_q, seq_kv)
    out, lse = provider.forward(query, key, value, return_lse=True)
    assert lse.shape == (BATCH, HEADS, seq_q) and lse.dtype == torch.float32
    # A base-2 LSE would be off by ~0.3 * lse (about 2.5 here); an unscaled one by far more.
    tolerance = 1e-2 if provider.capabilities.lossless else 0.1
    error = _max_abs_error(lse, _reference(seq_q, seq_kv)[1])
    assert error <= tolerance, f"max abs LSE error {error:.3e}"
    torch.testing.assert_close(out, provider.forward(query, key, value), **SAME)


@pytest.mark.parametrize("name", provider_names())
def test_strided_inputs_match_dense_ones(name):
    """q/k/v as views of one fused projection output, as attention processors usually receive them."""
    provider = _usable(name)
    query, key, value = _inputs(333, 333)
    fused = torch.stack((query, key, value), dim=2)  # [B, S, 3, H, D]
    strided = provider.forward(*fused.unbind(2))
    torch.testing.assert_close(strided, provider.forward(query, key, value), **SAME)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("name", sorted(CUSTOM_OPS))
def test_custom_op_passes_opcheck(name, return_lse):
    _usable(name, needs_lse=return_lse)
    op = getattr(torch.ops.omni_accel, CUSTOM_OPS[name]).default
    query, key, value = (torch.randn(2, 256, 4, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(3))
    torch.library.opcheck(op, (query, key, value, HEAD_DIM**-0.5, return_lse))


@pytest.mark.parametrize("name", provider_names())
def test_fullgraph_compile_matches_eager(name):
    provider = _usable(name)
    with_lse = not provider.reasons_against(_request(needs_lse=True))

    def attend(query, key, value):
        if with_lse:
            out, lse = provider.forward(query, key, value, return_lse=True)
            return out * 2, lse + 1
        return provider.forward(query, key, value) * 2

    torch._dynamo.reset()
    query, key, value = _inputs(333, 333)
    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(query, key, value), attend(query, key, value), **SAME)


def test_flashinfer_plans_once_per_shape():
    from omni_accel.attention.providers import flashinfer as flashinfer_module

    provider = _usable("flashinfer")
    query, key, value = (t[:, :517] for t in _inputs(1024, 1024))  # a shape no other test uses
    provider.forward(query, key, value)
    planned = dict(flashinfer_module._PLANS)
    provider.forward(query, key, value, return_lse=True)
    provider.forward(query, key, value)
    assert flashinfer_module._PLANS.keys() == planned.keys()
    assert all(flashinfer_module._PLANS[shape] is plan for shape, plan in planned.items())


def test_auto_serves_with_cudnn_while_flashinfers_kernel_builds_then_switches():
    """SD3.5-large's self-attention (38 heads of 64 over 4429 tokens): FlashInfer's kernel for head size
    64, built in the background, is what ``auto`` picks there; until it is built, cuDNN serves."""
    from omni_accel import kernel_builds
    from omni_accel.attention.selection import AttentionSelector

    flashinfer = get_provider("flashinfer")
    if flashinfer.unavailable_reason() is not None:
        pytest.skip(flashinfer.unavailable_reason())
    from flashinfer.prefill import get_batch_prefill_module

    modules_before = get_batch_prefill_module.cache_info()
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4429, 38, 64, generator=generator, device="cuda", dtype=DTYPE) for _ in "qkv")
    selector = AttentionSelector()
    first = selector.attend("sd3.joint", "self", q, k, v)
    kernel_builds.wait(600)
    later = selector.attend("sd3.joint", "self", q, k, v)
    assert selector.resolve("sd3.joint", "self", AttentionRequest.for_call(q, k)).name == "flashinfer"
    served = {name: reason for _, _, name, reason in selector.decisions()}
    if "sdpa_cudnn" in served:  # unless an earlier test built the kernel in this process (then no wait)
        assert "flashinfer waits for its kernel" in served["sdpa_cudnn"], served
        # the JIT (holding nothing) built the very module the plan (holding the lock) then found
        assert get_batch_prefill_module.cache_info().misses == modules_before.misses + 1
    torch.testing.assert_close(later, first, **SAME)
