"""Routed models (no native blocks: Diffusers' module, attention through our providers) against plain
Diffusers, one forward each, interleaved in one process: Qwen-Image (20B architecture) with a padded text
mask and without, random bf16 weights, 1024x1024.

    python benchmarks/routed_step.py --out routed.json
"""

from __future__ import annotations

import argparse
import json

import torch
from diffusers import QwenImageTransformer2DModel
from flux_step import rel_err
from timing import interleaved, write_json

import omni_accel


def _qwen(device: str, dtype: torch.dtype) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = QwenImageTransformer2DModel().to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


class _Holder(omni_accel.api.DiffusionPipeline):
    def __init__(self, transformer) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def _inputs(device: str, dtype: torch.dtype, text: int, valid: int) -> dict:
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
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    plain = _qwen(device, dtype)
    routed = omni_accel.accelerate(_Holder(_qwen(device, dtype)))
    cases = {"padded_mask": _inputs(device, dtype, 512, 300), "full_mask": _inputs(device, dtype, 512, 512)}
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
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
        print(case, json.dumps(results[case]))
    results["report"] = str(omni_accel.describe(routed))
    print(results["report"])
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
