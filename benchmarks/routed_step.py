"""Routed models (no native blocks: Diffusers' module, attention through our providers) against plain
Diffusers, one forward each, interleaved in one process, random bf16 weights, 1024x1024: Qwen-Image (20B
architecture) with a padded text mask and without, and SD3.5-large (8B architecture, no mask).

    python benchmarks/routed_step.py --out routed.json
    python benchmarks/routed_step.py --models sd3
"""

from __future__ import annotations

import argparse
import json

import torch
from diffusers import QwenImageTransformer2DModel, SD3Transformer2DModel
from flux_step import rel_err
from random_models import randomized
from timing import interleaved, write_json

import omni_accel

SD35_LARGE = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
)
MODELS = {"qwenimage": (QwenImageTransformer2DModel, {}), "sd3": (SD3Transformer2DModel, SD35_LARGE)}


def _random(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    cls, config = MODELS[name]
    torch.manual_seed(0)
    with torch.device(device):
        return randomized(cls(**config), dtype)


class _Holder(omni_accel.api.DiffusionPipeline):
    def __init__(self, transformer) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def _sd3_inputs(device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator(device).manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 16, 128, 128, generator=g, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(1, 333, 4096, generator=g, device=device, dtype=dtype),
        pooled_projections=torch.randn(1, 2048, generator=g, device=device, dtype=dtype),
        timestep=torch.full((1,), 500.0, device=device, dtype=dtype),
        return_dict=False,
    )


def _qwen_inputs(device: str, dtype: torch.dtype, text: int, valid: int) -> dict:
    g = torch.Generator(device).manual_seed(1)
    mask = torch.zeros(1, text, device=device, dtype=torch.long)
    mask[:, :valid] = 1
    return dict(
        hidden_states=torch.randn(1, 4096, 64, generator=g, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(1, text, 3584, generator=g, device=device, dtype=dtype),
        encoder_hidden_states_mask=mask,
        timestep=torch.full((1,), 0.5, device=device, dtype=dtype),
        img_shapes=[(1, 64, 64)],
        return_dict=False,
    )


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.models:
        plain = _random(name, device, dtype)
        routed = omni_accel.accelerate(_Holder(_random(name, device, dtype)))
        if name == "qwenimage":
            cases = {
                "qwenimage_padded_mask": _qwen_inputs(device, dtype, 512, 300),
                "qwenimage_full_mask": _qwen_inputs(device, dtype, 512, 512),
            }
        else:
            cases = {"sd3_no_mask": _sd3_inputs(device, dtype)}
        results.update(_compare(plain, routed, cases, device, args))
        results[f"{name}_report"] = str(omni_accel.describe(routed))
        print(results[f"{name}_report"])
        del plain, routed
        torch.cuda.empty_cache()
    write_json(results, args.out)
    return results


def _compare(plain, routed, cases: dict, device: str, args) -> dict:
    results = {}
    for case, x in cases.items():
        variants = {
            "diffusers": lambda x=x: plain(**x)[0],
            "omni_routed": lambda x=x: routed.transformer(**x)[0],
        }
        outputs = {name: fn() for name, fn in variants.items()}
        stats = interleaved(variants, device, args.rounds, args.calls)
        medians = {name: stat["median_ms"] for name, stat in stats.items()}
        results[case] = {
            "diffusers_ms": medians["diffusers"],
            "omni_routed_ms": medians["omni_routed"],
            "speedup": medians["diffusers"] / medians["omni_routed"],
            "rel_err": rel_err(outputs["omni_routed"], outputs["diffusers"].float()),
            "bitwise": torch.equal(outputs["omni_routed"], outputs["diffusers"]),
        }
        print(case, json.dumps(results[case]), flush=True)
    return results


if __name__ == "__main__":
    main()
