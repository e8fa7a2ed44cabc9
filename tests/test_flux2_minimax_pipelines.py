"""End to end: FLUX.2-dev (``Flux2Pipeline``, embedded guidance, Mistral-Small-3.1 text encoder) and MiniMax-H3's
modular pipeline (text -> one packed text/audio/video sequence -> video and audio), each accelerated and checked
against the same pipeline left to Diffusers: same seed, same inputs, same generator."""

import numpy as np
import PIL.Image
import torch
from conftest import rel_err
from tiny_builders import tiny_flux2_dev_pipeline, tiny_minimax_h3_pipeline

import omni_accel


def _ran_natively(pipe, name: str = "transformer") -> None:
    """The accelerated transformer ``name`` is native, its blocks ran (a native block resolved its attention) and
    no call went back to Diffusers' forward."""
    component = next(c for c in omni_accel.describe(pipe).components if c.name == name)
    assert component.mode == "native", str(omni_accel.describe(pipe))
    assert component.selector.decisions(), "no native block ran"
    assert component.runtime.fallbacks == {}


def _counting_calls(pipe) -> list:
    """A list that grows by one at every forward of ``pipe``'s (Diffusers) transformer."""
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(None))
    return calls


def _flux2_dev_latents(pipe, **call):
    call = {
        "prompt": "a cat",
        "num_inference_steps": 2,
        "guidance_scale": 4.0,
        "output_type": "latent",
        **call,
    }
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


def test_tiny_flux2_dev_pipeline_native_matches_diffusers():
    """FLUX.2-dev embeds ``guidance_scale``: one transformer call per step, the guidance in the modulation."""
    plain = tiny_flux2_dev_pipeline(seed=0)
    fast = omni_accel.accelerate(tiny_flux2_dev_pipeline(seed=0))
    assert type(fast.transformer.transformer_blocks[0]) is not type(plain.transformer.transformer_blocks[0])
    calls = _counting_calls(plain)
    expected = _flux2_dev_latents(plain)
    assert len(calls) == 2
    # The embedded guidance reaches the output, so a native path that dropped it would be caught.
    assert rel_err(_flux2_dev_latents(plain, guidance_scale=1.5), expected) > 1e-3
    assert rel_err(_flux2_dev_latents(fast), expected) <= 1e-5
    batch = {"prompt": ["a cat", "a red dog"], "guidance_scale": 2.5}
    assert rel_err(_flux2_dev_latents(fast, **batch), _flux2_dev_latents(plain, **batch)) <= 1e-5
    _ran_natively(fast)


def test_tiny_flux2_dev_prompt_upsampling_accelerated_matches_diffusers():
    """``caption_upsample_temperature``: the Mistral encoder first rewrites the prompt (sampling from torch's
    global generator), then the pipeline runs on the rewritten prompt; accelerated, the same."""
    plain = tiny_flux2_dev_pipeline(seed=0)
    fast = omni_accel.accelerate(tiny_flux2_dev_pipeline(seed=0))
    torch.manual_seed(0)
    rewritten = plain.upsample_prompt("a cat", temperature=0.15)
    assert rewritten != ["a cat"]
    results = []
    for pipe in (plain, fast):
        torch.manual_seed(0)
        results.append(_flux2_dev_latents(pipe, caption_upsample_temperature=0.15))
    assert torch.equal(results[0], _flux2_dev_latents(plain, prompt=rewritten))
    assert rel_err(results[0], _flux2_dev_latents(plain)) > 1e-3
    assert rel_err(results[1], results[0]) <= 1e-5
    _ran_natively(fast)


def _picture(width: int, height: int, seed: int) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def test_tiny_flux2_dev_pipeline_with_reference_images_native_matches_diffusers():
    """``Flux2Pipeline(image=[...])``: each reference image's latent tokens join the sequence after the target's
    (with their own time index); one and two references of different sizes (the pipeline takes >= 64 px)."""
    plain = tiny_flux2_dev_pipeline(seed=0)
    fast = omni_accel.accelerate(tiny_flux2_dev_pipeline(seed=0))
    unconditioned = _flux2_dev_latents(plain, height=32, width=32)
    for images in ([_picture(64, 64, 1)], [_picture(64, 64, 1), _picture(96, 64, 2)]):
        expected = _flux2_dev_latents(plain, image=images, height=32, width=32)
        assert rel_err(expected, unconditioned) > 1e-3  # the references reach the output
        assert rel_err(_flux2_dev_latents(fast, image=images, height=32, width=32), expected) <= 1e-5
    _ran_natively(fast)


