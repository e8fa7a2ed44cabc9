"""Where a transformer step's time goes, from torch.profiler, for Diffusers' baselines and ours side by side.
Per variant: the step's time (interleaved rounds, so clock or power drift hits every variant alike; the
round medians show it), the host's launch time, and from ``--steps`` profiled calls the kernel families per
step, the top kernels with their launches, busy time against the span (the idle gaps, the largest with the
kernels around them) and the communication no compute ran beside; each call's Chrome trace on request.

Variants: ``diffusers`` (the module as built), ``diffusers_best`` (Diffusers' best switches,
harness/baselines.py), ``omni`` (ours, steps eager) and ``omni_graphs`` (ours, steps replayed from CUDA
graphs). The two of ours share one accelerated model with its graphs switched, so a run holds three copies
of the model at most. ``--compile`` / ``--quantize fp8`` apply to ours.

Under torchrun, ``--layout`` runs ours spread over the ranks, layout after layout (``ulysses2+one_stage``:
a variant of a layout, harness/layouts.py), and prints every rank's kernel table (the ranks wait for the
slowest).

    python benchmarks/step_profile.py --out profile.json
    python benchmarks/step_profile.py --model wan14b --variants diffusers_best omni_graphs --trace-dir traces
    python benchmarks/step_profile.py --variants omni omni_graphs --rounds 40 --calls 1
    python benchmarks/step_profile.py --variants diffusers omni --compile
    torchrun --nproc-per-node 2 benchmarks/step_profile.py --layout 1gpu tp2 ulysses2 ring2 --out parallel.json
    torchrun --nproc-per-node 2 benchmarks/step_profile.py --layout ulysses2 ulysses2+packed_inputs
    python benchmarks/step_profile.py --tiny --layout ulysses2   # CPU smoke run, seconds

(The name is not ``profile.py``: benchmarks/ leads sys.path, and a ``profile`` module there would stand in
for the standard library's, which cProfile imports when Diffusers loads torch._dynamo.)
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness.baselines import best_switches, first_best_call, omni_ready
from harness.models import MODELS, Holder, Spec, build
from harness.profiling import exposed_ms, host_ms, record, summarize
from harness.timing import interleaved, wall, write_json

import omni_accel
from omni_accel import ParallelConfig

BASELINES = ("diffusers", "diffusers_best")
OURS = ("omni", "omni_graphs")

LAYOUTS: dict[str, ParallelConfig | None] = {
    "1gpu": None,
    "tp2": ParallelConfig(tp=2),
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
}


def built(
    args: argparse.Namespace, spec: Spec, device: str, layout: ParallelConfig | None, notes: list[str]
) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """Each variant's step, built and warm (first calls, compiles, kernel builds and graph captures done),
    and what the first calls cost and what ran; what this device could not show goes into ``notes``."""
    dtype = torch.float32 if args.tiny else torch.bfloat16
    x = spec.inputs(device, dtype)
    steps: dict[str, Callable[[], Any]] = {}
    info: dict[str, Any] = {"first_call_s": {}}
    if "diffusers" in args.variants:
        plain = build(spec, device, dtype)
        steps["diffusers"] = lambda: plain(**x)
        info["first_call_s"]["diffusers"] = wall(steps["diffusers"], device)[1]
    if "diffusers_best" in args.variants:
        best = build(spec, device, dtype)
        info["diffusers_best_switches"] = switches = best_switches(best, args.tiny)
        steps["diffusers_best"] = lambda: best(**x)
        _, info["first_call_s"]["diffusers_best"] = first_best_call(
            best, steps["diffusers_best"], device, switches
        )
    ours = [v for v in OURS if v in args.variants]
    if ours:
        options: dict[str, Any] = {"parallel": layout, "cuda_graphs": "omni_graphs" in ours}
        if args.compile:
            options.update(compile={"backend": "eager"} if args.tiny else True, compile_in_background=False)
        if args.quantize:
            options["quantize"] = args.quantize
        holder = omni_accel.accelerate(Holder(build(spec, device, dtype)), **options)
        graphs = omni_accel.describe(holder).components[0].graphs

        def switched(on: bool) -> Callable[[], Any]:
            def step() -> Any:
                if graphs is not None:
                    graphs.enabled = on
                return holder.transformer(**x)

            return step

        for variant in ours:
            steps[variant] = switched(variant == "omni_graphs")
        info["omni_ready_s"], info["omni_compiler"] = omni_ready(holder, steps[ours[-1]], device)
        info["omni_report"] = str(omni_accel.describe(holder))
        note = f"omni_graphs: no CUDA graphs on {device}, its steps ran eagerly"
        if "omni_graphs" in ours and not device.startswith("cuda") and note not in notes:
            notes.append(note)
    for fn in steps.values():
        fn()
    return steps, info


def measured(
    args: argparse.Namespace, steps: dict[str, Callable[[], Any]], device: str, trace_name: str
) -> dict[str, Any]:
    """Per variant: the interleaved timing, the host's launch time and the profile of ``args.steps`` calls."""
    timing = interleaved(steps, device, args.rounds, args.calls)
    out = {}
    for variant, fn in steps.items():
        trace = None
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            trace = os.path.join(args.trace_dir, f"{trace_name}_{variant}.json")
        launch = host_ms(fn, device)
        activities = record(fn, args.steps, device, trace)
        out[variant] = {
            "median_ms": timing[variant]["median_ms"],
            "timing": timing[variant],
            "host_launch_ms": launch,
            "profile": {
                **summarize(activities, args.steps),
                "communication_exposed_ms_per_step": exposed_ms(activities, args.steps),
            },
            **({"trace": trace} if trace else {}),
        }
    return out


