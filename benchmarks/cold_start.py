"""Cold start: from ``accelerate(pipe, ...)`` to the first finished image, in a fresh process, next to a
warm image of the same process (FLUX.1-dev architecture, random bf16, 28 steps at 1024x1024, prompt
embeddings given, latents out).

Each option set runs in two fresh processes sharing one new inductor cache directory: the first is the
first-ever start (empty compile cache), the second a start with a warm on-disk cache, which is what a
user meets on every run after their first.

    python benchmarks/cold_start.py --out cold_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

OPTION_SETS = {
    "default": {},  # eager blocks, each step replayed from a CUDA graph
    "eager_no_graphs": {"cuda_graphs": False},
    "compile": {"compile": True},
}


def child(options: dict, steps: int) -> dict:
    import torch
    from flux_step import bare_pipeline, build_transformer

    import omni_accel

    pipe = bare_pipeline(build_transformer("cuda", torch.bfloat16))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator("cuda").manual_seed(0)
    embeds = dict(
        prompt_embeds=torch.randn(1, 512, 4096, generator=g, device="cuda", dtype=torch.bfloat16),
        pooled_prompt_embeds=torch.randn(1, 768, generator=g, device="cuda", dtype=torch.bfloat16),
    )

    def image() -> float:
        start = time.perf_counter()
        pipe(**embeds, height=1024, width=1024, num_inference_steps=steps, output_type="latent")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    torch.cuda.synchronize()
    start = time.perf_counter()
    omni_accel.accelerate(pipe, **options)
    first = image()
    accelerate_to_first_image = time.perf_counter() - start
    warm = min(image(), image())
    return {
        "accelerate_to_first_image_s": accelerate_to_first_image,
        "first_image_s": first,
        "warm_image_s": warm,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--options", nargs="+", default=list(OPTION_SETS), choices=list(OPTION_SETS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(OPTION_SETS[args.child], args.steps)))
        return {}
    results = {}
    for name in args.options:
        cache = tempfile.mkdtemp(prefix=f"inductor_{name}_")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for start in ("empty_cache", "warm_cache"):
            command = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["ratio_to_warm_image"] = result["accelerate_to_first_image_s"] / result["warm_image_s"]
            results[f"{name}_{start}"] = result
            print(
                f"{name:20s} {start:12s} {json.dumps({k: round(v, 2) for k, v in result.items()})}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
