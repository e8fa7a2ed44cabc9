"""Diffusers' own pipeline tests' steps, on the GPU, with every pipeline accelerated right after it is
built (as a zero-code user gets it): half precision, save/load in float16, layerwise casting, an
IP-Adapter with replayed steps, gradients and torchao-quantized transformers, each against plain Diffusers
doing the same steps. (The CPU analogues are in test_native_correctness.py and the routed/quantized tests.)
"""

import contextlib
import copy
import os

import pytest
import torch
from conftest import random_ip_adapter_state, rel_err

import omni_accel

pytestmark = pytest.mark.gpu

_BUILDERS = {
    "flux": omni_accel.tiny_flux_pipeline,
    "flux2": omni_accel.tiny_flux2_klein_pipeline,
    "qwenimage": omni_accel.tiny_qwenimage_pipeline,
    "sd3": omni_accel.tiny_sd3_pipeline,
    "wan": omni_accel.tiny_wan_pipeline,
    "zimage": omni_accel.tiny_zimage_pipeline,
}
_HALF = [torch.float16, torch.bfloat16]


def _call(name: str, pipe, **kwargs):
    size = dict(height=32, width=32, **(dict(num_frames=5) if name == "wan" else {}))
    call = {"prompt": "a cat", "num_inference_steps": 2, "output_type": "pt", **size, **kwargs}
    call.setdefault("generator", torch.Generator("cpu").manual_seed(0))
    out = pipe(**call)
    return out.frames if name == "wan" else out.images


def _pair(name: str, dtype: torch.dtype):
    plain = _BUILDERS[name](dtype=dtype, device="cuda")
    fast = omni_accel.accelerate(_BUILDERS[name](dtype=dtype, device="cuda"))
    return plain, fast