def _families(profile: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(profile["family_ms_per_step"].items()))


def _print(variant: str, r: dict[str, Any]) -> None:
    p = r["profile"]
    rounds = " ".join(f"{ms:.1f}" for ms in r["timing"]["round_medians_ms"])
    print(
        f"{variant}: {r['median_ms']:.1f} ms per step (rounds {rounds}), host launch {r['host_launch_ms']:.1f} ms"
    )
    print(
        f"  {p['kernels_per_step']:.0f} kernels, busy {p['busy_ms_per_step']:.1f} ms, span "
        f"{p['span_ms_per_step']:.1f} ms, idle {p['idle_ms_per_step']:.1f} ms (gaps <= 20 us: "
        f"{p['gaps_under_20us_ms_per_step']:.1f} ms, median gap {p['median_gap_us']:.1f} us), communication "
        f"exposed {p['communication_exposed_ms_per_step']:.1f} ms"
    )
    print(f"  families: {_families(p)}")
    for name, ms, count in p["top_kernels"][:12]:
        print(f"    {ms:7.2f} ms {count:4d}x  {name}")
    for hole, before, after in p["largest_gaps"][:4]:
        print(f"    gap {hole:8.1f} us after {before} before {after}")


def _one_process(args: argparse.Namespace, spec: Spec, results: dict[str, Any]) -> None:
    device = "cpu" if args.tiny else "cuda"
    steps, info = built(args, spec, device, None, results["not_covered"])
    results.update(info, variants=measured(args, steps, device, args.model))
    for variant, r in results["variants"].items():
        _print(variant, r)


def _per_rank(variants: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's kernel table and busy time per variant, gathered (the ranks wait for the slowest)."""
    keys = ("family_ms_per_step", "busy_ms_per_step", "span_ms_per_step", "communication_exposed_ms_per_step")
    mine = {variant: {k: r["profile"][k] for k in keys} for variant, r in variants.items()}
    if not dist.is_initialized():
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _layouts(args: argparse.Namespace, spec: Spec, results: dict[str, Any]) -> None:
    """Ours under each layout in turn, on torchrun's ranks."""
    from harness.layouts import configured  # only layout runs need it (it imports peft)

    launched = "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group("gloo" if args.tiny else "nccl")
        if not args.tiny:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    elif args.tiny:
        results["not_covered"].append(
            "--layout without torchrun: every layout ran on this one process with parallel=None, so no "
            "collective, exchange or split over ranks ran (torchrun --nproc-per-node 2 ... --tiny runs them on gloo)"
        )
    else:
        raise SystemExit(
            "--layout runs under torchrun: torchrun --nproc-per-node 2 benchmarks/step_profile.py ..."
        )
    device = "cpu" if args.tiny else f"cuda:{torch.cuda.current_device()}"
    rank = dist.get_rank() if launched else 0
    results["layouts"] = {}
    for name in args.layout:
        _, layout = configured(name, LAYOUTS)
        steps, info = built(args, spec, device, layout if launched else None, results["not_covered"])
        variants = measured(args, steps, device, f"{args.model}_{name}_rank{rank}")
        per_rank = _per_rank(variants)
        results["layouts"][name] = {**info, "variants": variants, "per_rank": per_rank}
        if omni_accel.is_main_process():
            print(f"== {name}", flush=True)
            for variant, r in variants.items():
                _print(variant, r)
                for i, theirs in enumerate(per_rank):
                    p = theirs[variant]
                    print(
                        f"  rank {i} {variant}: {_families(p)} | busy {p['busy_ms_per_step']:.1f} span "
                        f"{p['span_ms_per_step']:.1f} exposed {p['communication_exposed_ms_per_step']:.1f}",
                        flush=True,
                    )
        del steps, info
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="flux")
    parser.add_argument(
        "--variants", nargs="+", choices=[*BASELINES, *OURS], help="default: all; ours under --layout"
    )
    parser.add_argument(
        "--layout", nargs="+", help=f"under torchrun: {', '.join(LAYOUTS)}, each with +variants"
    )
    parser.add_argument("--steps", type=int, default=2, help="profiled calls per variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per variant and round")
    parser.add_argument("--compile", action="store_true", help="ours with compile=True (waited for)")
    parser.add_argument("--quantize", choices=["fp8"], help="ours with quantize=...")
    parser.add_argument("--trace-dir", help="write each variant's (and rank's) Chrome trace here")
    parser.add_argument("--watchdog-s", type=float, default=0, help="dump the stacks and exit after this")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU in fp32: the code path only")
    parser.add_argument("--out")
    return parser


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.layout and args.variants and set(args.variants) & set(BASELINES):
        parser.error("--layout spreads ours over the ranks; profile the baselines without --layout")
    args.variants = args.variants or list(OURS if args.layout else (*BASELINES, *OURS))
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    spec = MODELS[args.model](args.tiny)
    results: dict[str, Any] = {
        "model": args.model,
        "layers": spec.layers,
        "inputs": spec.shapes,
        "steps_profiled": args.steps,
        "not_covered": [],
    }
    (_layouts if args.layout else _one_process)(args, spec, results)
    if omni_accel.is_main_process():
        for line in results["not_covered"]:
            print(f"not covered by this run: {line}")
        write_json(results, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
