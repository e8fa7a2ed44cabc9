"""After accelerate(), every Diffusers API surface behaves as before, with the same outputs."""

import json

import numpy as np
import pytest
import torch
from conftest import rel_err

import omni_accel

SIZE = dict(height=32, width=32, num_inference_steps=2)


@pytest.fixture(scope="module")
def pipes():
    """A plain pipeline and an accelerated one built from the same seed."""
    plain = omni_accel.tiny_flux_pipeline(seed=0, guidance_embeds=True)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0, guidance_embeds=True))
    return plain, fast


def _run(pipe, **kwargs):
    kwargs.setdefault("generator", torch.Generator().manual_seed(0))
    return pipe(**{**SIZE, **kwargs})


def _assert_same_latents(plain, fast, **kwargs):
    expected = _run(plain, output_type="latent", **kwargs).images
    got = _run(fast, output_type="latent", **kwargs).images
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= 1e-5
    return got


def test_accelerate_returns_the_same_object():
    pipe = omni_accel.tiny_flux_pipeline(seed=1)
    transformer = pipe.transformer
    assert omni_accel.accelerate(pipe) is pipe
    assert pipe.transformer is transformer  # the Diffusers module stays; its blocks become native
    assert type(transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
    assert type(transformer.single_transformer_blocks[0]).__name__ == "NativeFluxSingleTransformerBlock"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt="a cat"),
        dict(prompt=["a cat", "a dog in the rain"]),
        dict(prompt="a cat", num_images_per_prompt=2),
        dict(prompt=["a", "b"], num_images_per_prompt=2, guidance_scale=7.0),
        dict(prompt="a cat", guidance_scale=1.5, max_sequence_length=16),
    ],
)
def test_call_variants_match(pipes, kwargs):
    _assert_same_latents(*pipes, **kwargs)


def test_prompt_embeds_match(pipes):
    plain, fast = pipes
    embeds, pooled, _ = plain.encode_prompt(prompt="a cat", prompt_2=None, max_sequence_length=16)
    _assert_same_latents(plain, fast, prompt_embeds=embeds, pooled_prompt_embeds=pooled)


@pytest.mark.parametrize("output_type", ["np", "pt", "pil"])
def test_output_types(pipes, output_type):
    plain, fast = pipes
    expected = _run(plain, prompt="a cat", output_type=output_type).images
    got = _run(fast, prompt="a cat", output_type=output_type).images
    if output_type == "pil":
        assert got[0].size == expected[0].size
        assert np.abs(np.asarray(got[0], int) - np.asarray(expected[0], int)).max() <= 1
    else:
        assert type(got) is type(expected)
        assert float(abs(got - expected).max()) < 1e-5


def test_return_dict_false(pipes):
    _, fast = pipes
    out = _run(fast, prompt="a cat", output_type="np", return_dict=False)
    assert isinstance(out, tuple) and out[0].shape == (1, 32, 32, 3)


def test_callback_on_step_end_sees_and_can_change_latents(pipes):
    plain, fast = pipes
    seen = {}

    def callback(pipe, step, timestep, tensors):
        seen.setdefault(id(pipe), []).append(step)
        return {"latents": tensors["latents"] * 0.5}

    kwargs = dict(
        prompt="a cat", callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"]
    )
    _assert_same_latents(plain, fast, **kwargs)
    assert seen[id(fast)] == [0, 1]


def test_transformer_surface(pipes):
    plain, fast = pipes
    assert dict(fast.transformer.config) == dict(plain.transformer.config)
    assert fast.transformer.config.guidance_embeds is True
    assert fast.transformer.dtype == torch.float32
    assert fast.transformer.device == torch.device("cpu")
    with fast.transformer.cache_context("cond"):
        pass


def test_pipe_to_dtype_moves_the_native_model():
    plain = omni_accel.tiny_flux_pipeline(seed=2).to(torch.float64)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=2)).to(torch.float64)
    assert fast.transformer.dtype == torch.float64
    _assert_same_latents(plain, fast, prompt="a cat")
    attn = fast.transformer.transformer_blocks[0].attn
    # packed again after the move: Q, K and V are consecutive rows of one storage
    assert attn.to_k.weight.data_ptr() == attn.to_q.weight.data_ptr() + attn.to_q.weight.nbytes


def test_restore_gives_bitwise_the_original_output():
    pipe = omni_accel.tiny_flux_pipeline(seed=3)
    original_class = type(pipe.transformer)
    before = _run(pipe, prompt="a cat", output_type="latent").images
    omni_accel.accelerate(pipe)
    _run(pipe, prompt="a cat", output_type="latent")
    omni_accel.restore(pipe)
    assert type(pipe.transformer) is original_class
    after = _run(pipe, prompt="a cat", output_type="latent").images
    assert torch.equal(before, after)
    # and it can be accelerated again
    omni_accel.accelerate(pipe)
    omni_accel.restore(pipe)


def test_save_pretrained_writes_the_diffusers_layout(tmp_path):
    from diffusers import FluxTransformer2DModel

    plain = omni_accel.tiny_flux_pipeline(seed=4)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=4))
    fast.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    loaded = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer")
    expected = plain.transformer.state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # saving did not disturb the accelerated pipeline
    assert type(fast.transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"


def test_describe_reports_the_swap_and_the_providers(pipes):
    _, fast = pipes
    report = omni_accel.describe(fast)
    text = str(report)
    assert "FluxTransformer2DModel" in text and "native" in text
    assert "flux.joint" in text and "flux.single" in text and "sdpa" in text
    assert report.components[0].mode == "native"
    # what would run Diffusers' forward is on the record, and in the text once something did
    assert "IP-adapter processors" in report.components[0].falls_back_on and "IP-adapter" not in text


def test_a_diffusers_attention_backend_set_after_accelerate_is_honoured():
    """Setting a backend on the processors is a Diffusers request: those blocks run Diffusers' forward."""
    plain = omni_accel.tiny_flux_pipeline(seed=5)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=5))
    for pipe in (plain, fast):
        pipe.transformer.set_attention_backend("native")
    _assert_same_latents(plain, fast, prompt="a cat")
    text = str(omni_accel.describe(fast))
    assert "run by Diffusers' forward: 8 (a Diffusers attention backend" in text
    assert "what runs Diffusers' forward of a block: IP-adapter processors" in text
