"""Tests for the tiny offline pipelines.

Parity and speed tests elsewhere build on these pipelines, so they must run, be reproducible from the seed,
and have every transformer weight influence the output; otherwise a parity test could pass against a kernel
that ignores some of them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from omni_accel.models.tiny_pipelines import (
    flux_rope_axes,
    tiny_flux_pipeline,
    tiny_qwenimage_pipeline,
    tiny_sd3_pipeline,
    tiny_wan_pipeline,
)


@dataclass(frozen=True)
class Case:
    build: Callable[..., DiffusionPipeline]
    call_kwargs: dict[str, Any]
    shape: tuple[int, ...]
    # Parameters the architecture itself never lets reach the output: the last dual-stream block (block 1 at
    # the default num_layers=2) computes text outputs that are discarded, in the released models too.
    discarded: str = r"$^"


IMAGE = {"height": 32, "width": 32}
CASES = {
    "flux": Case(tiny_flux_pipeline, IMAGE, (1, 32, 32, 3)),
    "flux_guidance": Case(
        functools.partial(tiny_flux_pipeline, guidance_embeds=True),
        {**IMAGE, "guidance_scale": 4.0},
        (1, 32, 32, 3),
    ),
    "sd3": Case(
        tiny_sd3_pipeline, IMAGE, (1, 32, 32, 3), discarded=r"transformer_blocks\.1\.attn\.add_q_proj\."
    ),
    "wan": Case(tiny_wan_pipeline, {**IMAGE, "num_frames": 5}, (1, 5, 32, 32, 3)),
    "qwenimage": Case(
        tiny_qwenimage_pipeline,
        IMAGE,
        (1, 32, 32, 3),
        discarded=r"transformer_blocks\.1\.(attn\.(add_q_proj|to_add_out|norm_added_q)|txt_mlp)\.",
    ),
}


def generate(
    pipe: DiffusionPipeline, case: Case, prompt: str | list[str] = "a tiny red fox", **kwargs: Any
) -> np.ndarray:
    call = {"num_inference_steps": 2, **case.call_kwargs, **kwargs}
    out = pipe(
        prompt=prompt, generator=torch.Generator().manual_seed(0), output_type="np", return_dict=False, **call
    )
    return np.asarray(out[0])


@pytest.fixture(scope="module", params=list(CASES))
def case_and_pipe(request: pytest.FixtureRequest) -> tuple[Case, DiffusionPipeline, np.ndarray]:
    """Build each pipeline once per module with seed 0, along with its reference output."""
    case = CASES[request.param]
    pipe = case.build(seed=0)
    return case, pipe, generate(pipe, case)


def test_generates_finite_output_of_expected_shape(case_and_pipe):
    case, _, output = case_and_pipe
    assert output.shape == case.shape
    assert np.isfinite(output).all()
    assert output.std() > 0


def test_same_seed_is_bitwise_reproducible(case_and_pipe):
    case, pipe, output = case_and_pipe
    again = case.build(seed=0)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            other = again.components[name].state_dict()
            for key, tensor in component.state_dict().items():
                assert torch.equal(tensor, other[key]), f"{name}.{key}"
    np.testing.assert_array_equal(generate(again, case), output)


def test_different_seeds_differ(case_and_pipe):
    case, _, output = case_and_pipe
    assert not np.array_equal(generate(case.build(seed=1), case), output)


def test_every_transformer_parameter_reaches_the_output(case_and_pipe):
    case, pipe, _ = case_and_pipe
    transformer = pipe.transformer
    for name, param in transformer.named_parameters():
        assert param.any(), f"{name} is all zeros"

    captured: dict[str, Any] = {}

    def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        captured.setdefault("call", (args, kwargs))

    handle = transformer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        pipe(prompt="a tiny red fox", num_inference_steps=1, output_type="latent", **case.call_kwargs)
    finally:
        handle.remove()
    args, kwargs = captured["call"]

    names, params = zip(*transformer.named_parameters(), strict=True)
    with torch.enable_grad():
        prediction = transformer(*args, **{**kwargs, "return_dict": False})[0]
        grads = torch.autograd.grad(prediction.square().mean(), params, allow_unused=True)
    assert prediction.abs().mean() > 0.1, "denoiser output is (nearly) zero"
    dead = [name for name, grad in zip(names, grads, strict=True) if grad is None or not grad.any()]
    assert [name for name in dead if not re.match(case.discarded, name)] == []


def test_any_prompt_encodes(case_and_pipe):
    case, pipe, _ = case_and_pipe
    prompts = ["", "Zoë's 東京 café 🚀\t\n" + "a very long prompt " * 60]
    output = generate(pipe, case, prompt=prompts, num_inference_steps=1)
    assert output.shape == (2, *case.shape[1:])
    assert np.isfinite(output).all()


def test_flux_runs_with_defaults_and_explicit_max_sequence_length():
    pipe = tiny_flux_pipeline()
    default = pipe("a tiny red fox", num_inference_steps=2, output_type="np").images
    assert default.shape == (1, 32, 32, 3)
    short = generate(pipe, CASES["flux"], max_sequence_length=16)
    assert short.shape == (1, 32, 32, 3)
    assert np.isfinite(short).all()


def test_qwenimage_template_prefix_has_the_token_count_the_pipeline_drops():
    pipe = tiny_qwenimage_pipeline()
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx


def test_low_precision_keeps_fp32_modules_like_from_pretrained():
    pipe = tiny_wan_pipeline(dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16
    assert pipe.transformer.scale_shift_table.dtype == torch.float32
    assert pipe.text_encoder.dtype == torch.bfloat16
    assert np.isfinite(generate(pipe, CASES["wan"], num_inference_steps=1)).all()


def test_builders_leave_the_global_rng_untouched():
    state = torch.random.get_rng_state()
    tiny_sd3_pipeline(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_flux_rope_axes():
    assert flux_rope_axes(16) == (4, 6, 6)
    assert flux_rope_axes(128) == (16, 56, 56)
    for head_dim in range(6, 130, 2):
        axes = flux_rope_axes(head_dim)
        assert sum(axes) == head_dim and all(a > 0 and a % 2 == 0 for a in axes)
    with pytest.raises(ValueError):
        flux_rope_axes(15)


def test_full_size_random_flux_dev_has_the_released_shapes():
    """The offline FLUX.1-dev (random weights) that benchmarks and the example build on a GPU: built here
    on the meta device, its parameter counts are the released model's (text towers: less the vocabulary)."""
    import omni_accel
    from omni_accel.models.random_pipelines import FLUX_DEV_TRANSFORMER

    pipe = omni_accel.random_flux_dev_pipeline(device="meta")
    counts = {
        name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in ("transformer", "vae")
    }
    assert counts == {"transformer": 11_901_408_320, "vae": 83_819_683}
    config = {k: pipe.transformer.config[k] for k in FLUX_DEV_TRANSFORMER}
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()} == FLUX_DEV_TRANSFORMER
    assert pipe.text_encoder_2.config.d_model == 4096 and pipe.text_encoder_2.config.num_layers == 24
    assert pipe.default_sample_size * pipe.vae_scale_factor == 1024
    assert pipe.transformer.dtype == torch.bfloat16
