"""omni_accel's multi-GPU layouts on whole pipeline calls, against one GPU and Diffusers' own context
parallelism, in one torchrun launch; or (``--vae``) the VAEs split over the ranks by rows against whole.

Layouts: each runs the unchanged FluxPipeline or WanPipeline (random weights, bf16; prompt embeddings in,
latents out) for a few steps at the model's size in ``harness.models`` (FLUX.1-dev 1024x1024, Wan 2.1
480x832 with 81 frames). Per layout: ms per step (the call's time over its steps) back to back and with a
host sync after every step (launch overhead shows there), the latents' distance from the one-GPU run of
the same kind, and the speedup against it. A layout name is a degree (``1gpu``, ``tpN``, ``ulyssesN``,
``ringN``, ``cfg2``: N is the world size, ``cfg2_ulyssesM`` beyond two ranks), a kind for FLUX (``_true_cfg``: two transformer calls per step;
``_lora``: a rank-16 LoRA on every attention projection; Wan always runs with CFG) and ``+variant``
suffixes (``harness/layouts.py``: ``+unstacked`` keeps a CFG step's two calls apart, the A/B of
``batch_guidance``). Each kind's one-GPU run is added first when not asked for. Then Diffusers' module as
built on one GPU and under its Ulysses (``enable_parallelism(ContextParallelConfig(ulysses_degree=N))``),
plain kind (``--no-diffusers`` skips them; its context parallelism needs GPUs, so ``--tiny`` skips that).

VAE (``--vae``): FLUX's AutoencoderKL (decode and encode at ``--size``) and Wan 2.1's (decode and encode of
``--frames`` frames at 480x832) run whole on every rank and split by rows (omni_accel's patch-parallel
VAE): seconds per call and the split result's distance from the whole one.

``--tiny``: tiny models on CPU in float32 over gloo, a smoke run (tests/test_benchmarks_layouts.py).

    torchrun --nproc-per-node 2 benchmarks/layouts.py --out flux.json
    torchrun --nproc-per-node 2 benchmarks/layouts.py --steps 8 --repeats 2 --no-diffusers \\
        --layouts 1gpu ulysses2 ulysses2+one_stage ulysses2+nccl_exchange ring2 tp2
    torchrun --nproc-per-node 2 benchmarks/layouts.py --layouts 1gpu_true_cfg ulysses2_true_cfg \\
        ulysses2_true_cfg+unstacked tp2_true_cfg tp2_true_cfg+unstacked
    torchrun --nproc-per-node 2 benchmarks/layouts.py --model wan14b --steps 2 --no-diffusers \\
        --layouts 1gpu ulysses2 ulysses2+unstacked ring2 cfg2
    torchrun --nproc-per-node 2 benchmarks/layouts.py --vae --size 2048 --frames 81 --out vae.json
    torchrun --nproc-per-node 2 benchmarks/layouts.py --tiny --layouts 1gpu ulysses2+one_stage tp2_lora
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    ContextParallelConfig,
    DiffusionPipeline,
    WanTransformer3DModel,
)
from harness.layouts import bare_pipeline, configured
from harness.models import MODELS, Spec, build, rel_err, with_lora
from harness.timing import timed, write_json

import omni_accel
import omni_accel.models.wan  # noqa: F401  (teaches the row split Wan's VAE layers)
from omni_accel import ParallelConfig
from omni_accel.models.random_pipelines import FLUX_DEV_VAE
from omni_accel.parallel.vae import RowSplit

KINDS = {"flux": ("true_cfg", "lora"), "wan14b": (), "wan1.3b": ()}
"""Each model's kinds of call besides the plain one (a layout name's ``_kind`` suffix)."""

TINY_VAE = dict(FLUX_DEV_VAE, block_out_channels=(8, 16, 32, 32), norm_num_groups=4, layers_per_block=1)


def _cfg_layout(world: int) -> list[str]:
    """The layout of CFG's two branches (Ulysses over the rest), where the ranks pair."""
    return [] if world % 2 else ["cfg2" if world == 2 else f"cfg2_ulysses{world // 2}"]


