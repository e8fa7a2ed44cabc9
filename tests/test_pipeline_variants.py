"""End to end: the other Diffusers pipelines over a transformer class with native blocks (FLUX.1 Fill,
Kontext and ControlNet; Z-Image ControlNet and Omni; Qwen-Image Layered; Wan first-last-frame-to-video),
each accelerated and checked against the same pipeline left to Diffusers (same weights, inputs and
generator), and ``describe`` checked to say what ran: native blocks, and Diffusers' forward with its reason
counted where a pipeline needs it."""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import diffusers
import numpy as np
import PIL.Image
import pytest
import torch
from conftest import rel_err
from diffusers import DiffusionPipeline
from omni_accel.patches import scoped_calls
from transformers import Siglip2ImageProcessorPil, Siglip2VisionConfig, Siglip2VisionModel

import omni_accel
from omni_accel import ParallelConfig
from omni_accel.models.tiny_pipelines import _finish, _qwen_transformer, _randomize_, _seeded


def _picture(side: int, seed: int, mode: str = "RGB") -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, len(mode)), dtype=np.uint8)
    return PIL.Image.fromarray(pixels, mode)


_MASK = PIL.Image.fromarray((np.arange(32 * 32).reshape(32, 32) % 32 < 16).astype(np.uint8) * 255)


def _rebuilt(pipe: DiffusionPipeline, name: str, **overrides: Any) -> torch.nn.Module:
    """``pipe``'s component ``name`` built again from its config with ``overrides``, new random weights."""
    module = getattr(pipe, name)
    config = {k: v for k, v in module.config.items() if not k.startswith("_")}
    with _seeded(0, f"{name}-variant"):
        rebuilt = type(module)(**{**config, **overrides})
        _randomize_(rebuilt)
    return rebuilt


def _assemble(pipeline_class: str, base: DiffusionPipeline, **components: Any) -> DiffusionPipeline:
    cls = getattr(diffusers, pipeline_class)
    expected = cls._get_signature_keys(cls)[0]
    kept = {k: v for k, v in base.components.items() if k in expected}
    pipe = _finish(cls(**{**kept, **components}), torch.float32, "cpu")
    if hasattr(base, "default_sample_size"):
        pipe.default_sample_size = base.default_sample_size
    return pipe


def _flux(pipeline_class: str) -> DiffusionPipeline:
    base = omni_accel.tiny_flux_pipeline(seed=0, guidance_embeds=True)
    t = base.transformer.config
    if pipeline_class == "FluxControlNetPipeline":
        with _seeded(0, "controlnet"):
            controlnet = diffusers.FluxControlNetModel(
                in_channels=t.in_channels,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=t.attention_head_dim,
                num_attention_heads=t.num_attention_heads,
                joint_attention_dim=t.joint_attention_dim,
                pooled_projection_dim=t.pooled_projection_dim,
                guidance_embeds=True,
                axes_dims_rope=t.axes_dims_rope,
            )
            _randomize_(controlnet)
        return _assemble(pipeline_class, base, controlnet=controlnet)
    if pipeline_class == "FluxFillPipeline":  # the masked image's latents and the mask beside the noisy ones
        channels = 2 * t.in_channels + 4 * base.vae_scale_factor**2
        transformer = _rebuilt(base, "transformer", in_channels=channels, out_channels=t.in_channels)
        return _assemble(pipeline_class, base, transformer=transformer)
    return _assemble(pipeline_class, base)


def _zimage(pipeline_class: str) -> DiffusionPipeline:
    base = omni_accel.tiny_zimage_pipeline(seed=0)
    t = base.transformer.config
    if pipeline_class == "ZImageControlNetPipeline":
        with _seeded(0, "controlnet"):
            controlnet = diffusers.ZImageControlNetModel(
                control_layers_places=[0],
                control_in_dim=t.in_channels,
                dim=t.dim,
                n_refiner_layers=t.n_refiner_layers,
                n_heads=t.n_heads,
                n_kv_heads=t.n_kv_heads,
            )
            _randomize_(controlnet)
        return _assemble(pipeline_class, base, controlnet=controlnet)
    with _seeded(0, "siglip"):  # ZImageOmniPipeline
        vision = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)
        siglip = Siglip2VisionModel(Siglip2VisionConfig(**vision, patch_size=16))
    pipe = _assemble(
        pipeline_class,
        base,
        transformer=_rebuilt(base, "transformer", siglip_feat_dim=24),
        siglip=siglip,
        siglip_processor=Siglip2ImageProcessorPil(patch_size=16, max_num_patches=16),
    )
    # Diffusers 0.42.1 encodes the condition images in bfloat16, whatever the VAE's dtype
    pipe.vae.to(torch.bfloat16)
    return pipe


