"""Text-to-image with and without omni_accel: same prompt, same seed, then parity, speed and the report.

    python examples/text_to_image.py                       # tiny offline FLUX pipeline, random weights
    python examples/text_to_image.py --model <hub id or local dir> --dtype bfloat16 --output out.png
    python examples/text_to_image.py --model tiny-wan --frames 5 --height 32 --width 32 --output out.gif
    python examples/text_to_image.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --frames 33 --output out.gif
    torchrun --nproc-per-node 2 examples/text_to_image.py --ulysses 2      # the transformer over 2 ranks
    torchrun --nproc-per-node 2 examples/text_to_image.py --model random-flux-dev --dtype bfloat16 \
        --steps 28 --tp 2    # FLUX.1-dev's full architecture with random weights, offline (GPUs)

The plain Diffusers run goes first, so its numbers are untouched by acceleration; then the very same
pipeline object is accelerated in place and called the very same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline

import omni_accel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (image max |diff| in [0, 1] pixel units, latents relative L2 error) that counts as "same output".
# float32 must match to rounding. In half precision every kernel rounds differently and the error is carried
# through all denoising steps, so only closeness is expected: the tiny FLUX pipeline on an H200 in bfloat16
# differs by about 1e-2 (image) and 5e-3 (latents), a tenth of these bounds.
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 5e-2), torch.float16: (2e-2, 2e-2)}
Outputs = tuple[np.ndarray, torch.Tensor]  # decoded images in [0, 1], latents on the CPU in float32


def build_parser() -> argparse.ArgumentParser:
    """Options that change what is generated first, then one group per part of omni_accel being driven."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        help="hub id or local dir, or tiny-flux / tiny-wan (offline, random weights), or random-flux-dev "
        "(FLUX.1-dev's full size, random weights, built on the GPU); default: tiny-flux",
    )
    parser.add_argument("--frames", type=int, help="video pipelines (Wan): frames to generate (4k+1)")
    parser.add_argument("--prompt", default="a photo of an astronaut riding a horse on the moon")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's own)")
    parser.add_argument("--height", type=int, help="default: the pipeline's own")
    parser.add_argument("--width", type=int, help="default: the pipeline's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--negative-prompt", help="for pipelines with true CFG (with --true-cfg-scale)")
    parser.add_argument("--true-cfg-scale", type=float, help="passed to pipelines that take it")
    parser.add_argument("--device", default=_default_device())
    parser.add_argument("--runs", type=int, default=3, help="timed calls per pipeline, after one warm-up")
    parser.add_argument(
        "--output", help="save the accelerated image (PNG) or video (GIF, or MP4 with imageio)"
    )
    accel = parser.add_argument_group("omni_accel")
    accel.add_argument("--attention", default="auto", choices=["auto", *omni_accel.provider_names()])
    parallel = parser.add_argument_group(
        "parallel (launch with torchrun; the degrees multiply to its world size)"
    )
    for degree in ("tp", "ulysses", "ring", "cfg"):
        parallel.add_argument(f"--{degree}", type=int, default=1)
    return parser


def _default_device() -> str:
    """Each torchrun rank takes its own GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}"


def accelerate_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command line tells ``omni_accel.accelerate``."""
    kwargs: dict[str, Any] = {"attention": args.attention}
    degrees = {d: getattr(args, d) for d in ("tp", "ulysses", "ring", "cfg")}
    if any(v > 1 for v in degrees.values()):
        kwargs["parallel"] = omni_accel.ParallelConfig(**degrees)
    return kwargs


def load_pipeline(args: argparse.Namespace) -> DiffusionPipeline:
    """A real checkpoint, or the tiny random-weight pipeline so the example runs offline and in seconds."""
    dtype = DTYPES[args.dtype]
    tiny = {None: omni_accel.tiny_flux_pipeline, "tiny-flux": omni_accel.tiny_flux_pipeline}
    tiny["tiny-wan"] = omni_accel.tiny_wan_pipeline
    if args.model in tiny:
        return tiny[args.model](seed=0, dtype=dtype, device=args.device)
    if args.model == "random-flux-dev":
        return omni_accel.random_flux_dev_pipeline(seed=0, dtype=dtype, device=args.device)
    pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
    pipe.set_progress_bar_config(disable=True)  # the bars would interleave with the measurements
    return pipe