def layout_table(model: str, world: int) -> dict[str, ParallelConfig | None]:
    """Every layout name ``model`` takes on ``world`` ranks: each degree with each kind."""
    degrees: dict[str, ParallelConfig | None] = {
        "1gpu": None,
        f"tp{world}": ParallelConfig(tp=world),
        f"ulysses{world}": ParallelConfig(ulysses=world),
        f"ring{world}": ParallelConfig(ring=world),
    }
    for cfg in _cfg_layout(world):
        degrees[cfg] = ParallelConfig(cfg=2, ulysses=world // 2)
    suffixes = ["", *(f"_{kind}" for kind in KINDS[model])]
    return {name + suffix: config for name, config in degrees.items() for suffix in suffixes}


def default_layouts(model: str, world: int) -> list[str]:
    """What a launch without ``--layouts`` runs: what the two-GPU tables in docs/PERFORMANCE.md quote."""
    n, cfg = world, _cfg_layout(world)
    if model == "flux":
        true_cfg = [f"{name}_true_cfg" for name in ["1gpu", *cfg]]
        return ["1gpu", f"tp{n}", f"ulysses{n}", f"ring{n}", *true_cfg, "1gpu_lora", f"tp{n}_lora"]
    return ["1gpu", f"ulysses{n}", f"ring{n}", f"tp{n}", *cfg]


def _kind(name: str, model: str) -> str:
    """A layout's kind of call (``""``: plain); the one-GPU run of the same kind is its reference."""
    base = name.partition(" #")[0].partition("+")[0]
    return next((kind for kind in KINDS[model] if base.endswith(f"_{kind}")), "")


def _one_gpu(kind: str) -> str:
    return f"1gpu_{kind}" if kind else "1gpu"


def _embeddings(like: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(like.device).manual_seed(seed)
    return torch.randn(like.shape, generator=g, device=like.device, dtype=like.dtype)


def call_arguments(spec: Spec, guided: bool, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """A pipeline call at the size of the model's transformer call in ``harness.models`` (prompt
    embeddings of its shapes, latents out). ``guided``: FLUX's true CFG, a negative prompt and two calls
    per step (Wan's calls always have them)."""
    x = spec.inputs(device, dtype)
    prompt = x["encoder_hidden_states"]
    if issubclass(spec.cls, WanTransformer3DModel):  # hidden_states: [1, 16, frames, height / 8, width / 8]
        frames, height, width = x["hidden_states"].shape[2:]
        kwargs = dict(
            prompt_embeds=_embeddings(prompt, 1),
            negative_prompt_embeds=_embeddings(prompt, 2),
            guidance_scale=5.0,
            num_frames=(frames - 1) * 4 + 1,
            height=height * 8,
            width=width * 8,
        )
    else:  # FLUX, hidden_states: [1, tokens, 64], a token per 16x16 pixels
        side = int(x["hidden_states"].shape[1] ** 0.5) * 16
        pooled = x["pooled_projections"]
        kwargs = dict(
            prompt_embeds=_embeddings(prompt, 1),
            pooled_prompt_embeds=_embeddings(pooled, 1),
            height=side,
            width=side,
        )
        if guided:
            kwargs.update(
                true_cfg_scale=4.0,
                negative_prompt_embeds=_embeddings(prompt, 2),
                negative_pooled_prompt_embeds=_embeddings(pooled, 2),
            )
    return dict(kwargs, output_type="latent")


def _call(
    pipe: DiffusionPipeline, kwargs: dict, steps: int, sync_each_step: bool, device: str
) -> torch.Tensor:
    if sync_each_step and device.startswith("cuda"):
        kwargs = dict(kwargs, callback_on_step_end=lambda *a: (torch.cuda.synchronize(), {})[1])
    out = pipe(**kwargs, num_inference_steps=steps, generator=torch.Generator(device).manual_seed(0))
    return out.frames if hasattr(out, "frames") else out.images


def measure(
    pipe: DiffusionPipeline, kwargs: dict, steps: int, repeats: int, device: str
) -> tuple[dict, torch.Tensor]:
    """Median ms per step back to back and synced after every step, and the latents (after a warm-up)."""
    latents = _call(pipe, kwargs, steps, False, device)
    result = {}
    for mode, sync in (("back_to_back", False), ("synced_per_step", True)):
        times = []
        for _ in range(repeats):
            dist.barrier()
            _, ms = timed(lambda s=sync: _call(pipe, kwargs, steps, s, device), device)
            times.append(ms / steps)
        result[f"{mode}_ms_per_step"] = statistics.median(times)
    return result, latents


def _released() -> None:
    gc.collect()  # hooks (ours and Diffusers') hold their module in reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _show(name: str, result: dict) -> None:
    if omni_accel.is_main_process():
        print(f"{name:28s} {json.dumps(result)}", flush=True)


def run_layouts(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """Every asked layout (each kind's one-GPU run first where missing), then Diffusers' runs; errors and
    speedups against the one-GPU run of each kind once all have run."""
    world = dist.get_world_size()
    spec, table = MODELS[args.model](args.tiny), layout_table(args.model, world)
    steps = args.steps or (4 if args.model == "flux" else 2)
    asked = args.layouts or default_layouts(args.model, world)
    kinds = [_kind(name, args.model) for name in asked] + ([""] if not args.no_diffusers else [])
    planned = [one for one in dict.fromkeys(map(_one_gpu, kinds)) if one not in asked] + asked
    compile_options: dict[str, Any] = {}
    if args.compile:
        compile_options = {"compile": {"backend": "aot_eager"} if args.tiny else True}
        compile_options["compile_in_background"] = False
    runs, latents, kind_of = {}, {}, {}

    for name in planned:
        _, layout = configured(name, table)
        kind = _kind(name, args.model)
        model = build(spec, device, dtype)
        if kind == "lora":
            with_lora(model, rank=16)
        pipe = omni_accel.accelerate(bare_pipeline(model), parallel=layout, **compile_options)
        kwargs = call_arguments(spec, kind == "true_cfg", device, dtype)
        repeat = sum(1 for done in runs if done.partition(" #")[0] == name)
        name = f"{name} #{repeat + 1}" if repeat else name  # a layout named again: an A/B repeat
        runs[name], latents[name] = measure(pipe, kwargs, steps, args.repeats, device)
        kind_of[name] = kind
        _show(name, runs[name])
        if args.describe and omni_accel.is_main_process():
            print(omni_accel.describe(pipe), flush=True)
        del pipe, model
        _released()

    for name, ulysses in (("diffusers_1gpu", 1), (f"diffusers_ulysses{world}", world)):
        if args.no_diffusers:
            break
        if ulysses > 1 and args.tiny:
            runs[name] = {"skipped": "Diffusers' context parallelism needs an accelerator"}
            continue
        model = build(spec, device, dtype)
        try:
            if ulysses > 1:
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses))
            if args.compile:
                model.compile_repeated_blocks(
                    fullgraph=True, **({"backend": "aot_eager"} if args.tiny else {})
                )
            kwargs = call_arguments(spec, False, device, dtype)
            runs[name], latents[name] = measure(bare_pipeline(model), kwargs, steps, args.repeats, device)
            kind_of[name] = ""
            _show(name, runs[name])
        except Exception as exc:  # record why instead of losing the other measurements
            runs[name] = {"error": f"{type(exc).__name__}: {exc}"}
        del model
        _released()

    for name, kind in kind_of.items():
        reference = _one_gpu(kind)
        runs[name]["rel_err_vs_1gpu"] = rel_err(latents[name], latents[reference])
        single = runs[reference]["back_to_back_ms_per_step"]
        runs[name]["speedup_vs_1gpu"] = single / runs[name]["back_to_back_ms_per_step"]
    for name, result in runs.items():
        _show(name, result)
    return {
        "model": args.model,
        "layers": spec.layers,
        "shapes": spec.shapes,
        "steps": steps,
        "layouts": runs,
    }


def run_vae(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """FLUX's and Wan's VAE, decode and encode, whole on every rank against split over the ranks."""
    if args.tiny:
        config, size, frames, video, wan_config = TINY_VAE, 64, min(args.frames, 5), (32, 48), {"base_dim": 8}
    else:
        config, size, frames, video, wan_config = FLUX_DEV_VAE, args.size, args.frames, (480, 832), {}
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKL(**config).to(dtype).eval()
    g = torch.Generator(device).manual_seed(1)
    latents = torch.randn(1, 16, size // 8, size // 8, generator=g, device=device, dtype=dtype)
    image = torch.randn(1, 3, size, size, generator=g, device=device, dtype=dtype)
    calls = {
        "flux_decode": (vae.decoder, lambda: vae.decode(latents).sample),
        "flux_encode": (vae.encoder, lambda: vae.encode(image).latent_dist.parameters),
    }
    if frames:
        with torch.device(device):
            wan = AutoencoderKLWan(**wan_config).to(dtype).eval()
        latent_frames = (frames - 1) // 4 + 1
        wan_latents = torch.randn(
            1, 16, latent_frames, video[0] // 8, video[1] // 8, generator=g, device=device, dtype=dtype
        )
        video_in = torch.randn(1, 3, frames, *video, generator=g, device=device, dtype=dtype)
        calls["wan_decode"] = (wan.decoder, lambda: wan.decode(wan_latents).sample)
        calls["wan_encode"] = (wan.encoder, lambda: wan.encode(video_in).latent_dist.parameters)
    results = {}
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
        results[name] = {
            "whole_s": times["whole"],
            "split_s": times["split"],
            "speedup": times["whole"] / times["split"],
            "rel_err_split_vs_whole": rel_err(outputs["split"], outputs["whole"]),
        }
        _show(name, results[name])
    return {"size": size, "frames": frames, "video": list(video), "vae": results}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(KINDS), default="flux", help="of harness.models.MODELS")
    parser.add_argument(
        "--layouts",
        nargs="+",
        help="layout names, e.g. 1gpu tp2 ulysses2+one_stage cfg2_true_cfg tp2_lora (default: the model's "
        "usual set); a name given twice runs twice (an A/B repeat, reported as 'name #2')",
    )
    parser.add_argument("--steps", type=int, help="denoising steps per call (default: FLUX 4, Wan 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per mode (median)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="accelerate with compile=True; Diffusers' runs compile_repeated_blocks(fullgraph=True)",
    )
    parser.add_argument("--no-diffusers", action="store_true", help="skip Diffusers' 1-GPU and Ulysses runs")
    parser.add_argument("--describe", action="store_true", help="print describe(pipe) after each layout")
    parser.add_argument("--vae", action="store_true", help="time the VAEs' row split instead of the layouts")
    parser.add_argument("--size", type=int, default=2048, help="--vae: FLUX image side in pixels")
    parser.add_argument("--frames", type=int, default=81, help="--vae: Wan video frames (0: skip Wan)")
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU, float32, gloo: a smoke run")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    if args.tiny:
        dist.init_process_group("gloo")
        device, dtype, gpus = "cpu", torch.float32, ["cpu"]
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, dtype = f"cuda:{os.environ['LOCAL_RANK']}", torch.bfloat16
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    run = run_vae if args.vae else run_layouts
    results = {
        "gpus": gpus,
        "world_size": dist.get_world_size(),
        "dtype": str(dtype),
        **run(args, device, dtype),
    }
    if omni_accel.is_main_process():
        write_json(results, args.out)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
