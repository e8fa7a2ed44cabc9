"""Cold start: from ``accelerate(pipe, ...)`` to the first finished image, in a fresh process, next to a
warm image of the same process (FLUX.1-dev architecture, random bf16, 28 steps at 1024x1024, prompt
embeddings given, latents out).

Each option set runs in two fresh processes sharing one new inductor cache directory: the first is the
first-ever start (empty compile cache), the second a start with a warm on-disk cache, which is what a
user meets on every run after their first.

    python benchmarks/cold_start.py --out cold_start.json
    python benchmarks/cold_start.py --host --options compile   # CPU: the host side of a compiled start

``--first-launch`` measures our Triton kernels' first launch instead, in a fresh process with an empty
Triton cache (FLUX.1-dev's norm_modulate at 1024x1024): what starting Triton's driver set-up costs the
caller, the first call (served by the PyTorch reference while the kernel compiles in the background), the
compile's length, how responsive the main thread stays meanwhile (iterations per second of a pure-Python
loop and its longest gaps, against the same loop once the compile is done) and the first call after it.

    python benchmarks/cold_start.py --first-launch

``--first-steps MODEL`` times the first calls of one transformer forward of a ``harness.models`` model in a
fresh process with empty Triton and inductor caches: a plain Diffusers call first (CUDA, cuBLAS and cuDNN
warmed as in a process that ran Diffusers before), then ``accelerate`` and each of ``--calls`` calls with
what served it (CUDA graphs captured and replayed, the background compile's state). It shows whether the
first steps wait for our kernel builds or run beside a compile.

    python benchmarks/cold_start.py --first-steps zimage --calls 8

``--host`` runs a toy-size FLUX with FLUX.1-dev's block count (19 + 38) in fp32 on the CPU: what a compiled
start costs the host (imports, tracing, cache loads) does not depend on the tensors' sizes, so it can be
worked on without a GPU; each row then also says where the first call's time went (seconds): imports of
the compiler stack, Dynamo's tracing, AOTAutograd/Inductor (cache loads on a warm start).
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
    "compile": {"compile": True},  # in the background: eager steps until the compiled code is ready
    "compile_at_first_call": {"compile": True, "compile_in_background": False},
}


def child(name: str, steps: int, host: bool, blocks: tuple[int, int]) -> dict:
    import torch

    import omni_accel

    options = OPTION_SETS[name]
    if host:
        pipe = omni_accel.tiny_flux_pipeline(num_layers=blocks[0], num_single_layers=blocks[1])
        call = dict(prompt="a cat", height=64, width=64)
    else:
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
        from harness.models import MODELS, build

        model = build(MODELS["flux"](False), "cuda", torch.bfloat16)
        pipe = FluxPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, None, None, model)
        g = torch.Generator("cuda").manual_seed(0)
        call = dict(
            prompt_embeds=torch.randn(1, 512, 4096, generator=g, device="cuda", dtype=torch.bfloat16),
            pooled_prompt_embeds=torch.randn(1, 768, generator=g, device="cuda", dtype=torch.bfloat16),
            height=1024,
            width=1024,
        )
    pipe.set_progress_bar_config(disable=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    step_ends = []

    def note_step(pipe, step, timestep, kwargs):
        step_ends.append(time.perf_counter())
        return kwargs

    def image() -> float:
        step_ends.clear()
        start = time.perf_counter()
        pipe(**call, num_inference_steps=steps, output_type="latent", callback_on_step_end=note_step)
        sync()
        return time.perf_counter() - start

    sync()
    modules_before = set(sys.modules)
    start = time.perf_counter()
    omni_accel.accelerate(pipe, **options)
    accelerate_s = time.perf_counter() - start
    first = image()
    accelerate_to_first_image = time.perf_counter() - start
    host_step_ends = [round(t - start, 2) for t in step_ends]  # when the host finished each step's launches
    compiler = omni_accel.describe(pipe).components[0].runtime.compiler
    calls_of_the_first_image = _block_calls(compiler)
    if compiler is not None:
        compiler.wait()  # a warm image is a compiled one
    windows = _compile_windows(compiler, start)
    image()  # switches the compiled code in, captures its graphs
    warm = min(image(), image())
    result = {
        "accelerate_to_first_image_s": accelerate_to_first_image,
        "accelerate_s": accelerate_s,
        "first_image_s": first,
        "warm_image_s": warm,
        "modules_imported_by_the_first_call": len(set(sys.modules) - modules_before),
        **calls_of_the_first_image,
        "first_image_host_step_ends_s": host_step_ends,
        **windows,
    }
    if options.get("compile"):
        result.update(_compile_phases())
    return result


def first_launch_child() -> dict:
    """One fresh process, empty Triton cache (the parent sets ``TRITON_CACHE_DIR``): see ``--first-launch``."""
    import torch

    from omni_accel import kernel_builds
    from omni_accel.layers import fused
    from omni_accel.utils import triton_builds

    x = torch.randn(1, 4608, 3072, device="cuda", dtype=torch.bfloat16)
    shift, scale = (torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def call() -> float:
        start = time.perf_counter()
        fused.norm_modulate(x, shift, scale, 1e-6)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    start = time.perf_counter()
    triton_builds.set_up_in_background()
    set_up_s = time.perf_counter() - start
    first_s = call()
    built_from = time.perf_counter()
    during = _main_thread_loop(kernel_builds.in_flight)
    compile_s = time.perf_counter() - built_from
    kernel_builds.wait()
    after = _main_thread_loop(lambda: False, seconds=max(during["seconds"], 0.5))
    return {
        "set_up_in_background_call_s": set_up_s,
        "first_call_s": first_s,
        "background_compile_s": compile_s,
        "loop_iterations_per_s_during_compile": during["per_s"],
        "loop_iterations_per_s_after": after["per_s"],
        "loop_p99_gap_ms_during_compile": during["p99_gap_ms"],
        "loop_max_gap_ms_during_compile": during["max_gap_ms"],
        "first_call_after_the_compile_s": call(),
        "warm_call_s": min(call() for _ in range(5)),
    }


_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")  # --first-steps starts with both empty


def first_steps_child(model: str, calls: int, tiny: bool, profile: bool = False) -> dict:
    """One fresh process: see ``--first-steps``; ``profile``: the first call of ours under cProfile (its
    time then is the profiler's, not a figure), the functions that took longest by their own time."""
    import torch
    from harness.models import MODELS, Holder, build

    import omni_accel
    from omni_accel import kernel_builds

    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    spec = MODELS[model](tiny)
    x = spec.inputs(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    with torch.no_grad():
        plain_s = _plain_calls(build(spec, device, dtype), x, timed)  # freed before ours is built
        options = {"compile": {"backend": "eager"}} if tiny else {}
        ours = omni_accel.accelerate(
            Holder(build(spec, device, dtype)), compile_in_background=True, **options
        )
        steps, profiled = [], None
        for index in range(calls):
            if profile and index == 0:
                profiled = _profiled(lambda: timed(lambda: ours.transformer(**x)))
                seconds = profiled.pop("s")
            else:
                seconds = timed(lambda: ours.transformer(**x))
            served = [
                line.strip()
                for line in str(omni_accel.describe(ours)).splitlines()
                if line.strip().startswith(("cuda graphs:", "compiled:", "kernels being built"))
            ]
            steps.append({"s": seconds, "served": served})
        start = time.perf_counter()
        kernel_builds.wait()
        built_s = time.perf_counter() - start
    results = {
        "model": model,
        "plain_first_s": plain_s[0],
        "plain_warm_s": plain_s[1],
        "calls": steps,
        "builds_left_after_the_calls_s": built_s,
    }
    return results if profiled is None else {**results, "first_call_profile": profiled}


def _profiled(call, rows: int = 25) -> dict:
    """``{"s": call(), "top": [...]}``: the ``rows`` functions with the most own time under cProfile."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    seconds = profiler.runcall(call)
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:rows]
    return {
        "s": seconds,
        "top": [
            {
                "function": f"{path}:{line}({name})",
                "calls": counts[1],
                "own_s": counts[2],
                "cumulative_s": counts[3],
            }
            for (path, line, name), counts in top
        ],
    }


def _plain_calls(model, x: dict, timed) -> list[float]:
    return [timed(lambda: model(**x)) for _ in range(2)]


def first_steps(model: str, calls: int, tiny: bool, profile: bool = False) -> dict:
    """``--first-steps``: the child in a fresh process with new, empty Triton and inductor caches."""
    caches = {name: tempfile.mkdtemp(prefix=f"{name.lower()}_first_steps_") for name in _CACHES}
    command = [sys.executable, __file__, "--child", f"first_steps:{model}", "--calls", str(calls)]
    command += ["--profile-first"] if profile else []
    done = subprocess.run(
        command + (["--tiny"] if tiny else []), env={**os.environ, **caches}, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"first steps failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main_thread_loop(busy, seconds: float = 0.0) -> dict:
    """A pure-Python loop (the GIL's share of the main thread) while ``busy()`` or for ``seconds``."""
    gaps, start = [], time.perf_counter()
    last = start
    while busy() or time.perf_counter() - start < seconds:
        sum(range(200))
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    gaps.sort()
    elapsed = last - start
    return {
        "seconds": elapsed,
        "per_s": len(gaps) / elapsed if elapsed else 0.0,
        "p99_gap_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "max_gap_ms": 1000 * gaps[-1] if gaps else 0.0,
    }


def first_launch() -> dict:
    """``--first-launch``: the child in a fresh process with a new, empty Triton cache."""
    from omni_accel.utils.kernels import HAS_TRITON

    if not (HAS_TRITON and _has_cuda()):
        return {"skipped": "our Triton kernels' first launch needs CUDA and Triton"}
    env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton_first_launch_")}
    command = [sys.executable, __file__, "--child", "first_launch"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"first launch failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _rounded(value):
    return round(value, 2) if isinstance(value, float) else value


def _block_calls(compiler) -> dict:
    """How many block calls of the first image ran compiled and eagerly (background compile)."""
    if compiler is None or not compiler.background:
        return {}
    calls = compiler.calls().values()
    return {
        "first_image_compiled_block_calls": sum(compiled for _, compiled in calls),
        "first_image_eager_block_calls": sum(eager for eager, _ in calls),
    }


def _compile_windows(compiler, start: float) -> dict:
    """When each block function's background compile started and ended, in seconds from ``accelerate``."""
    if compiler is None or not compiler.background:
        return {}
    windows = compiler.windows().items()
    return {"compile_windows_s": {name: [round(t - start, 2) for t in window] for name, window in windows}}


def _compile_phases() -> dict:
    """Seconds Dynamo's own counters give the first call's compile phases (torch._dynamo.utils)."""
    from torch._dynamo.utils import compilation_time_metrics

    phases = {
        "dynamo_tracing_s": "bytecode_tracing",
        "aot_autograd_and_inductor_s": "OutputGraph.call_user_compiler",
        "of_which_compiled_code_loads_s": "AOTAutogradCache.inductor_load",
    }
    return {
        name: sum(compilation_time_metrics.get(metric, []))
        for name, metric in phases.items()
        if metric in compilation_time_metrics
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--options", nargs="+", default=list(OPTION_SETS), choices=list(OPTION_SETS))
    parser.add_argument("--host", action="store_true", help="toy-size FLUX on the CPU: the host side only")
    parser.add_argument(
        "--tiny", action="store_true", help="--host with 2 + 2 blocks, 2 steps, eager options: a smoke run"
    )
    parser.add_argument(
        "--first-launch", action="store_true", help="our Triton kernels' first launch (one GPU), not an image"
    )
    parser.add_argument(
        "--first-steps", metavar="MODEL", help="the first calls of a benchmarks model (one GPU)"
    )
    parser.add_argument("--calls", type=int, default=8, help="calls timed by --first-steps")
    parser.add_argument(
        "--profile-first",
        action="store_true",
        help="--first-steps: cProfile our first call (and print where)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, nargs=2, default=(19, 38), help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.child and args.child.startswith("first_steps:"):
        name = args.child.split(":", 1)[1]
        print(json.dumps(first_steps_child(name, args.calls, args.tiny, args.profile_first)))
        return {}
    if args.first_steps:
        results = first_steps(args.first_steps, args.calls, args.tiny, args.profile_first)
        print(
            f"plain Diffusers: first {results['plain_first_s']:.3f} s, then {results['plain_warm_s']:.3f} s"
        )
        for index, step in enumerate(results["calls"], 1):
            print(f"call {index}: {step['s']:.3f} s  {' | '.join(step['served'])}", flush=True)
        print(f"builds still running after the calls took {results['builds_left_after_the_calls_s']:.3f} s")
        for row in results.get("first_call_profile", {}).get("top", []):
            print(
                f"  {row['own_s']:.3f} own  {row['cumulative_s']:.3f} cum  {row['calls']:>6}  {row['function']}"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
        return results
    if args.tiny:
        args.host, args.steps, args.blocks = True, 2, (2, 2)
        args.options = [name for name in args.options if not OPTION_SETS[name].get("compile")]
    if args.child == "first_launch":
        print(json.dumps(first_launch_child()))
        return {}
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.host, tuple(args.blocks))))
        return {}
    if args.first_launch:
        results = first_launch()
        print(json.dumps({k: _rounded(v) for k, v in results.items()}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
        return results
    results = {}
    for name in args.options:
        cache = tempfile.mkdtemp(prefix=f"inductor_{name}_")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for start in ("empty_cache", "warm_cache"):
            command = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
            command += ["--blocks", *map(str, args.blocks)] + (["--host"] if args.host else [])
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{name} ({start}) failed:\n{done.stderr[-4000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["ratio_to_warm_image"] = result["accelerate_to_first_image_s"] / result["warm_image_s"]
            results[f"{name}_{start}"] = result
            print(
                f"{name:20s} {start:12s} {json.dumps({k: _rounded(v) for k, v in result.items()})}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
