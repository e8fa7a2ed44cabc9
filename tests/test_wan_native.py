"""Wan 2.1 / 2.2 on the native-model test contract: T2V, I2V (image K/V), the affine cross-attention
norm, and Wan 2.2 TI2V's per-token timesteps."""

import torch
from conftest import random_lora, random_wan_transformer, random_wan_vace_transformer
from native_contract import NativeContract

import omni_accel
from omni_accel import ParallelConfig


def wan_inputs(module, batch=2, frames=3, side=8, text=7, per_token_timesteps=False, image_tokens=0):
    cfg = module.config
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, side, side, generator=g),
        encoder_hidden_states=torch.randn(batch, text, cfg.text_dim, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000,
    )
    if per_token_timesteps:  # Wan 2.2 TI2V: one timestep per latent token
        tokens = frames * (side // cfg.patch_size[1]) * (side // cfg.patch_size[2])
        inputs["timestep"] = torch.rand(batch, tokens, generator=g) * 1000
    if image_tokens:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, image_tokens, cfg.image_dim, generator=g)
    return inputs


class TestWanContract(NativeContract):
    cases = [
        ({}, dict(batch=2, frames=3, side=8, text=7)),
        ({"cross_attn_norm": True, "num_attention_heads": 3}, dict(batch=1, frames=2, side=6, text=5)),
        (
            {"image_dim": 20, "added_kv_proj_dim": 32},
            dict(batch=2, frames=2, side=4, text=512, image_tokens=9),
        ),
        ({}, dict(batch=2, frames=2, side=4, text=7, per_token_timesteps=True)),
    ]
    layouts = [
        (ParallelConfig(cfg=2), {}, None),
        (ParallelConfig(tp=2), {}, None),  # heads split: the QK RMSNorm reduces across the ranks
        (ParallelConfig(tp=2), {"cross_attn_norm": True}, None),
        (ParallelConfig(tp=2), {"image_dim": 20, "added_kv_proj_dim": 32}, cases[2][1]),  # I2V
        (ParallelConfig(tp=2), {}, cases[3][1]),  # per-token timesteps
        # 27 tokens: under tp each rank norms and gates its share (14 and 13) between the projections
        (ParallelConfig(tp=2), {}, dict(batch=1, frames=3, side=6, text=5, per_token_timesteps=True)),
        # 3 frames x 3 x 3 patches = 27 tokens: uneven over 2 ranks; the text K/V stay whole on each rank
        (ParallelConfig(ulysses=2), {"num_attention_heads": 3}, dict(batch=2, frames=3, side=6, text=7)),
        (ParallelConfig(ring=2), {}, dict(batch=2, frames=3, side=6, text=7)),
        (ParallelConfig(ulysses=2), {"image_dim": 20, "added_kv_proj_dim": 32}, cases[2][1]),  # I2V
        (ParallelConfig(ring=2), {}, dict(batch=1, frames=3, side=6, text=5, per_token_timesteps=True)),
    ]

    make_module = staticmethod(random_wan_transformer)
    make_inputs = staticmethod(wan_inputs)


def wan_vace_inputs(module, control_frames=None, **shapes):
    """Wan's inputs plus VACE's control latents (fewer frames than the video: padded with zero tokens) and a
    scale per control layer."""
    inputs = wan_inputs(module, **shapes)
    batch, _, frames, height, width = inputs["hidden_states"].shape
    cfg = module.config
    g = torch.Generator().manual_seed(2)
    control = torch.randn(batch, cfg.vace_in_channels, control_frames or frames, height, width, generator=g)
    scales = torch.linspace(0.5, 1.5, len(cfg.vace_layers))
    return dict(inputs, control_hidden_states=control, control_hidden_states_scale=scales)


class TestWanVACEContract(NativeContract):
    cases = [
        ({}, dict(batch=2, frames=3, side=8, text=7)),
        ({"cross_attn_norm": False, "num_attention_heads": 3}, dict(batch=1, frames=3, side=6, text=5)),
        ({}, dict(batch=1, frames=3, side=4, text=5, control_frames=2)),
    ]
    layouts = [
        (ParallelConfig(cfg=2), {}, None),
        (ParallelConfig(tp=2), {}, None),
        # 27 tokens: uneven over 2 ranks; the control stream splits with the video tokens
        (ParallelConfig(ulysses=2), {"num_attention_heads": 3}, dict(batch=2, frames=3, side=6, text=7)),
        (ParallelConfig(ring=2), {}, dict(batch=1, frames=3, side=6, text=5, control_frames=2)),
    ]

    make_module = staticmethod(random_wan_vace_transformer)
    make_inputs = staticmethod(wan_vace_inputs)


