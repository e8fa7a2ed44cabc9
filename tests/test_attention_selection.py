"""Provider resolution order, scoping, capability enforcement and the errors users see."""

import pytest
import torch

import omni_accel
from omni_accel.attention import (
    AttentionConfig,
    AttentionProviderError,
    AttentionRequest,
    AttentionSelector,
    attention_scope,
    get_provider,
    provider_names,
    resolve,
)
from omni_accel.attention.selection import current_scope

CPU_FP32 = AttentionRequest(torch.float32, "cpu", 64)
H200_BF16 = AttentionRequest(torch.bfloat16, "cuda", 128, compute_capability=(9, 0))


def test_auto_on_cpu_is_sdpa():
    found = resolve(AttentionConfig(), "flux.joint", "self", CPU_FP32)
    assert found.name == "sdpa" and "auto" in found.reason


def test_auto_on_hopper_prefers_cudnn():
    assert resolve(AttentionConfig(), "flux.joint", "self", H200_BF16).name == "sdpa_cudnn"


def test_auto_falls_back_and_records_why():
    head_dim_256 = AttentionRequest(torch.bfloat16, "cuda", 256, compute_capability=(9, 0))
    found = resolve(AttentionConfig(), "x", "self", head_dim_256)
    assert found.name == "sdpa_flash"
    assert "skipped sdpa_cudnn (takes head sizes up to 128" in found.reason


def test_auto_gives_long_sequences_to_flashinfer_where_installed(monkeypatch):
    """Wan's 32760 tokens: FlashInfer's fa3 measured 14 % faster than cuDNN on an H200; FLUX's 4608 a tie."""
    wan = AttentionRequest(torch.bfloat16, "cuda", 128, compute_capability=(9, 0), kv_len=32760)
    flux = AttentionRequest(torch.bfloat16, "cuda", 128, compute_capability=(9, 0), kv_len=4608)
    masked = AttentionRequest(
        torch.bfloat16, "cuda", 128, has_mask=True, compute_capability=(9, 0), kv_len=32760
    )
    flashinfer = get_provider("flashinfer")
    monkeypatch.setattr(flashinfer, "unavailable_reason", lambda: "not installed")
    found = resolve(AttentionConfig(), "wan.self", "self", wan)
    assert found.name == "sdpa_cudnn" and "skipped" not in found.reason  # absent: no noise about it
    monkeypatch.setattr(flashinfer, "unavailable_reason", lambda: None)
    monkeypatch.setattr(flashinfer, "kernel_ready", lambda request: True)  # tests/test_kernel_builds.py
    assert resolve(AttentionConfig(), "wan.self", "self", wan).name == "flashinfer"
    assert resolve(AttentionConfig(), "flux.joint", "self", flux).name == "sdpa_cudnn"
    assert resolve(AttentionConfig(), "wan.self", "self", masked).name == "sdpa"


def test_auto_gives_masked_calls_to_pytorchs_own_dispatch():
    """What plain Diffusers runs for the same mask: never slower than Diffusers, the same kernel (cuDNN
    given the mask measured slower in the compiled Qwen-Image forward); cuDNN takes masks when chosen."""
    masked = AttentionRequest(torch.bfloat16, "cuda", 128, has_mask=True, compute_capability=(9, 0))
    found = resolve(AttentionConfig(), "x", "self", masked)
    assert found.name == "sdpa" and "sdpa_cudnn" in found.fallbacks


def test_auto_never_picks_a_lossy_provider():
    for request in (CPU_FP32, H200_BF16):
        assert get_provider(resolve(AttentionConfig(), "r", "self", request).name).capabilities.lossless


def test_resolution_order_role_then_category_then_default():
    config = AttentionConfig(default="sdpa_math", per_role={"flux.joint": "sdpa", "cross": "sdpa_math"})
    assert resolve(config, "flux.joint", "self", CPU_FP32).reason == "per_role['flux.joint'] = 'sdpa'"
    assert resolve(config, "wan.cross", "cross", CPU_FP32).reason == "per_role['cross'] = 'sdpa_math'"
    assert resolve(config, "flux.single", "self", CPU_FP32).reason == "default = 'sdpa_math'"


def test_per_role_auto_overrides_an_explicit_default():
    config = AttentionConfig(default="sdpa_math", per_role={"flux.joint": "auto"})
    assert resolve(config, "flux.joint", "self", CPU_FP32).name == "sdpa"