def _qwenimage_layered(pipeline_class: str) -> DiffusionPipeline:
    base = omni_accel.tiny_qwenimage_edit_pipeline(seed=0)
    vae = _rebuilt(base, "vae", input_channels=4)  # RGBA layers
    transformer = _qwen_transformer(0, 2, 2, 16, None, use_layer3d_rope=True, use_additional_t_cond=True)
    return _assemble(pipeline_class, base, vae=vae, transformer=transformer)


def _wan_flf2v(pipeline_class: str) -> DiffusionPipeline:
    base = omni_accel.tiny_wan_pipeline(seed=0, image_to_video=True)
    # the CLIP tokens of both frames (16 patches and the class token, each) take their own positions
    return _assemble(pipeline_class, base, transformer=_rebuilt(base, "transformer", pos_embed_seq_len=34))


_IMAGE, _CONTROL = _picture(32, seed=1), _picture(32, seed=2)
_TRUE_CFG = dict(negative_prompt="a dog", true_cfg_scale=2.0)
_ZIMAGE_CFG = dict(negative_prompt="a much longer prompt about a dog", guidance_scale=5.0)
_OUTSIDE = "the block was called outside its accelerated transformer's forward"
_OMNI = "Z-Image Omni's per-token modulation (noisy and clean tokens)"

# pipeline class, builder, call, the reasons describe counts (block calls run by Diffusers' forward). One
# pipeline for each way of calling the transformer that the other tests do not cover (the img2img and inpaint
# siblings call it as the text-to-image pipelines do).
_CASES: list[tuple[str, Callable[[str], DiffusionPipeline], dict[str, Any], set[str]]] = [
    # wider inputs: the latents with the masked image's and the mask's channels
    ("FluxFillPipeline", _flux, dict(image=_IMAGE, mask_image=_MASK), set()),
    # the reference image's tokens after the target's (their own RoPE index), true CFG
    (
        "FluxKontextPipeline",
        _flux,
        dict(image=_IMAGE, max_area=32 * 32, _auto_resize=False, **_TRUE_CFG),
        set(),
    ),
    # ControlNet residuals added after the blocks, true CFG
    ("FluxControlNetPipeline", _flux, dict(control_image=_CONTROL, **_TRUE_CFG), set()),
    # the ControlNet runs the transformer's refiners (Diffusers shares them) in its own forward, natively
    ("ZImageControlNetPipeline", _zimage, dict(control_image=_CONTROL, **_ZIMAGE_CFG), set()),
    ("ZImageOmniPipeline", _zimage, dict(image=[_picture(64, seed=1)], **_ZIMAGE_CFG), {_OMNI}),
    # RGBA layers on a layer-3D RoPE, with the additional timestep condition
    (
        "QwenImageLayeredPipeline",
        _qwenimage_layered,
        dict(image=_picture(32, seed=1, mode="RGBA"), layers=1),
        set(),
    ),
    # the CLIP tokens of two frames, with their positional embedding
    (
        "WanImageToVideoPipeline",
        _wan_flf2v,
        dict(
            image=_IMAGE,
            last_image=_CONTROL,
            prompt_embeds=torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(3)),
            negative_prompt_embeds=torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(4)),
            num_frames=5,
        ),
        set(),
    ),
]


def _latents(pipe: DiffusionPipeline, call: dict[str, Any]) -> list[torch.Tensor]:
    """The latents after each step."""
    seen = []

    def keep(pipe, step, timestep, tensors):
        seen.append(tensors["latents"].clone())
        return tensors

    call = {"prompt": "a cat", **call}
    if "height" in inspect.signature(pipe.__call__).parameters:  # QwenImageLayeredPipeline sizes by the image
        call = {"height": 32, "width": 32, **call}
    if "prompt_embeds" in call:  # Wan I2V cleans a text prompt with ftfy, not installed here
        del call["prompt"]
    # inpainting and ControlNet pipelines sample some latents from the global RNG
    torch.manual_seed(0)
    pipe(
        **call,
        num_inference_steps=2,
        # QwenImageLayeredPipeline fails to return latents (Diffusers 0.42.1)
        output_type="pt" if isinstance(pipe, diffusers.QwenImageLayeredPipeline) else "latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=keep,
    )
    return seen


@pytest.mark.parametrize("pipeline_class, build, call, reasons", _CASES, ids=[case[0] for case in _CASES])
def test_pipeline_matches_diffusers_and_describe_says_what_ran(pipeline_class, build, call, reasons):
    plain, fast = build(pipeline_class), omni_accel.accelerate(build(pipeline_class))
    assert type(fast).__name__ == pipeline_class
    expected, got = _latents(plain, call), _latents(fast, call)
    assert len(got) == len(expected) == 2
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert rel_err(g, e) <= 1e-5, (pipeline_class, step)
    component = omni_accel.describe(fast).components[0]
    assert component.name == "transformer" and component.mode == "native"
    assert set(component.runtime.fallbacks) == reasons
    assert component.selector.decisions()  # native blocks ran: their attention resolved
    # the projection cache's line said so of ZImageOmniPipeline, whose context refiner runs natively
    assert "no block has run natively" not in str(omni_accel.describe(fast))