def test_tiny_wan_pipeline_native_matches_diffusers_with_cfg():
    kwargs = dict(prompt="a cat", negative_prompt="blurry", guidance_scale=5.0, height=32, width=32)
    kwargs.update(num_frames=5, num_inference_steps=2, output_type="latent")
    plain = omni_accel.tiny_wan_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))
    expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    got = fast(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(got, expected)  # the same ops in the same order
    assert omni_accel.describe(fast).components[0].mode == "native"


def test_wan_cast_to_bfloat16_after_accelerate_matches_diffusers():
    """``pipe.to(torch.bfloat16)`` casts Wan's RoPE tables too, and Diffusers then rotates in bfloat16:
    the native blocks rotate in the tables' dtype as well (bitwise Diffusers doing the same cast)."""
    kwargs = dict(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=2)
    plain = omni_accel.tiny_wan_pipeline(seed=0).to(torch.bfloat16)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0)).to(torch.bfloat16)
    assert fast.transformer.rope.freqs_cos.dtype == torch.bfloat16
    expected = plain(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    got = fast(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(got, expected)
    assert omni_accel.describe(fast).components[0].mode == "native"


def test_wan_2_2_two_experts_are_both_native():
    kwargs = dict(prompt="a cat", negative_prompt="blurry", guidance_scale=4.0, height=32, width=32)
    kwargs.update(num_frames=5, num_inference_steps=4, output_type="latent")
    plain = omni_accel.tiny_wan_pipeline(seed=0, two_experts=True)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, two_experts=True))
    expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(fast(**kwargs, generator=torch.Generator().manual_seed(0)).frames, expected)
    report = omni_accel.describe(fast)
    assert [(c.name, c.mode) for c in report.components] == [
        ("transformer", "native"),
        ("transformer_2", "native"),
    ]


def test_wan_lora_runs_inside_the_native_blocks():
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    lora = random_lora(omni_accel.tiny_wan_pipeline(seed=0).transformer, targets, seed=3)
    kwargs = dict(
        prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="latent"
    )
    plain = omni_accel.tiny_wan_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))
    for pipe in (plain, fast):
        pipe.load_lora_weights(dict(lora), adapter_name="style")
        pipe.set_adapters(["style"], [0.6])
    expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    got = fast(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    assert not omni_accel.describe(fast).components[0].runtime.fallbacks  # adapters ran natively


def test_wan_image_to_video_pipeline_runs_native():
    import numpy as np
    from PIL import Image

    plain = omni_accel.tiny_wan_pipeline(seed=0, image_to_video=True)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, image_to_video=True))
    g = torch.Generator().manual_seed(5)
    width = plain.text_encoder.config.d_model
    embeds = dict(
        prompt_embeds=torch.randn(1, 512, width, generator=g),
        negative_prompt_embeds=torch.randn(1, 512, width, generator=g),
    )
    image = Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype("uint8"))
    kwargs = dict(image=image, guidance_scale=4.0, height=32, width=32, num_frames=5, num_inference_steps=2)
    kwargs.update(embeds, output_type="latent")
    expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(fast(**kwargs, generator=torch.Generator().manual_seed(0)).frames, expected)
    assert not omni_accel.describe(fast).components[0].runtime.fallbacks  # image K/V ran natively


def vace_call(pipe) -> dict:
    """A WanVACEPipeline call with guidance (prompt embeddings given: Diffusers' prompt cleaning needs
    ``ftfy``); no control video, so the pipeline conditions on its blank one and the full mask."""
    g = torch.Generator().manual_seed(5)
    width = pipe.text_encoder.config.d_model
    return dict(
        prompt_embeds=torch.randn(1, 512, width, generator=g),
        negative_prompt_embeds=torch.randn(1, 512, width, generator=g),
        guidance_scale=4.0,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        output_type="latent",
    )


def test_wan_vace_pipeline_runs_native():
    plain = omni_accel.tiny_wan_pipeline(seed=0, vace=True)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, vace=True))
    expected = plain(**vace_call(plain), generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(fast(**vace_call(fast), generator=torch.Generator().manual_seed(0)).frames, expected)
    report = omni_accel.describe(fast).components[0]
    assert report.mode == "native" and "(blocks, vace_blocks)" in report.detail
    assert not report.runtime.fallbacks
    # native=False: Diffusers' blocks, their attention routed, the text K/V through the cache
    routed = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, vace=True), native=False)
    got = routed(**vace_call(routed), generator=torch.Generator().manual_seed(0)).frames
    report = omni_accel.describe(routed).components[0]
    assert torch.equal(got, expected) and report.mode == "routed" and report.cache.hits > 0


def test_wan_video_to_video_from_pipe_and_save_pretrained(tmp_path):
    import numpy as np
    from diffusers import WanPipeline, WanVideoToVideoPipeline
    from PIL import Image

    rng = np.random.default_rng(0)
    video = [Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")) for _ in range(5)]
    base = omni_accel.tiny_wan_pipeline(seed=0)
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(
        1, 512, base.text_encoder.config.d_model, generator=g
    )  # (prompt cleaning needs ftfy)
    kwargs = dict(prompt_embeds=embeds, guidance_scale=1.0, video=video, height=32, width=32)
    kwargs.update(num_inference_steps=4, output_type="latent")

    def run(pipe):
        return WanVideoToVideoPipeline.from_pipe(pipe)(
            **kwargs, generator=torch.Generator().manual_seed(0)
        ).frames

    expected = run(base)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))
    assert torch.equal(run(fast), expected)  # the sibling shares the native transformer

    fast.save_pretrained(tmp_path)  # Diffusers' layout: loads without omni_accel
    reloaded = WanPipeline.from_pretrained(tmp_path).transformer.state_dict()
    original = base.transformer.state_dict()
    assert reloaded.keys() == original.keys() and all(torch.equal(reloaded[k], original[k]) for k in original)


def test_diffusers_step_cache_on_native_wan():
    from diffusers import FirstBlockCacheConfig

    kwargs = dict(
        prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4, output_type="latent"
    )
    plain = omni_accel.tiny_wan_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))
    for pipe in (plain, fast):
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(fast(**kwargs, generator=torch.Generator().manual_seed(0)).frames, expected)
    assert not omni_accel.describe(fast).components[0].runtime.fallbacks