_MINIMAX_OUTPUTS = ["latents", "audio_latents", "videos", "audio"]


def _minimax_outputs(pipe, **call) -> dict:
    call = {
        "prompt": "a cat plays the drums",
        # MiniMaxH3Scheduler counts grid points, the terminal sigma 0 included: 3 are 2 transformer calls.
        "num_inference_steps": 3,
        "height": 16,
        "width": 16,
        "num_frames": 124,  # 17 * 7 + 5: 37 latent frames, 5.17 s of stereo audio (2 x 207 rows)
        "output_type": "pt",
        **call,
    }
    return pipe(**call, generator=torch.Generator().manual_seed(0), output=_MINIMAX_OUTPUTS)


def test_tiny_minimax_h3_modular_pipeline_native_matches_diffusers():
    """The ``t2va`` workflow: the text rows, 2 x 207 audio rows and 37 x 4 video rows in one packed sequence, one
    transformer call per step; the video and audio latents, and what the two VAEs decode them to, compared."""
    plain = tiny_minimax_h3_pipeline(seed=0)
    fast = omni_accel.accelerate(tiny_minimax_h3_pipeline(seed=0))
    assert type(fast.transformer.transformer_blocks[0]) is not type(plain.transformer.transformer_blocks[0])
    calls = _counting_calls(plain)
    expected = _minimax_outputs(plain)
    assert len(calls) == 2
    assert expected["audio_latents"].shape == (2, 6, 207) and expected["latents"].shape == (1, 4, 37, 4, 4)
    assert expected["audio"].shape == (1, 2, 828) and expected["videos"].shape == (1, 124, 3, 16, 16)
    got = _minimax_outputs(fast)
    for name in _MINIMAX_OUTPUTS:
        assert rel_err(got[name], expected[name]) <= 1e-5, name
    _ran_natively(fast)


def test_tiny_minimax_h3_reference_workflow_native_matches_diffusers():
    """The ``ref2va`` workflow (chosen when ``references`` are given): its own checkpoint, ``transformer_ref``,
    accelerated by default beside ``transformer``; one and two image references packed as reference blocks
    ahead of the generated audio and video."""
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference

    def pipeline():
        pipe = tiny_minimax_h3_pipeline(seed=0)
        # weights of its own, as the released checkpoint's transformer_ref/
        pipe.update_components(transformer_ref=tiny_minimax_h3_pipeline(seed=1).transformer)
        pipe.register_to_config(reference_image_short_edge=16)  # the references at the tiny canvas' size
        return pipe

    plain, fast = pipeline(), omni_accel.accelerate(pipeline())
    unconditioned = _minimax_outputs(plain)
    for count in (1, 2):
        references = [MiniMaxH3ImageReference(image=_picture(16, 16, seed)) for seed in range(1, count + 1)]
        expected = _minimax_outputs(plain, references=references)
        got = _minimax_outputs(fast, references=references)
        for name in _MINIMAX_OUTPUTS:
            assert rel_err(got[name], expected[name]) <= 1e-5, (count, name)
        assert (
            rel_err(expected["latents"], unconditioned["latents"]) > 1e-3
        )  # the references reach the output
    _ran_natively(fast, "transformer_ref")


def test_tiny_minimax_h3_keyframe_workflow_native_matches_diffusers():
    """The ``fl2va`` workflow (chosen by the pipeline when keyframes are given): a first and a last keyframe
    encoded by the video VAE and packed as conditioning rows at timestep 0 beside the generated ones."""
    plain = tiny_minimax_h3_pipeline(seed=0)
    fast = omni_accel.accelerate(tiny_minimax_h3_pipeline(seed=0))
    unconditioned = _minimax_outputs(plain)
    for keyframes in (
        dict(image=_picture(16, 16, 1)),
        dict(image=_picture(16, 16, 1), last_image=_picture(16, 16, 2)),
    ):
        expected = _minimax_outputs(plain, **keyframes)
        got = _minimax_outputs(fast, **keyframes)
        for name in ("latents", "audio_latents"):
            assert rel_err(expected[name], unconditioned[name]) > 1e-3, name  # the keyframes reach the output
            assert rel_err(got[name], expected[name]) <= 1e-5, name
    _ran_natively(fast)