def generate(pipe: DiffusionPipeline, args: argparse.Namespace, output_type: str) -> Any:
    """One call with a fresh generator, so every call starts from the same noise.

    Only the options given on the command line are passed; the rest stay the pipeline's defaults. The
    generator lives on the CPU so the noise is the same on every device.
    """
    options = {
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "negative_prompt": args.negative_prompt,
        "true_cfg_scale": args.true_cfg_scale,
        "num_frames": args.frames,
    }
    result = pipe(
        prompt=args.prompt,
        generator=torch.Generator("cpu").manual_seed(args.seed),
        output_type=output_type,
        **{name: value for name, value in options.items() if value is not None},
    )
    return result.frames if hasattr(result, "frames") else result.images


def measure(pipe: DiffusionPipeline, args: argparse.Namespace) -> tuple[Outputs, float]:
    """The outputs of one call and the median seconds per call.

    The warm-up call is not timed: it pays one-off costs (kernel selection, allocator growth, lazy imports)
    that a serving process pays once. CUDA runs asynchronously, so the clock is read only after a sync.
    """
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else lambda: None
    generate(pipe, args, "np")
    seconds = []
    for _ in range(args.runs):
        sync()
        start = time.perf_counter()
        images = generate(pipe, args, "np")
        sync()
        seconds.append(time.perf_counter() - start)
    latents = generate(pipe, args, "latent").float().cpu()
    return (images, latents), statistics.median(seconds)


def compare(plain: Outputs, accelerated: Outputs) -> dict[str, float]:
    """Differences of the decoded images (what users see) and of the latents (what the denoiser produced).

    Latents are compared too because the VAE decode and the clip to [0, 1] can hide the denoiser's errors.
    """
    (plain_images, plain_latents), (images, latents) = plain, accelerated
    return {
        "image_max_abs_diff": float(np.abs(images - plain_images).max()),
        "latent_max_abs_diff": float((latents - plain_latents).abs().max()),
        "latent_rel_err": float((latents - plain_latents).norm() / plain_latents.norm()),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs plain, then accelerated, prints the comparison and returns the measured numbers."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    pipe = load_pipeline(args)
    plain, plain_s = measure(pipe, args)

    omni_accel.accelerate(pipe, **accelerate_kwargs(args))
    accelerated, accel_s = measure(pipe, args)

    result: dict[str, Any] = compare(plain, accelerated)
    image_tol, latent_tol = TOLERANCES[DTYPES[args.dtype]]
    result["within_tolerance"] = (
        result["image_max_abs_diff"] <= image_tol and result["latent_rel_err"] <= latent_tol
    )
    result.update(plain_s=plain_s, accelerated_s=accel_s, speedup=plain_s / accel_s)

    if not omni_accel.is_main_process():  # every rank holds the same result: rank 0 reports and saves
        return result
    offline = {None: "tiny", "tiny-flux": "tiny", "tiny-wan": "tiny", "random-flux-dev": "full size"}
    source = f"{offline[args.model]}, offline, random weights" if args.model in offline else args.model
    print(f"pipeline: {type(pipe).__name__} ({source}), {args.dtype} on {args.device}")
    verdict = "OK" if result["within_tolerance"] else "OUT OF TOLERANCE"
    print(f"parity, {args.dtype} tolerance: image {image_tol:g}, latents rel {latent_tol:g} -> {verdict}")
    print(f"  image   max |diff| = {result['image_max_abs_diff']:.3g}")
    print(
        f"  latents max |diff| = {result['latent_max_abs_diff']:.3g}, rel L2 err = {result['latent_rel_err']:.3g}"
    )
    timing = (
        f"time per call (median of {args.runs}, warm-up excluded): plain {plain_s * 1e3:.1f} ms, "
        f"accelerated {accel_s * 1e3:.1f} ms"
    )
    if str(args.device).startswith("cuda"):
        print(f"{timing}, speedup {result['speedup']:.2f}x")
    else:  # toy sizes on a CPU: launch and Python overheads, nothing the GPU paths are built for
        print(f"{timing} (on a CPU these timings mean nothing: this run shows parity; speed is a GPU matter)")
    print(omni_accel.describe(pipe))
    if args.output:
        save(accelerated[0], args.output)
        print(f"saved {args.output}")
    return result


def save(outputs: np.ndarray, path: str) -> None:
    """The first image (``[B, H, W, C]``) as a picture, or the first video (``[B, F, H, W, C]``) as a GIF
    (or an MP4 through Diffusers' exporter, which needs imageio or OpenCV)."""
    if outputs.ndim == 4:
        DiffusionPipeline.numpy_to_pil(outputs)[0].save(path)
    elif path.endswith(".mp4"):
        from diffusers.utils import export_to_video

        export_to_video(list(outputs[0]), path, fps=16)
    else:
        frames = DiffusionPipeline.numpy_to_pil(outputs[0])
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=1000 // 16, loop=0)


if __name__ == "__main__":
    main()