@pytest.mark.parametrize(
    "name, request_, words",
    [
        ("sdpa_cudnn", CPU_FP32, ["runs on ['cuda'], not cpu", "float32"]),
        ("sdpa_flash", AttentionRequest(torch.bfloat16, "cuda", 512, compute_capability=(9, 0)), ["512"]),
        (
            "sdpa_flash",
            AttentionRequest(torch.float16, "cuda", 64, has_mask=True, compute_capability=(9, 0)),
            ["mask"],
        ),
        (
            "sdpa_cudnn",
            AttentionRequest(torch.float16, "cuda", 64, compute_capability=(7, 5)),
            ["8.0", "7.5"],
        ),
        ("sdpa", AttentionRequest(torch.float32, "cpu", 64, needs_lse=True), ["log-sum-exp"]),
    ],
)
def test_explicit_provider_that_cannot_serve_raises_with_reasons(name, request_, words):
    with pytest.raises(AttentionProviderError) as info:
        resolve(AttentionConfig(per_role={"self": name}), "flux.joint", "self", request_)
    message = str(info.value)
    assert f"'{name}'" in message and "per_role['self']" in message
    for word in words:
        assert word in message


def test_unknown_provider_name_lists_valid_names():
    with pytest.raises(ValueError, match="Valid names: 'auto', 'flashinfer'"):
        AttentionConfig(default="flash3")
    with pytest.raises(ValueError, match=r"per_role\['flux.joint'\]"):
        AttentionConfig(per_role={"flux.joint": "nope"})


def test_every_registered_provider_imports_and_declares_capabilities():
    for name in provider_names():
        provider = get_provider(name)
        assert provider.name == name
        assert provider.capabilities.dtypes and provider.capabilities.devices


def test_scope_overrides_the_pipeline_choice_and_is_restored():
    selector = AttentionSelector(AttentionConfig(default="sdpa"))
    assert selector.resolve("r", "self", CPU_FP32).name == "sdpa"
    with attention_scope(default="sdpa_math"):
        assert selector.resolve("r", "self", CPU_FP32).name == "sdpa_math"
        with attention_scope(per_role={"r": "sdpa"}):
            assert selector.resolve("r", "self", CPU_FP32).name == "sdpa"
        assert selector.resolve("r", "self", CPU_FP32).name == "sdpa_math"
    assert selector.resolve("r", "self", CPU_FP32).name == "sdpa"


def test_scope_of_a_provider_name_says_where_it_goes():
    """attention_scope("sdpa_math") was taken, and every call in the block then failed with "'str' object has
    no attribute 'per_role'"."""
    with pytest.raises(
        TypeError, match=r"must be an AttentionConfig, got str .*attention_scope\(default='sdpa_math'\)"
    ):
        attention_scope("sdpa_math").__enter__()
    with pytest.raises(TypeError, match=r"must be an AttentionConfig, got dict"):
        attention_scope({"default": "sdpa"}).__enter__()
    assert current_scope() is None


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"default": ""}, "Unknown attention provider ''"),
        ({"per_role": []}, "per_role must map role or category names"),
        ({"per_role": ""}, "per_role must map role or category names"),
    ],
)
def test_scope_checks_falsy_options_as_given(options, error):
    """attention_scope(default="") ran "auto" and per_role=[] nothing, silently: a falsy value was taken for
    an option not given."""
    with pytest.raises((TypeError, ValueError), match=error):
        attention_scope(**options).__enter__()
    assert current_scope() is None


def test_scope_is_restored_after_an_exception():
    selector = AttentionSelector()
    with pytest.raises(RuntimeError), attention_scope(default="sdpa_math"):
        raise RuntimeError("boom")
    assert selector.resolve("r", "self", CPU_FP32).name == "sdpa"


def test_scope_does_not_leak_between_pipelines():
    """Two pipelines with different configs in one process: each keeps its own choice."""
    a = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), attention="sdpa_math")
    b = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    for pipe in (a, b):
        pipe("x", height=32, width=32, num_inference_steps=1, output_type="latent")
    assert {row[2] for row in omni_accel.describe(a).components[0].selector.decisions()} == {"sdpa_math"}
    assert {row[2] for row in omni_accel.describe(b).components[0].selector.decisions()} == {"sdpa"}


def test_math_provider_lse_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 16, generator=g) for _ in range(3))
    out, lse = get_provider("sdpa_math").forward(q, k, v, return_lse=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-5)
    assert torch.allclose(out, get_provider("sdpa").forward(q, k, v), atol=1e-5)


@pytest.mark.parametrize("name", ["sdpa", "sdpa_math"])
def test_masked_providers_apply_the_mask(name):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 3:] = False
    masked = get_provider(name).forward(q, k, v, attn_mask=mask)
    truncated = get_provider(name).forward(q, k[:, :3], v[:, :3])
    assert torch.allclose(masked, truncated, atol=1e-6)
