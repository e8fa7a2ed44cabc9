"""FLUX.1-dev step time over resolutions and batch sizes: Diffusers untouched (a), Diffusers' best switches
(b), omni_accel eager, replayed from CUDA graphs and compiled, all in one process with identical weights, interleaved per shape.

    python benchmarks/flux_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse

import torch
from flux_step import bare_pipeline, build_transformer, graphs_switched, inputs
from timing import cudnn_backend_for, interleaved, write_json

import omni_accel

SHAPES = [(512, 512), (768, 1344), (1024, 1024)]


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=[f"{h}x{w}" for h, w in SHAPES], help="HxW ...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    default = build_transformer(device, dtype)
    best = build_transformer(device, dtype)
    best.fuse_qkv_projections()
    cudnn_backend_for(best)
    best.compile_repeated_blocks(fullgraph=True)
    eager = omni_accel.accelerate(bare_pipeline(build_transformer(device, dtype)), cuda_graphs=True)
    compiled = omni_accel.accelerate(
        bare_pipeline(build_transformer(device, dtype)),
        compile=True,
        compile_in_background=False,
        cuda_graphs=False,
    )

    def variants(x: dict) -> dict:
        return {
            "diffusers_default": lambda: default(**x),
            "diffusers_best": lambda: best(**x),
            "omni_eager": graphs_switched(eager, lambda: eager.transformer(**x), on=False),
            "omni_cuda_graphs": graphs_switched(eager, lambda: eager.transformer(**x), on=True),
            "omni_compiled": lambda: compiled.transformer(**x),
        }

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for height, width in (map(int, shape.split("x")) for shape in args.shapes):
        for batch in args.batches:
            x = inputs(
                batch, (height // 16) * (width // 16), 512, device, dtype, grid=(height // 16, width // 16)
            )
            calls = variants(x)
            for call in calls.values():  # warm-up: compilation for this shape; a graph captures on call two
                call()
                call()
            stats = interleaved(calls, device, args.rounds, args.calls)
            medians = {name: stat["median_ms"] for name, stat in stats.items()}
            row = {
                name: {
                    "ms": ms,
                    "vs_default": medians["diffusers_default"] / ms,
                    "vs_best": medians["diffusers_best"] / ms,
                }
                for name, ms in medians.items()
            }
            key = f"{height}x{width}_b{batch}"
            results["shapes"][key] = row
            print(
                key,
                "  ".join(
                    f"{n} {r['ms']:.1f} ms (x{r['vs_default']:.2f} a, x{r['vs_best']:.2f} b)"
                    for n, r in row.items()
                ),
            )
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