@contextlib.contextmanager
def _full_determinism():
    """What Diffusers' tests switch on (``enable_full_determinism``): deterministic algorithms, under which
    cuDNN's attention refuses every call (the cause of their "No available kernel" when accelerated)."""
    saved = (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        if saved[1] is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[1]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", _HALF, ids=str)
@pytest.mark.parametrize("name", sorted(_BUILDERS))
@torch.no_grad()
def test_half_precision_inference_has_no_nan_and_matches_plain(name, dtype, deterministic):
    """``test_half_precision_inference_no_nan`` / ``test_float16_inference``: the accelerated pipeline runs
    (no "No available kernel", with Diffusers' test determinism too), gives no NaN, and matches plain
    Diffusers in the same dtype."""
    with _full_determinism() if deterministic else contextlib.nullcontext():
        _half_precision_matches_plain(name, dtype)


def _half_precision_matches_plain(name, dtype):
    plain, fast = _pair(name, dtype)
    expected, got = _call(name, plain), _call(name, fast)
    assert not torch.isnan(got).any()
    # Compiled blocks round in their own order: FLUX.2 Klein's random weights put bf16 4.7e-2 from plain
    # bf16 (6 steps of the largest value), while both are 0.832 from float32 (H200, 2026-12-03)
    assert rel_err(got.float(), expected.float()) <= (6e-2 if dtype is torch.bfloat16 else 3e-2)
    # Against float32: no farther than plain Diffusers in the same dtype (random weights make both far)
    reference = _call(name, _BUILDERS[name](dtype=torch.float32, device="cuda"))
    assert rel_err(got.float(), reference) <= 1.25 * rel_err(expected.float(), reference) + 1e-2


@pytest.mark.parametrize("name", sorted(_BUILDERS))
@torch.no_grad()
def test_save_load_float16_then_accelerate(name, tmp_path):
    plain = _BUILDERS[name](dtype=torch.float16, device="cuda")
    expected = _call(name, plain)
    plain.save_pretrained(tmp_path)
    loaded = type(plain).from_pretrained(tmp_path, torch_dtype=torch.float16).to("cuda")
    omni_accel.accelerate(loaded)
    got = _call(name, loaded)
    assert rel_err(got.float(), expected.float()) <= 3e-2


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", sorted(_BUILDERS))
@torch.no_grad()
def test_layerwise_casting_inference(name, when):
    """``test_layerwise_casting_inference``: float8 storage, bfloat16 compute, set before or after
    ``accelerate``; the blocks then run as Diffusers computes them (their linears are hooked)."""
    plain = _BUILDERS[name](dtype=torch.bfloat16, device="cuda")
    fast = _BUILDERS[name](dtype=torch.bfloat16, device="cuda")
    casting = dict(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    plain.transformer.enable_layerwise_casting(**casting)
    if when == "before":
        fast.transformer.enable_layerwise_casting(**casting)
    omni_accel.accelerate(fast)
    if when == "after":
        fast.transformer.enable_layerwise_casting(**casting)
    expected, got = _call(name, plain), _call(name, fast)
    assert not torch.isnan(got).any()
    assert rel_err(got.float(), expected.float()) <= 3e-2
    assert "-> error" not in str(omni_accel.describe(fast))


@torch.no_grad()
def test_flux_ip_adapter_scale_changes_replayed_steps():
    """``TestFluxPipelineIPAdapter::test_ip_adapter`` with CUDA graphs on: scale 0 then 42 give different
    images, each equal to plain Diffusers'."""
    plain, fast = _pair("flux", torch.float32)
    state = random_ip_adapter_state(plain.transformer, clip_dim=12)
    for pipe in (plain, fast):
        pipe.transformer._load_ip_adapter_weights(copy.deepcopy(state), low_cpu_mem_usage=False)
        pipe.to("cuda")  # the loader builds the adapter's layers on the CPU
    embeds = [torch.randn(1, 1, 12, generator=torch.Generator().manual_seed(6)).cuda()]
    images = []
    for scale in (0.0, 42.0):
        for pipe in (plain, fast):
            pipe.set_ip_adapter_scale(scale)
        images.append(
            [
                _call(
                    "flux",
                    p,
                    num_inference_steps=4,
                    ip_adapter_image_embeds=embeds,
                    negative_ip_adapter_image_embeds=[torch.zeros_like(embeds[0])],
                )
                for p in (plain, fast)
            ]
        )
    for expected, got in images:
        assert rel_err(got, expected) <= 1e-3
    assert (images[0][1] - images[1][1]).abs().max() > 1e-2
    assert omni_accel.describe(fast).components[0].graphs.stats()["replays"] > 0


def test_flux_input_gradients_on_the_gpu_match_plain():
    """Frozen blocks, gradients to the inputs (inversion, guidance by a reward): Diffusers' forward serves
    those calls, so the gradients are plain Diffusers' on the GPU too."""
    plain, fast = _pair("flux", torch.float32)
    grads = []
    for pipe in (plain, fast):
        transformer = pipe.transformer
        transformer.requires_grad_(False)
        g = torch.Generator("cuda").manual_seed(1)
        cfg = transformer.config
        x = torch.randn(1, 16, cfg.in_channels, device="cuda", generator=g, requires_grad=True)
        text = torch.randn(1, 5, cfg.joint_attention_dim, device="cuda", generator=g, requires_grad=True)
        out = transformer(
            hidden_states=x,
            encoder_hidden_states=text,
            pooled_projections=torch.randn(1, cfg.pooled_projection_dim, device="cuda", generator=g),
            timestep=torch.full((1,), 0.5, device="cuda"),
            img_ids=torch.zeros(16, 3, device="cuda"),
            txt_ids=torch.zeros(5, 3, device="cuda"),
            return_dict=False,
        )[0]
        out.square().mean().backward()
        grads.append((x.grad, text.grad))
    for got, want in zip(grads[1], grads[0], strict=True):
        assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int8_dynamic", "float8_dynamic_rowwise"])
@torch.no_grad()
def test_torchao_quantized_flux_runs_as_quantized(scheme):
    """A torchao-quantized transformer runs as the quantized module computes (its blocks in Diffusers'
    forward, counted), never a crash."""
    torchao = pytest.importorskip("torchao")
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    del torchao
    configs = {
        "int8_weight_only": Int8WeightOnlyConfig,
        "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "float8_dynamic_rowwise": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
    }
    plain = omni_accel.tiny_flux_pipeline(dtype=torch.bfloat16, device="cuda", attention_head_dim=64)
    fast = omni_accel.tiny_flux_pipeline(dtype=torch.bfloat16, device="cuda", attention_head_dim=64)
    for pipe in (plain, fast):
        quantize_(pipe.transformer, configs[scheme]())
    omni_accel.accelerate(fast)
    expected, got = _call("flux", plain), _call("flux", fast)
    assert rel_err(got.float(), expected.float()) <= 3e-2
    fallbacks = omni_accel.describe(fast).components[0].runtime.fallbacks
    assert fallbacks and all("quantized or wrapped tensor" in reason for reason in fallbacks)


@pytest.mark.parametrize("bits", [8, 4])
@torch.no_grad()
def test_bitsandbytes_quantized_flux_runs_as_quantized(bits, tmp_path):
    """A transformer loaded with Diffusers' ``BitsAndBytesConfig`` (LLM.int8 or NF4) runs as the quantized
    module computes (its blocks in Diffusers' forward, the reason counted), never a crash."""
    pytest.importorskip("bitsandbytes")
    from diffusers import BitsAndBytesConfig, FluxTransformer2DModel

    omni_accel.tiny_flux_pipeline(attention_head_dim=64).transformer.save_pretrained(tmp_path)
    configs = {
        8: lambda: BitsAndBytesConfig(load_in_8bit=True),
        4: lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16),
    }
    plain, fast = (
        omni_accel.tiny_flux_pipeline(dtype=torch.bfloat16, device="cuda", attention_head_dim=64)
        for _ in range(2)
    )
    for pipe in (plain, fast):
        pipe.transformer = FluxTransformer2DModel.from_pretrained(
            tmp_path, quantization_config=configs[bits](), torch_dtype=torch.bfloat16
        )
    omni_accel.accelerate(fast)
    expected, got = _call("flux", plain), _call("flux", fast)
    assert rel_err(got.float(), expected.float()) <= 3e-2
    fallbacks = omni_accel.describe(fast).components[0].runtime.fallbacks
    layer = {8: "Linear8bitLt", 4: "Linear4bit"}[bits]
    assert fallbacks and all(f"is a {layer}, not a plain nn.Linear" in reason for reason in fallbacks), (
        fallbacks
    )
