"""FLUX.1-dev (random weights, bf16) at 1024x1024 on two GPUs: every omni_accel layout against one GPU,
beside Diffusers' own context parallelism, in one torchrun launch.

Each layout runs the unchanged FluxPipeline (prompt embeddings given, latents out) for a few steps; the
per-step time is the call's time over its steps, measured back to back and with a host sync after every
step (launch overhead shows there). Every layout's latents are compared with the one-GPU omni_accel
result. True CFG (two transformer calls per step) is measured for cfg=2 against one GPU doing both calls.

    torchrun --nproc-per-node 2 benchmarks/flux_parallel.py --out parallel.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch
import torch.distributed as dist
from flux_lora_step import with_lora
from flux_step import bare_pipeline, build_transformer, rel_err
from layout_variants import configured
from timing import timed, write_json

import omni_accel
from omni_accel import ParallelConfig

_ONE_GPU = {"plain": "1gpu", "true_cfg": "1gpu_true_cfg", "lora": "1gpu_lora"}


def _kind(layout_name: str) -> str:
    """Which one-GPU run a layout compares with: same calls (true CFG or not), same adapters."""
    base = layout_name.partition(" #")[0].partition("+")[0]
    return next((kind for kind in ("true_cfg", "lora") if base.endswith(kind)), "plain")


def _embeddings(device: str, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator(device).manual_seed(seed)
    return dict(
        prompt_embeds=torch.randn(1, 512, 4096, generator=g, device=device, dtype=dtype),
        pooled_prompt_embeds=torch.randn(1, 768, generator=g, device=device, dtype=dtype),
    )


def _call(pipe, steps: int, true_cfg: bool, sync_each_step: bool, device: str) -> torch.Tensor:
    size = 1024 if pipe.transformer.dtype == torch.bfloat16 else 64
    kwargs = dict(
        _embeddings(device, pipe.transformer.dtype, 1), height=size, width=size, num_inference_steps=steps
    )
    if true_cfg:
        negative = _embeddings(device, pipe.transformer.dtype, 2)
        kwargs.update(
            true_cfg_scale=4.0,
            negative_prompt_embeds=negative["prompt_embeds"],
            negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"],
        )
    if sync_each_step and device.startswith("cuda"):
        kwargs["callback_on_step_end"] = lambda *a: (torch.cuda.synchronize(), {})[1]
    return pipe(**kwargs, output_type="latent", generator=torch.Generator(device).manual_seed(0)).images


def _measure(pipe, steps: int, repeats: int, true_cfg: bool, device: str) -> dict:
    latents = _call(pipe, steps, true_cfg, False, device)  # warm-up
    dist.barrier()
    result = {}
    for mode, sync in (("back_to_back", False), ("synced_per_step", True)):
        times = []
        for _ in range(repeats):
            dist.barrier()
            _, ms = timed(lambda s=sync: _call(pipe, steps, true_cfg, s, device), device)
            times.append(ms / steps)
        result[f"{mode}_ms_per_step"] = statistics.median(times)
    return result, latents


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tiny", action="store_true", help="a two-layer model on CPU with gloo: a smoke test"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="accelerate with compile=True; Diffusers' runs compile_repeated_blocks(fullgraph=True)",
    )
    parser.add_argument(
        "--layouts", nargs="+", help="a subset of the layouts (default: all), each with an optional +variant"
    )
    parser.add_argument(
        "--no-diffusers", action="store_true", help="skip Diffusers' own 1-GPU and Ulysses runs"
    )
    parser.add_argument(
        "--describe", action="store_true", help="print describe(pipe) after each layout (graphs, compile)"
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.tiny:
        dist.init_process_group("gloo")
        device, dtype, size = (
            "cpu",
            torch.float32,
            dict(num_layers=1, num_single_layers=1, num_attention_heads=2),
        )
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(local_rank)
        device, dtype, size = f"cuda:{local_rank}", torch.bfloat16, {}

    layouts = {
        "1gpu": None,
        "tp2": ParallelConfig(tp=2),
        "ulysses2": ParallelConfig(ulysses=2),
        "ring2": ParallelConfig(ring=2),
        "1gpu_true_cfg": None,
        "cfg2_true_cfg": ParallelConfig(cfg=2),
        "1gpu_lora": None,  # a rank-16 LoRA on every attention projection, unfused
        "tp2_lora": ParallelConfig(tp=2),
    }
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if not args.tiny
        else ["cpu"]
    )
    results, oracle = {"gpus": gpus, "steps": args.steps}, {}
    compile_options = {"compile": True, "compile_in_background": False} if args.compile else {}
    if args.compile and args.tiny:
        compile_options["compile"] = {"backend": "aot_eager"}
    for name in args.layouts or list(layouts):
        base, layout = configured(name, layouts)
        true_cfg = base.endswith("true_cfg")
        model = build_transformer(device, dtype, **size)
        if base.endswith("lora"):
            with_lora(model, rank=16)
        pipe = bare_pipeline(model)
        omni_accel.accelerate(pipe, parallel=layout, **compile_options)
        result, latents = _measure(pipe, args.steps, args.repeats, true_cfg, device)
        key = _kind(name)
        oracle.setdefault(key, latents)  # the first layout run of each kind is the reference
        result["rel_err_vs_1gpu"] = rel_err(latents, oracle[key].float())
        runs = sum(1 for done in results if done.partition(" #")[0] == name)
        name = name if not runs else f"{name} #{runs + 1}"  # a layout named again: an A/B repeat
        results[name] = result
        if omni_accel.is_main_process():
            print(f"{name:20s} {json.dumps(result)}", flush=True)
            if args.describe:
                print(omni_accel.describe(pipe), flush=True)
        del pipe
        gc.collect()  # hooks (ours and Diffusers') hold their module in reference cycles
        torch.cuda.empty_cache()

    for name, ulysses in (("diffusers_1gpu", 1), ("diffusers_ulysses2", 2)):
        if args.no_diffusers:
            break
        model = build_transformer(device, dtype, **size)
        try:
            if ulysses > 1:  # Diffusers' context parallelism needs an accelerator
                if args.tiny:
                    continue
                from diffusers import ContextParallelConfig

                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses))
            if args.compile:
                model.compile_repeated_blocks(fullgraph=True)
            result, latents = _measure(bare_pipeline(model), args.steps, args.repeats, False, device)
            result["rel_err_vs_1gpu"] = rel_err(latents, oracle["plain"].float())
        except Exception as exc:  # record why instead of losing the other measurements
            result = {"error": f"{type(exc).__name__}: {exc}"}
        results[name] = result
        del model
        gc.collect()
        torch.cuda.empty_cache()

    for name, result in results.items():
        if isinstance(result, dict) and "back_to_back_ms_per_step" in result:
            single = results[_ONE_GPU[_kind(name)]]["back_to_back_ms_per_step"]
            result["speedup_vs_1gpu"] = single / result["back_to_back_ms_per_step"]
            if omni_accel.is_main_process():
                print(f"{name:20s} {json.dumps(result)}")
    if omni_accel.is_main_process():
        write_json(results, args.out)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
