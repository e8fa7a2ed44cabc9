"""Wan 2.1 (random weights, bf16) on two GPUs: omni_accel's layouts against one GPU, in one torchrun launch.

Each layout runs the unchanged WanPipeline with CFG on (two transformer calls per step, cond and uncond;
prompt embeddings given, latents out) for a few steps at 480x832, 81 frames; seconds per denoising step
are the call's time over its steps. Every layout's latents are compared with the one-GPU result.

    torchrun --nproc-per-node 2 benchmarks/wan_parallel.py --out wan_parallel.json
    torchrun --nproc-per-node 2 benchmarks/wan_parallel.py --tiny      # CPU, gloo: a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from layout_variants import configured
from random_models import randomized
from timing import timed, write_json
from wan_step import CONFIGS, add_video_arguments, rel_err

import omni_accel
from omni_accel import ParallelConfig

LAYOUTS = {
    "1gpu": None,
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "tp2": ParallelConfig(tp=2),
    "cfg2": ParallelConfig(cfg=2),
}


def _call(pipe, args, device: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(1)
    prompt, negative = (torch.randn(1, 512, 4096, generator=g, device=device, dtype=dtype) for _ in range(2))
    return pipe(
        prompt_embeds=prompt,
        negative_prompt_embeds=negative,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        output_type="latent",
        generator=torch.Generator(device).manual_seed(0),
    ).frames


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_video_arguments(parser)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=list(LAYOUTS),
        help=f"of {list(LAYOUTS)}, each with an optional +variant",
    )
    parser.add_argument("--tiny", action="store_true", help="a two-block model on CPU with gloo")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.tiny:
        dist.init_process_group("gloo")
        device, dtype, config = "cpu", torch.float32, CONFIGS["tiny"]
        args.frames, args.height, args.width = 5, 32, 32
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, dtype, config = f"cuda:{os.environ['LOCAL_RANK']}", torch.bfloat16, CONFIGS[args.model]

    results, oracle = {"gpus": torch.cuda.device_count() or "cpu", "shapes": vars(args)}, None
    for name in args.layouts:
        layout, parallel = configured(name, LAYOUTS)
        torch.manual_seed(0)
        with torch.device(device):
            model = randomized(WanTransformer3DModel(**config), dtype)
        pipe = WanPipeline(None, None, None, FlowMatchEulerDiscreteScheduler(), transformer=model)
        pipe.set_progress_bar_config(disable=True)
        omni_accel.accelerate(pipe, parallel=parallel, compile=args.compile, compile_in_background=False)
        _call(pipe, args, device, dtype)  # warm-up (and compilation)
        dist.barrier()
        latents, ms = timed(lambda pipe=pipe: _call(pipe, args, device, dtype), device)
        oracle = latents if oracle is None else oracle
        results[name] = {
            "s_per_step_with_cfg": ms / 1000 / args.steps,
            "rel_err_vs_1gpu": rel_err(latents, oracle),
        }
        if omni_accel.is_main_process():
            print(f"{name:10s} {json.dumps(results[name])}", flush=True)
        del pipe, model
        gc.collect()  # hooks hold their module in reference cycles
        if device != "cpu":
            torch.cuda.empty_cache()
    single = results[args.layouts[0]]["s_per_step_with_cfg"]
    for name in args.layouts:
        results[name]["speedup_vs_first_layout"] = single / results[name]["s_per_step_with_cfg"]
        if omni_accel.is_main_process():
            print(f"{name:10s} x{results[name]['speedup_vs_first_layout']:.2f} vs {args.layouts[0]}")
    if omni_accel.is_main_process():
        write_json(results, args.out)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
