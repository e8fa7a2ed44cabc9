"""FLUX.2 on the native-model test contract: model-level modulation, SwiGLU MLPs, the single block's QKV and
MLP input as one linear read by its parts (and split by them under tp), and the Klein pipelines."""

import pytest
import torch
from conftest import random_flux2_transformer, random_lora, rel_err
from native_contract import NativeContract, _Holder

import omni_accel
from omni_accel import ParallelConfig


def flux2_inputs(module, batch=2, side=4, text=5, seed=1, ids_3d=True):
    """A ``side`` x ``side`` latent and ``text`` prompt tokens, with the (T, H, W, L) position ids
    Flux2Pipeline makes (``[batch, tokens, 4]``; the model also takes ``[tokens, 4]``)."""
    cfg = module.config
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    zeros = torch.zeros(side * side, dtype=torch.long)
    img_ids = torch.stack([zeros, rows.flatten(), cols.flatten(), zeros], dim=-1)
    txt_ids = torch.stack([torch.zeros(text, dtype=torch.long)] * 3 + [torch.arange(text)], dim=-1)
    if ids_3d:
        img_ids, txt_ids = img_ids.expand(batch, -1, -1), txt_ids.expand(batch, -1, -1)
    guidance = torch.full((batch,), 3.5) if cfg.guidance_embeds else None
    return dict(
        hidden_states=torch.randn(batch, side * side, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text, cfg.joint_attention_dim, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=img_ids,
        txt_ids=txt_ids,
        guidance=guidance,
    )


class TestFlux2Contract(NativeContract):
    cases = [
        ({}, dict(batch=2, side=4, text=5)),
        ({"guidance_embeds": False}, dict(batch=1, side=3, text=7, ids_3d=False)),  # Klein: no guidance
        ({"num_attention_heads": 3, "num_layers": 1, "num_single_layers": 3}, dict(batch=2, side=2, text=3)),
    ]
    layouts = [
        (ParallelConfig(cfg=2), {}, None),
        (ParallelConfig(tp=2), {}, None),
        (ParallelConfig(tp=2), {"num_attention_heads": 4}, dict(batch=1, side=3, text=5)),  # tokens uneven
        (ParallelConfig(ulysses=2), {}, dict(batch=2, side=3, text=5)),  # 9 + 5 tokens: uneven
        (ParallelConfig(ring=2), {}, dict(batch=2, side=3, text=5)),
        (ParallelConfig(ring=2), {"guidance_embeds": False}, dict(batch=1, side=4, text=6, ids_3d=False)),
    ]

    make_module = staticmethod(random_flux2_transformer)
    make_inputs = staticmethod(flux2_inputs)


def test_lora_on_the_packed_single_projection_and_restore():
    """An adapter on the single block's one QKV+MLP linear adds to every part of its outputs as peft does."""
    plain, fast = random_flux2_transformer(), random_flux2_transformer()
    holder = omni_accel.accelerate(_Holder(fast))
    inputs = flux2_inputs(plain)
    for module in (plain, fast):
        module.load_lora_adapter(
            random_lora(
                plain,
                [
                    "to_qkv_mlp_proj",
                    "single_transformer_blocks.1.attn.to_out",
                    "ff.linear_in",
                    "add_k_proj",
                    "to_out.0",
                ],
                seed=3,
            ),
            adapter_name="a",
            prefix="transformer",
        )
    with torch.no_grad():
        expected = plain(**inputs, return_dict=False)[0]
        assert rel_err(fast(**inputs, return_dict=False)[0], expected) <= 1e-5
    assert omni_accel.describe(holder).components[0].runtime.fallbacks == {}
    omni_accel.restore(holder)
    with torch.no_grad():
        assert torch.equal(fast(**inputs, return_dict=False)[0], expected)


def test_the_kv_cache_processors_run_diffusers_forward_and_are_counted():
    """Flux2KleinKVPipeline's processors (reference-image K/V kept across steps) are routed per call."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    plain, fast = random_flux2_transformer(), random_flux2_transformer()
    holder = omni_accel.accelerate(_Holder(fast))
    for module in (plain, fast):
        for block in module.transformer_blocks:
            block.attn.set_processor(Flux2KVAttnProcessor())
        for block in module.single_transformer_blocks:
            block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    inputs = flux2_inputs(plain)
    with torch.no_grad():
        assert torch.equal(fast(**inputs, return_dict=False)[0], plain(**inputs, return_dict=False)[0])
    reasons = omni_accel.describe(holder).components[0].runtime.fallbacks
    assert list(reasons) == [
        "the reference-image KV cache of Flux2KleinKVPipeline (its processors) runs in Diffusers"
    ]


def _images(pipe, **call):
    call = {"prompt": "a cat", "num_inference_steps": 2, "output_type": "latent", **call}
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


def test_klein_kv_pipeline_counts_every_block_call_it_leaves_to_diffusers():
    """Flux2KleinKVPipeline with a reference image: its first step extracts the reference K/V under a
    modulation per token, the later ones reuse it; each block call runs Diffusers' forward and is counted
    with its reason (none silently), and the result is plain Diffusers'."""
    import PIL.Image
    from diffusers import Flux2KleinKVPipeline

    def kv_pipeline() -> Flux2KleinKVPipeline:
        klein = omni_accel.tiny_flux2_klein_pipeline(seed=0, is_distilled=True)
        pipe = Flux2KleinKVPipeline(**{k: v for k, v in klein.components.items() if k != "is_distilled"})
        pipe.set_progress_bar_config(disable=True)
        return pipe

    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    call = dict(image=PIL.Image.fromarray(pixels.numpy()), height=32, width=32, num_inference_steps=3)
    plain, fast = kv_pipeline(), omni_accel.accelerate(kv_pipeline())
    assert torch.equal(_images(fast, **call), _images(plain, **call))
    blocks = len(fast.transformer.transformer_blocks) + len(fast.transformer.single_transformer_blocks)
    reasons = omni_accel.describe(fast).components[0].runtime.fallbacks
    assert reasons == {
        "the reference-image KV cache of Flux2KleinKVPipeline (its processors) runs in Diffusers": 3 * blocks
    }


@pytest.mark.parametrize(
    "distilled, call",
    [(True, {}), (False, {"guidance_scale": 4.0}), (False, {"prompt": ["a cat", "a dog"]})],
    ids=["distilled", "cfg", "batch"],
)
def test_tiny_flux2_klein_pipeline_native_matches_diffusers(distilled, call):
    plain = omni_accel.tiny_flux2_klein_pipeline(seed=0, is_distilled=distilled)
    fast = omni_accel.accelerate(omni_accel.tiny_flux2_klein_pipeline(seed=0, is_distilled=distilled))
    component = omni_accel.describe(fast).components[0]
    assert component.mode == "native"
    assert rel_err(_images(fast, **call), _images(plain, **call)) <= 1e-5
    assert component.runtime.fallbacks == {}


def test_cfg_pairs_only_where_klein_calls_twice():
    from omni_accel.models.flux2 import cfg_pairs

    distilled = omni_accel.tiny_flux2_klein_pipeline(seed=0, is_distilled=True)
    base = omni_accel.tiny_flux2_klein_pipeline(seed=0, is_distilled=False)
    assert cfg_pairs({"self": base}) and cfg_pairs({"self": base, "guidance_scale": 2.0})
    assert not cfg_pairs({"self": base, "guidance_scale": 1.0})
    assert not cfg_pairs({"self": distilled})


def test_klein_inpaint_pipeline_shares_the_native_transformer():
    from diffusers import Flux2KleinInpaintPipeline

    plain = omni_accel.tiny_flux2_klein_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_flux2_klein_pipeline(seed=0))
    g = torch.Generator().manual_seed(2)
    extra = dict(
        image=torch.rand(1, 3, 32, 32, generator=g),
        mask_image=(torch.rand(1, 1, 32, 32, generator=g) > 0.5).float(),
        strength=0.9,
        height=32,
        width=32,
    )
    got = _images(omni_accel.accelerate(Flux2KleinInpaintPipeline.from_pipe(fast)), **extra)
    expected = _images(Flux2KleinInpaintPipeline.from_pipe(plain), **extra)
    assert rel_err(got, expected) <= 1e-5


