"""Z-Image on the native-model test contract: its refiners and main layers (one block class, with and
without modulation), per-sample RoPE tables, the padding of shorter captions as a key mask, and cond and
uncond stacked in one call as ZImagePipeline makes them."""

import pytest
import torch
from conftest import random_lora, random_zimage_transformer, rel_err
from native_contract import NativeContract, _Holder

import omni_accel
from omni_accel import ParallelConfig


def zimage_inputs(module, batch=2, side=4, captions=(5,), seed=1, controlnet=False):
    """``batch`` latents of ``side`` x ``side`` patches (2x2 patches of a ``2 side`` latent) and captions of
    the given lengths (cycled over the samples: unequal lengths pad, and the model masks the padding)."""
    cfg = module.config
    g = torch.Generator().manual_seed(seed)
    lengths = [captions[i % len(captions)] for i in range(batch)]
    extra = {}
    if controlnet:  # a residual after the first layer, over the unified sequence (image then caption)
        tokens = _padded(side * side) + _padded(max(lengths))
        extra["controlnet_block_samples"] = {0: torch.randn(batch, tokens, cfg.dim, generator=g)}
    return dict(
        **extra,
        x=[torch.randn(cfg.in_channels, 1, 2 * side, 2 * side, generator=g) for _ in range(batch)],
        t=torch.rand(batch, generator=g),
        cap_feats=[torch.randn(n, cfg.cap_feat_dim, generator=g) for n in lengths],
    )


def _padded(tokens: int) -> int:
    """Z-Image pads its image and caption tokens to multiples of 32."""
    return -(-tokens // 32) * 32


def _stacked(outputs) -> torch.Tensor:
    return torch.stack(list(outputs)) if isinstance(outputs, list | tuple) else outputs


class TestZImageContract(NativeContract):
    cases = [
        ({}, dict(batch=2, side=4, captions=(5,))),
        ({}, dict(batch=2, side=2, captions=(40, 7))),  # captions padded to 64 and 32: a key mask
        ({"n_heads": 4, "axes_dims": [4, 4, 4]}, dict(batch=1, side=3, captions=(33,))),
    ]
    layouts = [
        (ParallelConfig(cfg=2), {}, None),
        (ParallelConfig(tp=2), {}, None),
        (ParallelConfig(tp=2), {}, dict(batch=2, side=2, captions=(40, 7))),
        (ParallelConfig(ulysses=2), {}, None),
        (ParallelConfig(ulysses=2), {}, dict(batch=2, side=2, captions=(40, 7))),  # masked
        (ParallelConfig(ring=2), {}, dict(batch=2, side=3, captions=(40, 7))),  # 9 image tokens pad to 32
        (ParallelConfig(ring=2), {}, dict(batch=1, side=3, captions=(5,), controlnet=True)),
    ]

    make_module = staticmethod(random_zimage_transformer)
    make_inputs = staticmethod(zimage_inputs)


def test_lora_and_restore():
    plain, fast = random_zimage_transformer(), random_zimage_transformer()
    holder = omni_accel.accelerate(_Holder(fast))
    inputs = zimage_inputs(plain, captions=(40, 7))
    lora = random_lora(plain, ["to_q", "w3", "attention.to_out.0", "layers.0.adaLN_modulation.0"], seed=3)
    for module in (plain, fast):
        module.load_lora_adapter(lora, adapter_name="a", prefix="transformer")
    with torch.no_grad():
        expected = _stacked(plain(**inputs, return_dict=False)[0])
        assert rel_err(_stacked(fast(**inputs, return_dict=False)[0]), expected) <= 1e-5
    assert omni_accel.describe(holder).components[0].runtime.fallbacks == {}
    omni_accel.restore(holder)
    with torch.no_grad():
        assert torch.equal(_stacked(fast(**inputs, return_dict=False)[0]), expected)


def _images(pipe, **call):
    # ZImagePipeline applies its chat template to a prompt list in place: each call gets its own list
    call = {k: list(v) if isinstance(v, list) else v for k, v in call.items()}
    call = {
        "prompt": "a cat",
        "num_inference_steps": 2,
        "output_type": "latent",
        "height": 32,
        "width": 32,
        **call,
    }
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize(
    "call",
    [
        {"guidance_scale": 0.0},
        {"guidance_scale": 5.0, "negative_prompt": "a blurry picture of many things"},  # stacked, masked
        {"prompt": ["a cat", "a much longer prompt about a dog in the rain"], "guidance_scale": 0.0},
    ],
    ids=["plain", "cfg", "batch"],
)
def test_tiny_zimage_pipeline_native_matches_diffusers(call):
    plain = omni_accel.tiny_zimage_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_zimage_pipeline(seed=0))
    component = omni_accel.describe(fast).components[0]
    assert component.mode == "native"
    assert rel_err(_stacked(_images(fast, **call)), _stacked(_images(plain, **call))) <= 1e-5
    assert component.runtime.fallbacks == {}


def _zimage_over_two_ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    guided = {"guidance_scale": 5.0, "negative_prompt": "a blurry picture of many things"}
    one = _stacked(_images(omni_accel.accelerate(omni_accel.tiny_zimage_pipeline(seed=0)), **guided))
    for layout, expect in [
        (ParallelConfig(cfg=2), "cfg parallel: 2 batch-split calls"),  # cond and uncond: one per rank
        (ParallelConfig(ring=2), "ring"),
    ]:
        pipe = omni_accel.accelerate(omni_accel.tiny_zimage_pipeline(seed=0), parallel=layout)
        assert rel_err(_stacked(_images(pipe, **guided)), one) <= 1e-5, layout
        assert expect in str(omni_accel.describe(pipe)), (layout, str(omni_accel.describe(pipe)))


@pytest.mark.multirank
def test_zimage_pipeline_over_two_ranks():
    from multirank import run_multirank

    run_multirank(_zimage_over_two_ranks, 2, timeout=300)
