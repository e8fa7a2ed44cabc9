"""FLUX's VAE (AutoencoderKL: decode and encode at --size) and Wan 2.1's (decode and encode of --frames
frames at 480x832), random weights, run whole on every rank vs split over the ranks by rows (omni_accel's
patch-parallel VAE), in one torchrun launch: seconds per call and the split result's distance from the
whole one.

    torchrun --nproc-per-node 2 benchmarks/vae_parallel.py --size 2048 --frames 81 --out vae.json
    torchrun --nproc-per-node 2 benchmarks/vae_parallel.py --tiny          # CPU, gloo: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, AutoencoderKLWan
from timing import timed, write_json

import omni_accel.models.wan  # noqa: F401  (teaches the row split Wan's VAE layers)
from omni_accel.models.random_pipelines import FLUX_DEV_VAE
from omni_accel.parallel.vae import RowSplit

TINY_VAE = dict(FLUX_DEV_VAE, block_out_channels=(8, 16, 32, 32), norm_num_groups=4, layers_per_block=1)


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="image side in pixels")
    parser.add_argument("--frames", type=int, default=81, help="Wan video frames (0: skip Wan)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.tiny:
        dist.init_process_group("gloo")
        device, dtype, config, args.size = "cpu", torch.float32, TINY_VAE, 64
        wan_config, args.frames, video = {"base_dim": 8}, min(args.frames, 5), (32, 48)
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, dtype, config = f"cuda:{os.environ['LOCAL_RANK']}", torch.bfloat16, FLUX_DEV_VAE
        wan_config, video = {}, (480, 832)
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKL(**config).to(dtype).eval()
    g = torch.Generator(device).manual_seed(1)
    latents = torch.randn(1, 16, args.size // 8, args.size // 8, generator=g, device=device, dtype=dtype)
    image = torch.randn(1, 3, args.size, args.size, generator=g, device=device, dtype=dtype)
    calls = {
        "flux_decode": (vae.decoder, lambda: vae.decode(latents).sample),
        "flux_encode": (vae.encoder, lambda: vae.encode(image).latent_dist.parameters),
    }
    if args.frames:
        with torch.device(device):
            wan = AutoencoderKLWan(**wan_config).to(dtype).eval()
        frames = (args.frames - 1) // 4 + 1
        wan_latents = torch.randn(
            1, 16, frames, video[0] // 8, video[1] // 8, generator=g, device=device, dtype=dtype
        )
        video_in = torch.randn(1, 3, args.frames, *video, generator=g, device=device, dtype=dtype)
        calls["wan_decode"] = (wan.decoder, lambda: wan.decode(wan_latents).sample)
        calls["wan_encode"] = (wan.encoder, lambda: wan.encode(video_in).latent_dist.parameters)
    results = {
        "world_size": dist.get_world_size(),
        "size": args.size,
        "frames": args.frames,
        "dtype": str(dtype),
    }
    for name, (coder, call) in calls.items():
        row_split = RowSplit(coder, dist.group.WORLD)
        outputs, times = {}, {}
        for mode in ("whole", "split"):
            if mode == "split":
                row_split.install()
            outputs[mode] = call()  # warm-up
            dist.barrier()
            times[mode] = statistics.median(timed(call, device)[1] for _ in range(args.repeats)) / 1000
            row_split.uninstall()
        whole, split = outputs["whole"].float(), outputs["split"].float()
        results[name] = {
            "whole_s": times["whole"],
            "split_s": times["split"],
            "speedup": times["whole"] / times["split"],
            "rel_err_split_vs_whole": ((split - whole).abs().max() / whole.abs().max()).item(),
        }
        if dist.get_rank() == 0:
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    if dist.get_rank() == 0:
        write_json(results, args.out)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
