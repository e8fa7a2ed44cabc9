"""What Diffusers' step caches cost on the steps they compute: FLUX.1-dev per-step time with
FirstBlockCache and MagCache set so that they never skip (threshold -1), against the same model with no
cache, for Diffusers' untouched module, omni_accel lossless and omni_accel ``quantize="fp8"``.

A step cache hooks the blocks and decides on the host every call, so the accelerated step runs its native
blocks eagerly instead of replaying a CUDA graph; this measures what that costs. Random bf16 weights, one
process, interleaved rounds (each variant: its cache set, one untimed call, then the timed calls).

    python benchmarks/step_cache.py --out step_cache.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from diffusers import FirstBlockCacheConfig, MagCacheConfig
from flux_step import bare_pipeline, build_transformer, inputs
from timing import timed, write_json

import omni_accel

CACHES = {
    "no cache": None,
    "FirstBlockCache": lambda: FirstBlockCacheConfig(threshold=-1.0),
    "MagCache": lambda: MagCacheConfig(threshold=-1.0, num_inference_steps=1000, mag_ratios=[1.0] * 1000),
}


def set_cache(model: torch.nn.Module, name: str) -> None:
    if getattr(model, "_omni_bench_cache", None) == name:
        return
    if getattr(model, "_omni_bench_cache", None) not in (None, "no cache"):
        model.disable_cache()
    if CACHES[name] is not None:
        model.enable_cache(CACHES[name]())
    model._omni_bench_cache = name


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    x = inputs(1, args.image_tokens, args.text_tokens, device, dtype)
    pipes = {
        "Diffusers untouched": bare_pipeline(build_transformer(device, dtype)),
        "omni_accel lossless": omni_accel.accelerate(bare_pipeline(build_transformer(device, dtype))),
        "omni_accel fp8": omni_accel.accelerate(
            bare_pipeline(build_transformer(device, dtype)), quantize="fp8"
        ),
    }
    models = {name: pipe.transformer for name, pipe in pipes.items()}

    def call(model: torch.nn.Module) -> torch.Tensor:
        with model.cache_context("cond"):
            return model(**x)[0]

    samples = {(m, c): [] for m in models for c in CACHES}
    for _ in range(args.rounds + 1):  # the first round warms up (compiles, captures) and is not kept
        for (model_name, cache), kept in samples.items():
            model = models[model_name]
            set_cache(model, cache)
            call(model)
            call(model)
            times = [timed(lambda m=model: call(m), device)[1] for _ in range(args.calls)]
            kept.append(times)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": vars(args)}
    for (model_name, cache), per_round in samples.items():
        warm = [t for r in per_round[1:] for t in r]
        median = statistics.median(warm)
        base = statistics.median(t for r in samples[(model_name, "no cache")][1:] for t in r)
        results[f"{model_name} / {cache}"] = {"median_ms": median, "vs_no_cache": base / median}
        print(f"{model_name:22s} {cache:16s} {median:8.1f} ms/step  x{base / median:.3f} of no cache")
    for model_name in ("omni_accel lossless", "omni_accel fp8"):
        runtime = omni_accel.describe(pipes[model_name]).components[0].runtime
        print(f"{model_name}: calls run by Diffusers' forward, by reason: {dict(runtime.fallbacks)}")
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