def test_zimage_controlnet_runs_the_shared_refiners_natively_until_restore():
    """ZImageControlNetModel holds the transformer's refiners (``from_transformer``) and calls them in its own
    forward: they run natively there (its calls get the transformer's scopes), in deep and pickled copies
    too (bound to the copy's blocks), and restore removes the scopes; a ControlNet put in after accelerate
    runs them by Diffusers' forward, and describe says so."""
    call = dict(control_image=_CONTROL, **_ZIMAGE_CFG)
    expected = _latents(_zimage("ZImageControlNetPipeline"), call)
    fast = omni_accel.accelerate(_zimage("ZImageControlNetPipeline"))
    pickled = pickle.loads(pickle.dumps(fast))  # before a call: the text encoder's hooks do not pickle
    twin = copy.deepcopy(fast)
    for pipe in (fast, twin, pickled):
        assert all(rel_err(g, e) <= 1e-5 for g, e in zip(_latents(pipe, call), expected, strict=True))
        component = omni_accel.describe(pipe).components[0]
        assert component.runtime.fallbacks == {}
        assert component.holders == [
            "pipe.controlnet (ZImageControlNetModel) holds 2 of these native blocks (Diffusers shares them): "
            "they run natively in its forward too"
        ]
    omni_accel.restore(twin)
    assert scoped_calls.SCOPES not in vars(twin.controlnet) and scoped_calls.SCOPES in vars(fast.controlnet)
    omni_accel.restore(fast)
    assert scoped_calls.SCOPES not in vars(fast.controlnet)
    assert all(torch.equal(g, e) for g, e in zip(_latents(fast, call), expected, strict=True))

    fast = omni_accel.accelerate(_zimage("ZImageControlNetPipeline"))
    fast.controlnet = type(fast.controlnet).from_transformer(copy.deepcopy(fast.controlnet), fast.transformer)
    assert all(rel_err(g, e) <= 1e-5 for g, e in zip(_latents(fast, call), expected, strict=True))
    component = omni_accel.describe(fast).components[0]
    assert set(component.runtime.fallbacks) == {_OUTSIDE}
    assert "put in the pipeline after accelerate" in component.holders[0]


def test_zimage_controlnet_sharing_a_transformer_from_pipe_keeps_no_scopes_after_restore():
    """A ControlNet pipeline made by from_pipe shares the accelerated transformer: its ControlNet gets the
    transformer's scopes from this pipeline's accelerate, and its restore removes them, also where the
    pipeline was accelerated again after the transformer's owner restored it."""
    owner = omni_accel.accelerate(omni_accel.tiny_zimage_pipeline(seed=0))
    controlnet = _zimage("ZImageControlNetPipeline").controlnet
    sibling = omni_accel.accelerate(
        diffusers.ZImageControlNetPipeline.from_pipe(owner, controlnet=controlnet)
    )
    assert (
        omni_accel.describe(sibling).components[0].holders[0].endswith("they run natively in its forward too")
    )
    held = dict(omni_accel.patches.applied())
    omni_accel.restore(owner)
    omni_accel.accelerate(sibling)  # it now sets up the transformer itself
    assert len(vars(controlnet)[scoped_calls.SCOPES]) == 2  # the runtime bound, the forwards marked
    omni_accel.restore(sibling)
    assert scoped_calls.SCOPES not in vars(controlnet)
    patch = ("scoped_calls", type(controlnet))
    assert omni_accel.patches.applied().get(patch, 0) == held[patch] - 1


def _zimage_controlnet_over_two_ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    call = dict(control_image=_CONTROL, **_ZIMAGE_CFG)
    one = _latents(_zimage("ZImageControlNetPipeline"), call)
    # tp: the refiners the ControlNet calls are split over the ranks (they raised, run by Diffusers' forward);
    # cfg: the residuals, padded over the whole stacked batch, did not fit half of it (a shape error)
    for layout in (ParallelConfig(tp=2), ParallelConfig(cfg=2)):
        pipe = omni_accel.accelerate(_zimage("ZImageControlNetPipeline"), parallel=layout)
        got = _latents(pipe, call)
        assert all(rel_err(g, e) <= 1e-5 for g, e in zip(got, one, strict=True)), layout
        assert omni_accel.describe(pipe).components[0].runtime.fallbacks == {}, layout


@pytest.mark.multirank
def test_zimage_controlnet_pipeline_over_two_ranks():
    from multirank import run_multirank

    run_multirank(_zimage_controlnet_over_two_ranks, 2, timeout=300)
