"""Exact projection cache off vs on, same weights, same run: FLUX.1-dev, Wan 2.1 14B and MiniMax-H3
(random, bf16).

For each model a request of S steps is run twice with the same prompt (CFG: conditional and
unconditional call per step for Wan), first with the cache off, then on: the first request with the cache
on measures the overhead when nothing hits, the second the gain when everything hits. Outputs are
compared bitwise with the cache-off ones. MiniMax-H3 (its cache sites: each block's AdaLN table and the
text refiner's output) runs with ``cuda_graphs=False``, since a replayed step never consults the cache;
its blocks compile (before the timed calls), as they do by default on CUDA.

    python benchmarks/projection_cache.py --out cache.json         # GPU, full size
    python benchmarks/projection_cache.py --tiny                   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    WanPipeline,
    WanTransformer3DModel,
)
from flux_step import FLUX_DEV, inputs
from generic_step import MODELS, Holder
from random_models import WAN_14B, randomized
from timing import timed, write_json

import omni_accel
from omni_accel.config import DEFAULT_PROJECTION_CACHE_BYTES

TINY = {
    "flux": dict(num_layers=2, num_single_layers=2, num_attention_heads=2, joint_attention_dim=4096),
    "wan": dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=64, num_layers=2),
}


def _run_requests(call, steps: list, device: str) -> dict:
    """Two identical requests; per-call times and outputs of each."""
    results = {}
    for request in ("first", "second"):
        times, outputs = [], []
        for step in steps:
            out, ms = timed(lambda s=step: call(s), device)
            times.append(ms)
            outputs.append(out)
        results[request] = (times, outputs)
    return results


def _compare(off: dict, on: dict, cache) -> dict:
    bitwise = all(
        torch.equal(a, b) for req in ("first", "second") for a, b in zip(off[req][1], on[req][1], strict=True)
    )

    def med(r):
        return statistics.median(r[0])

    return {
        "off_ms": med(off["second"]),
        "on_nothing_hits_ms": med(on["first"]),
        "on_all_hit_ms": med(on["second"]),
        "off_first_request_ms": med(off["first"]),
        "bitwise_equal": bitwise,
        "cache": cache.stats(),
    }


def _measure(pipe, call, steps, device) -> dict:
    cache = omni_accel.describe(pipe).components[0].cache
    budget = cache.max_bytes
    cache.max_bytes = 0  # off: project() runs the computation directly
    call(steps[0])  # warm-up (kernels, allocator)
    off = _run_requests(call, steps, device)
    cache.max_bytes = budget
    cache.clear()
    on = _run_requests(call, steps, device)
    return _compare(off, on, cache)


@torch.no_grad()
def bench_flux(device: str, dtype: torch.dtype, tiny: bool, steps: int) -> dict:
    config = {**FLUX_DEV, **(TINY["flux"] if tiny else {})}
    with torch.device(device):
        model = randomized(FluxTransformer2DModel(**config), dtype)
    tokens = (64, 16) if tiny else (4096, 512)
    x = inputs(1, *tokens, device, dtype)
    pipe = FluxPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, None, None, model)
    omni_accel.accelerate(pipe)

    def call(t):
        return pipe.transformer(**{**x, "timestep": torch.full((1,), t, device=device, dtype=dtype)})[0]

    result = _measure(pipe, call, torch.linspace(1.0, 0.05, steps).tolist(), device)
    result["shape"] = f"1 x ({tokens[0]} image + {tokens[1]} text tokens), {'tiny' if tiny else 'FLUX.1-dev'}"
    return result


@torch.no_grad()
def bench_wan(device: str, dtype: torch.dtype, tiny: bool, steps: int) -> dict:
    with torch.device(device):
        model = randomized(WanTransformer3DModel(**(TINY["wan"] if tiny else WAN_14B)), dtype)
    frames, height, width = (2, 8, 8) if tiny else (21, 60, 104)  # 480x832, 81 frames after the VAE
    g = torch.Generator(device).manual_seed(0)
    latents = torch.randn(1, 16, frames, height, width, generator=g, device=device, dtype=dtype)
    text = [torch.randn(1, 512, 4096, generator=g, device=device, dtype=dtype) for _ in range(2)]
    pipe = WanPipeline(None, None, None, FlowMatchEulerDiscreteScheduler(), transformer=model)
    # Wan's cache sites wrap Diffusers' modules on the routed path; its native blocks do not use the cache.
    omni_accel.accelerate(pipe, native=False)

    def call(t):
        timestep = torch.full((1,), t * 1000, device=device)
        cond = pipe.transformer(latents, timestep, text[0], return_dict=False)[0]
        uncond = pipe.transformer(latents, timestep, text[1], return_dict=False)[0]
        return torch.stack([cond, uncond])

    result = _measure(pipe, call, torch.linspace(1.0, 0.05, steps).tolist(), device)
    tokens = frames * height * width // 4
    result["shape"] = (
        f"1 x {tokens} video tokens + 512 text tokens, cond+uncond per step, {'tiny' if tiny else 'Wan 2.1 14B'}"
    )
    return result


@torch.no_grad()
def bench_minimax_h3(device: str, dtype: torch.dtype, tiny: bool, steps: int) -> dict:
    spec = MODELS["minimax_h3"](tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = randomized(spec.cls(**spec.config), dtype)
    x = spec.inputs(device, dtype)
    # off by default on this model (this measurement is why): a budget turns it on
    budget = DEFAULT_PROJECTION_CACHE_BYTES
    pipe = omni_accel.accelerate(
        Holder(model), cuda_graphs=False, compile_in_background=False, projection_cache_bytes=budget
    )

    def call(t):  # the step's (text, audio, video) timesteps: audio and video on their own schedules
        timestep = torch.tensor([0.0, 0.8 * t, t], device=device)
        video, audio = pipe.transformer(**{**x, "timestep": timestep})
        return torch.cat([video.flatten(), audio.flatten()])

    result = _measure(pipe, call, torch.linspace(1.0, 0.05, steps).tolist(), device)
    result["sites_per_step"] = 1 + len(model.transformer_blocks)  # the refiner, each block's AdaLN table
    result["shape"] = f"{spec.shapes}; {spec.layers}"
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["flux", "wan", "minimax_h3"], choices=["flux", "wan", "minimax_h3"]
    )
    parser.add_argument("--tiny", action="store_true", help="small configs on CPU, for a smoke test")
    parser.add_argument("--flux-steps", type=int, default=6)
    parser.add_argument("--wan-steps", type=int, default=3)
    parser.add_argument("--minimax-steps", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if "flux" in args.models:
        results["flux"] = bench_flux(device, dtype, args.tiny, args.flux_steps)
        print("flux", json.dumps(results["flux"]))
    if device == "cuda":
        torch.cuda.empty_cache()
    if "wan" in args.models:
        results["wan"] = bench_wan(device, dtype, args.tiny, args.wan_steps)
        print("wan", json.dumps(results["wan"]))
    if device == "cuda":
        torch.cuda.empty_cache()
    if "minimax_h3" in args.models:
        results["minimax_h3"] = bench_minimax_h3(device, dtype, args.tiny, args.minimax_steps)
        print("minimax_h3", json.dumps(results["minimax_h3"]))
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