def _klein_over_two_ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    guided = {"guidance_scale": 4.0}  # Klein (not distilled): two transformer calls per step
    one = _images(omni_accel.accelerate(omni_accel.tiny_flux2_klein_pipeline(seed=0)), **guided)
    layouts = [
        (ParallelConfig(cfg=2), "2 paired cond/uncond calls"),  # one branch per rank
        (ParallelConfig(ulysses=2), "2 cond/uncond pairs in one call"),  # both branches stacked, split
    ]
    for layout, expect in layouts:
        pipe = omni_accel.accelerate(omni_accel.tiny_flux2_klein_pipeline(seed=0), parallel=layout)
        assert rel_err(_images(pipe, **guided), one) <= 1e-5, layout
        assert expect in str(omni_accel.describe(pipe)), (layout, str(omni_accel.describe(pipe)))


@pytest.mark.multirank
def test_klein_guidance_pairs_over_two_ranks():
    from multirank import run_multirank

    run_multirank(_klein_over_two_ranks, 2, timeout=300)


def test_blocks_compile_by_default_on_cuda_only(monkeypatch):
    """FLUX.2's math leaves its SwiGLU to the compiler: on CUDA its blocks compile unless compile=False
    (checked at accelerate, CUDA reported present); FLUX.1's fused kernels need no compiler."""
    from conftest import random_flux_transformer

    def detail(module, **options):
        return (
            omni_accel.describe(omni_accel.accelerate(_Holder(module), cuda_graphs=False, **options))
            .components[0]
            .detail
        )

    assert "repeated blocks compiled" not in detail(random_flux2_transformer())  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "repeated blocks compiled" in detail(random_flux2_transformer())
    assert "repeated blocks compiled" not in detail(random_flux2_transformer(), compile=False)
    assert "repeated blocks compiled" not in detail(random_flux_transformer())
