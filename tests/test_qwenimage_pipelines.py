"""End to end: the Qwen-Image pipelines beyond text-to-image (Edit, Edit Plus, Edit-2511, Edit inpaint,
ControlNet, union ControlNet, ControlNet inpaint) run the accelerated transformer's native blocks and give
what plain Diffusers gives, from the same tiny pipeline, prompt, images and generator."""

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import rel_err
from diffusers import QwenImageEditInpaintPipeline

import omni_accel

# fp32 throughout: the padded text keys are dropped rather than masked, so only rounding differs
_TOLERANCE = 1e-5


def _picture(width: int, height: int, seed: int) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def _generate(pipe, **call):
    call = {"num_inference_steps": 2, "output_type": "latent", **call}
    # QwenImageControlNetInpaintPipeline samples the masked image's latents without the generator (Diffusers
    # 0.42.1, ``latent_dist.sample()``): the global RNG too, or two plain runs differ
    torch.manual_seed(0)
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


def _pipelines(build, **options):
    """The same tiny pipeline twice, the second accelerated."""
    return build(seed=0, **options), omni_accel.accelerate(build(seed=0, **options))


def _assert_native_and_equal(plain, fast, **call):
    expected = _generate(plain, **call)
    got = _generate(fast, **call)
    component = omni_accel.describe(fast).components[0]
    assert component.name == "transformer" and component.mode == "native"
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= _TOLERANCE
    assert component.runtime.fallbacks == {}
    # and the blocks did run ours: their attention went through our selector
    assert {role for role, *_ in component.selector.decisions()} == {"qwenimage.joint"}
    return got


# Non-square, so the condition's tokens are a 39 x 26 grid (1248 x 832 pixels, 16x VAE, 2x2 packing) beside
# the 3 x 2 target's (96 x 64 pixels).
_TARGET = dict(height=64, width=96)


@pytest.mark.parametrize(
    "call",
    [
        dict(image=_picture(48, 32, seed=1), prompt="make it red", true_cfg_scale=1.0),
        dict(  # a batch: one image per prompt
            image=[_picture(48, 32, seed=1), _picture(48, 32, seed=2)],
            prompt=["make it red", "a much longer instruction about a dog"],  # padded text in one sample
            negative_prompt=["blurry", "ugly"],
            true_cfg_scale=4.0,
        ),
    ],
    ids=["plain", "true_cfg_padded_batch"],
)
def test_edit_pipeline(call):
    plain, fast = _pipelines(omni_accel.tiny_qwenimage_edit_pipeline)
    latents = _assert_native_and_equal(plain, fast, **call, **_TARGET)
    batch = len(call["prompt"]) if isinstance(call["prompt"], list) else 1
    assert latents.shape == (batch, 6, 64)  # only the target's tokens come out


def test_edit_plus_pipeline_with_condition_images_of_different_sizes():
    """Two references of other sizes and aspect ratios (1014 and 1035 tokens after the target's 6), true
    CFG, decoded to pixels."""
    plain, fast = _pipelines(omni_accel.tiny_qwenimage_edit_pipeline, plus=True)
    images = [_picture(48, 32, seed=1), _picture(32, 64, seed=2)]
    pixels = _assert_native_and_equal(
        plain,
        fast,
        image=images,
        prompt="put the cat on the sofa",
        negative_prompt="blurry",
        true_cfg_scale=4.0,
        output_type="pt",
        **_TARGET,
    )
    assert pixels.shape == (1, 3, 64, 96)


def test_edit_2511_pipeline_modulates_the_references_per_token():
    """Edit-2511 (``zero_cond_t``): the references' tokens take the modulation of timestep 0."""
    plain, fast = _pipelines(omni_accel.tiny_qwenimage_edit_pipeline, plus=True, zero_cond_t=True)
    assert fast.transformer.config.zero_cond_t
    images = [_picture(48, 32, seed=1), _picture(40, 40, seed=2)]
    _assert_native_and_equal(plain, fast, image=images, prompt="make it red", true_cfg_scale=1.0, **_TARGET)


def test_edit_inpaint_pipeline_from_an_accelerated_edit_pipeline():
    plain, fast = _pipelines(omni_accel.tiny_qwenimage_edit_pipeline)
    image = _picture(64, 64, seed=1)
    mask = PIL.Image.fromarray((np.arange(64 * 64).reshape(64, 64) % 64 < 32).astype(np.uint8) * 255)
    call = dict(image=image, mask_image=mask, prompt="make it red", strength=0.9, height=64, width=64)
    got = _generate(omni_accel.accelerate(QwenImageEditInpaintPipeline.from_pipe(fast)), **call)
    expected = _generate(QwenImageEditInpaintPipeline.from_pipe(plain), **call)
    assert rel_err(got, expected) <= _TOLERANCE
    component = omni_accel.describe(fast).components[0]
    assert component.runtime.fallbacks == {}
    assert component.selector.decisions()


def _control(seed: int) -> torch.Tensor:
    return torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "options, call",
    [
        (
            {},
            dict(
                control_image=_control(1),
                controlnet_conditioning_scale=0.7,
                prompt="a cat",
                negative_prompt="a dog",
                true_cfg_scale=4.0,
            ),
        ),
        (
            {"multi": True},  # a union ControlNet: one model, two control images and scales
            dict(
                control_image=[_control(1), _control(2)],
                controlnet_conditioning_scale=[1.0, 0.5],
                prompt=["a cat", "a much longer prompt about a dog"],
                true_cfg_scale=1.0,
            ),
        ),
        (
            {"inpaint": True},
            dict(
                control_image=_control(1),
                control_mask=(_control(2)[:, :1] > 0.5).float(),
                prompt="a cat",
                negative_prompt="a dog",
                true_cfg_scale=4.0,
            ),
        ),
    ],
    ids=["controlnet_true_cfg", "multi_controlnet_padded", "controlnet_inpaint_true_cfg"],
)
def test_controlnet_pipelines(options, call):
    plain, fast = _pipelines(omni_accel.tiny_qwenimage_controlnet_pipeline, **options)
    _assert_native_and_equal(plain, fast, height=32, width=32, **call)


def test_the_conditions_reach_the_transformer():
    """What the tests above compare depends on the condition images and the ControlNet residuals (the
    ControlNet's zero-initialised projections are random), so a native block that dropped or misplaced them
    would not match."""
    edit = omni_accel.tiny_qwenimage_edit_pipeline(seed=0)
    call = dict(prompt="make it red", true_cfg_scale=1.0, num_inference_steps=1, **_TARGET)
    first = _generate(edit, image=_picture(48, 32, seed=1), **call)
    assert rel_err(_generate(edit, image=_picture(48, 32, seed=2), **call), first) > 1e-3

    controlnet = omni_accel.tiny_qwenimage_controlnet_pipeline(seed=0)
    call = dict(prompt="a cat", control_image=_control(1), true_cfg_scale=1.0, num_inference_steps=1)
    on = _generate(controlnet, controlnet_conditioning_scale=1.0, **call)
    assert rel_err(_generate(controlnet, controlnet_conditioning_scale=0.0, **call), on) > 1e-3
