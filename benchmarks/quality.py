"""What a lossy mode costs in image quality, on real weights: the same prompts and seeds through omni_accel
lossless and through ``quantize="fp8"`` (and plain Diffusers, with ``--diffusers``), PSNR and SSIM of the
decoded images against the lossless ones, computed by scikit-image (``pip install scikit-image``).

    python benchmarks/quality.py --model black-forest-labs/FLUX.1-dev --steps 28 --out quality.json
    python benchmarks/quality.py --tiny   # a tiny random FLUX pipeline on the CPU: checks the script runs

Random weights say nothing about quality (their images are noise either way): run it with a checkpoint.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from harness.timing import write_json

import omni_accel

PROMPTS = (
    "a photograph of a red fox in fresh snow, morning light",
    "a watercolour of a lighthouse on a cliff at dusk",
    "a close-up of a mechanical watch movement, macro lens",
    "a busy night market street in the rain, neon signs",
)


def _metrics():
    try:
        from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    except ImportError as error:
        raise SystemExit("benchmarks/quality.py needs scikit-image: pip install scikit-image") from error
    return peak_signal_noise_ratio, structural_similarity


def images(pipe, prompts, seeds, call: dict) -> list[np.ndarray]:
    """One float image in [0, 1] (``H x W x 3``) per prompt and seed."""
    out = []
    for prompt in prompts:
        for seed in seeds:
            generator = torch.Generator("cpu").manual_seed(seed)
            result = pipe(prompt=prompt, generator=generator, output_type="np", **call)
            out.append(np.asarray(result.images[0], dtype=np.float64).clip(0, 1))
    return out


def compare(reference: list[np.ndarray], other: list[np.ndarray]) -> dict:
    psnr, ssim = _metrics()
    psnrs = [psnr(r, o, data_range=1.0) for r, o in zip(reference, other, strict=True)]
    ssims = [ssim(r, o, data_range=1.0, channel_axis=-1) for r, o in zip(reference, other, strict=True)]
    return {
        "psnr_db_median": statistics.median(psnrs),
        "psnr_db_min": min(psnrs),
        "ssim_median": statistics.median(ssims),
        "ssim_min": min(ssims),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Diffusers checkpoint (hub id or path)")
    parser.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--diffusers", action="store_true", help="also compare plain Diffusers with lossless")
    parser.add_argument("--tiny", action="store_true", help="a tiny random FLUX pipeline on the CPU")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    _metrics()  # fail before loading a model
    if args.tiny:
        pipe = omni_accel.tiny_flux_pipeline()
        args.size, args.steps, args.prompts, args.seeds = 32, 2, args.prompts[:1], args.seeds[:1]
    elif args.model:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16).to("cuda")
    else:
        parser.error("give --model (a checkpoint) or --tiny")
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=args.size, width=args.size, num_inference_steps=args.steps)
    results = {"model": args.model or "tiny random FLUX", "call": call, "seeds": args.seeds}

    if args.diffusers:
        plain = images(pipe, args.prompts, args.seeds, call)
    omni_accel.accelerate(pipe)
    lossless = images(pipe, args.prompts, args.seeds, call)
    omni_accel.restore(pipe)
    if args.diffusers:
        results["diffusers_vs_lossless"] = compare(lossless, plain)
    omni_accel.accelerate(pipe, quantize="fp8")
    results["fp8_vs_lossless"] = compare(lossless, images(pipe, args.prompts, args.seeds, call))
    omni_accel.restore(pipe)
    for name, scores in results.items():
        if isinstance(scores, dict) and "psnr_db_median" in scores:
            print(
                f"{name:22s} PSNR median {scores['psnr_db_median']:.2f} dB (min {scores['psnr_db_min']:.2f})"
                f"  SSIM median {scores['ssim_median']:.4f} (min {scores['ssim_min']:.4f})"
            )
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
