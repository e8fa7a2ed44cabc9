"""FLUX.1 (dev and schnell) on the native-model test contract."""

import torch
from conftest import flux_inputs, random_flux_transformer
from native_contract import NativeContract

from omni_accel import ParallelConfig


class TestFluxContract(NativeContract):
    cases = [
        ({}, dict(batch=2, image_tokens=12, text_tokens=5)),
        ({"guidance_embeds": True}, dict(batch=1, image_tokens=7, text_tokens=3)),
        (
            {
                "num_attention_heads": 5,
                "attention_head_dim": 8,
                "axes_dims_rope": (2, 2, 4),
                "in_channels": 12,
            },
            dict(batch=3, image_tokens=9, text_tokens=11),
        ),
        (
            {"out_channels": 4, "num_layers": 1, "num_single_layers": 1},
            dict(batch=2, image_tokens=16, text_tokens=1),
        ),
        ({}, dict(batch=2, image_tokens=12, text_tokens=5, controlnet=True)),
    ]
    # 3 heads and 12 + 5 tokens: uneven Ulysses head and sequence splits; tp needs a head count it divides
    layouts = [
        (ParallelConfig(tp=2), {"num_attention_heads": 2}, None),
        (ParallelConfig(ulysses=2), {}, None),
        (ParallelConfig(ring=2), {}, None),
        (ParallelConfig(cfg=2), {}, None),
        (ParallelConfig(ulysses=2), {}, cases[-1][1]),  # controlnet residuals follow the image split
    ]

    make_module = staticmethod(random_flux_transformer)

    @staticmethod
    def make_inputs(module, controlnet=False, **shapes):
        inputs = flux_inputs(module, **shapes)
        if controlnet:  # residuals added to the image stream after double and single blocks
            g = torch.Generator().manual_seed(3)
            batch, tokens, dim = shapes["batch"], shapes["image_tokens"], module.inner_dim
            inputs["controlnet_block_samples"] = [torch.randn(batch, tokens, dim, generator=g)]
            inputs["controlnet_single_block_samples"] = [
                torch.randn(batch, tokens, dim, generator=g) for _ in range(2)
            ]
        return inputs
