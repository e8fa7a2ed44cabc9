"""Per-step transformer time of FLUX.1-dev (full size, random weights, bf16): Diffusers vs omni_accel.

Both run in one process on the same weights: Diffusers' module first, then the same pipeline accelerated
(the native model takes over the weights, so memory holds one copy). Median of warm runs, CUDA events.

    python benchmarks/flux_step.py --providers auto sdpa flashinfer sage --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from timing import median_ms

import omni_accel

FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


def build_transformer(device: str, dtype: torch.dtype, seed: int = 0) -> FluxTransformer2DModel:
    """Random weights drawn on the GPU (a CPU init of 12B parameters takes minutes)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = FluxTransformer2DModel(**FLUX_DEV).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


def inputs(batch: int, image_tokens: int, text_tokens: int, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator(device).manual_seed(1)
    side = int(image_tokens**0.5)
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"),
        -1,
    ).reshape(-1, 3)
    return dict(
        hidden_states=torch.randn(batch, image_tokens, 64, generator=g, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, 4096, generator=g, device=device, dtype=dtype),
        pooled_projections=torch.randn(batch, 768, generator=g, device=device, dtype=dtype),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device, dtype=dtype),
        img_ids=img_ids.to(device),
        txt_ids=torch.zeros(text_tokens, 3, device=device),
        return_dict=False,
    )


@torch.no_grad()
def time_calls(fn, warmup: int, runs: int) -> dict:
    return median_ms(fn, "cuda", warmup, runs)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--providers", nargs="+", default=["auto"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16

    model = build_transformer(device, dtype)
    x = inputs(args.batch, args.image_tokens, args.text_tokens, device, dtype)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": vars(args)}
    results["diffusers_default"] = time_calls(lambda: model(**x), args.warmup, args.runs)
    reference = model(**x)[0].float()
    model.set_attention_backend("_native_cudnn")
    results["diffusers_cudnn"] = time_calls(lambda: model(**x), args.warmup, args.runs)
    cudnn_out = model(**x)[0].float()
    model.reset_attention_backend()
    scale = reference.abs().max().item()
    results["diffusers_flash_vs_cudnn_rel_err"] = (cudnn_out - reference).abs().max().item() / scale

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=model,
    )
    omni_accel.accelerate(pipe)
    for provider in args.providers:
        with omni_accel.attention_scope(default=provider):
            key = f"omni_accel_{provider}"
            results[key] = time_calls(lambda: pipe.transformer(**x), args.warmup, args.runs)
            out = pipe.transformer(**x)[0].float()
            results[key]["rel_err_vs_diffusers_default"] = (out - reference).abs().max().item() / scale
    results["report"] = str(omni_accel.describe(pipe))
    base = results["diffusers_default"]["median_ms"]
    for key, value in results.items():
        if isinstance(value, dict) and "median_ms" in value:
            print(f"{key:28s} {value['median_ms']:8.1f} ms/step  x{base / value['median_ms']:.2f}  {value}")
    print(results["report"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
