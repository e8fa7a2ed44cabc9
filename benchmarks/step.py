"""One transformer forward on one GPU: Diffusers as built, Diffusers' best switches, and ours.

Per model of ``harness.models.MODELS`` (random bf16 weights, the same seed in every copy), built in one
process and timed in interleaved rounds (``harness.timing.interleaved``), CUDA events, median of warm calls:

    diffusers       (a) the module exactly as constructed
    diffusers_best  (b) ``fuse_qkv_projections()`` where the class has it, the cuDNN attention backend,
                    ``compile_repeated_blocks(fullgraph=True)`` (``harness.baselines.best_switches``)
    omni            ``omni_accel.accelerate(pipe, compile_in_background=True)``: on CUDA the repeated
                    blocks compile in the background and the steps replay from CUDA graphs
    omni_generic    for a model with native blocks, the generic tier (``native=False``) as well
                    (``--no-generic``: not, where four copies would not fit, as Wan 14B's)

``--extra`` adds variants: ``fp8`` (ours with ``quantize="fp8"``), ``torchao`` ((c): Diffusers' FP8
recipe, torchao's float8 on (b)), ``no_graphs`` (ours with ``cuda_graphs=False``), ``fused_qkv`` (ours
after the model's own ``fuse_qkv_projections()``), ``projection_cache`` (ours with the exact projection
cache on, every call a repeated request), ``max_autotune`` (ours with
``compile={"options": {"max_autotune_gemm": True}}``: inductor times Triton GEMM templates with their
elementwise epilogues fused against cuBLAS and keeps the faster), ``first_block_cache`` / ``mag_cache`` / ``taylorseer_cache``
(Diffusers' step cache set never to skip, on (a) and on ours, against the same models without it: what a
cache costs on the steps it computes) and ``provider=NAME`` (ours, and ours FP8 with ``fp8``, under
``attention_scope(per_role={"self": NAME})``: the self-attentions, where the FLOPs are; a cross-attention
over a short text, which ``flashinfer_fp8`` refuses, stays ``auto``). ``--lora RANK``
gives every copy the same random LoRA on its attention projections (unfused); ``--per-layer`` adds the
error after every block (ours, ours FP8, torchao's FP8 run eagerly) against (a)'s. The first call of each
variant is timed apart (compiles, kernel builds); errors are against (a) in fp32 (max abs diff / max abs).
A model that fails (an OOM, a compile error) is recorded with its traceback and the others still run;
the JSON is written after every model.

    python benchmarks/step.py --models flux qwenimage zimage flux2 minimax_h3 --rounds 3 --calls 3
    python benchmarks/step.py --models wan14b --rounds 2 --calls 2 --no-generic --extra fp8 provider=flashinfer_fp8
    python benchmarks/step.py --models flux --extra fp8 torchao first_block_cache taylorseer_cache
    python benchmarks/step.py --tiny --rounds 1 --calls 1     # CPU, fp32, tiny configs: a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

import diffusers
import torch
from harness.baselines import best_switches, first_best_call, omni_ready, torchao_fp8
from harness.models import MODELS, Holder, Spec, build, error, shapes, tensors, with_lora
from harness.timing import interleaved, sustained, wall, write_json

import omni_accel
from omni_accel.config import DEFAULT_PROJECTION_CACHE_BYTES
from omni_accel.models.registry import spec_for

STEP_CACHES = ("first_block_cache", "mag_cache", "taylorseer_cache")
EXTRAS = ("fp8", "torchao", "no_graphs", "fused_qkv", "projection_cache", "max_autotune", *STEP_CACHES)


def _extra(value: str) -> str:
    if value in EXTRAS or value.startswith("provider="):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: one of {', '.join(EXTRAS)} or provider=NAME")


class StepCache:
    """Switches one model's Diffusers step cache (set never to skip) on or off between variants that
    share the model; the switch runs before a variant's timed calls, never inside them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.current = model, None

    def set(self, name: str | None) -> None:
        if name == self.current:
            return
        if self.current is not None:
            self.model.disable_cache()
        if name == "first_block_cache":
            self.model.enable_cache(diffusers.FirstBlockCacheConfig(threshold=-1.0))
        elif name == "mag_cache":
            ratios = [1.0] * 1000
            config = diffusers.MagCacheConfig(threshold=-1.0, num_inference_steps=1000, mag_ratios=ratios)
            self.model.enable_cache(config)
        elif name == "taylorseer_cache":  # every step in its warm-up: computed, its Taylor factors updated
            self.model.enable_cache(
                diffusers.TaylorSeerCacheConfig(
                    disable_cache_before_step=10**9, cache_identifiers=_attention_names(self.model)
                )
            )
        self.current = name


def _attention_names(model: torch.nn.Module) -> list[str]:
    """Every attention module of ``model`` by its full name, as patterns: TaylorSeer's default patterns
    miss some models' (Wan's ``attn1``, Z-Image's ``attention``) and would hook nothing there."""
    from diffusers.hooks._common import _ATTENTION_CLASSES

    return [
        re.escape(name) for name, module in model.named_modules() if isinstance(module, _ATTENTION_CLASSES)
    ]


def block_outputs(model: torch.nn.Module, call: Callable[[], Any]) -> list[list[torch.Tensor]]:
    """The outputs of every block of ``model``'s block lists (in order) during one ``call()``, in fp32."""
    outputs, handles = [], []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                hook = block.register_forward_hook(lambda module, args, out: outputs.append(tensors(out)))
                handles.append(hook)
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def per_layer_errors(
    models: dict[str, Any], variants: dict[str, Callable[[], Any]]
) -> dict[str, list[float]]:
    """Each variant's relative error after every block against (a)'s (its own chain of blocks from the same
    inputs: the error accumulated up to that block). The hooks make the steps run eagerly (no CUDA graph)."""

    def module(variant: str) -> torch.nn.Module:
        model = models[variant]
        return model.transformer if isinstance(model, Holder) else model

    reference = block_outputs(module("diffusers"), variants["diffusers"])
    errors = {}
    for variant in [v for v in ("omni", "omni_fp8", "torchao_fp8_eager") if v in models]:
        outputs = block_outputs(module(variant), variants[variant])
        errors[variant] = [error(got, ref) for got, ref in zip(outputs, reference, strict=True)]
    return errors


def _copy(spec: Spec, device: str, dtype: torch.dtype, lora: int) -> torch.nn.Module:
    model = build(spec, device, dtype)
    return with_lora(model, lora) if lora else model


def measure(name: str, args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Every variant of model ``name``, built, warmed up and timed interleaved."""
    spec = MODELS[name](args.tiny)
    x = spec.inputs(device, dtype)
    result: dict[str, Any] = {
        "class": spec.cls.__name__,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.config.items()},
        "layers_measured": spec.layers,
        "inputs": spec.shapes,
        "input_shapes": shapes(x),
        "lora_rank": args.lora,
    }
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    extras = set(args.extra)
    copy = lambda: _copy(spec, device, dtype, args.lora)  # noqa: E731
    # Cleared at the end, so that the caller's empty_cache() returns the copies' memory.
    models: dict[str, Any] = {"diffusers": copy()}
    info: dict[str, Any] = {}
    if not args.no_best:
        models["diffusers_best"] = copy()
        result["diffusers_best_switches"] = info = best_switches(models["diffusers_best"], args.tiny)
    if args.tiny:
        options: dict[str, Any] = dict(compile={"backend": "eager"}, compile_in_background=False)
    else:
        options = dict(compile_in_background=True)
    if "torchao" in extras:  # before our copies: its quantization frees its bf16 weights (FLUX: 12 of 24 GB)
        if device == "cuda":
            models["torchao_fp8_best"] = torchao_fp8(copy())
        else:
            print(f"{name}: torchao skipped: its float8 GEMMs need CUDA", flush=True)
    ours: dict[str, dict[str, Any]] = {"omni": {}}
    if spec_for(models["diffusers"]).native is not None and not args.no_generic:
        ours["omni_generic"] = dict(native=False)
    if "fp8" in extras:
        ours["omni_fp8"] = dict(quantize="fp8")
    if "no_graphs" in extras:
        ours["omni_no_graphs"] = dict(cuda_graphs=False)
    if "projection_cache" in extras:
        ours["omni_projection_cache"] = dict(projection_cache_bytes=DEFAULT_PROJECTION_CACHE_BYTES)
    if "max_autotune" in extras:
        ours["omni_max_autotune"] = dict(compile={"options": {"max_autotune_gemm": True}})
    for variant, chosen in ours.items():
        models[variant] = omni_accel.accelerate(Holder(copy()), **{**options, **chosen})
    if "fused_qkv" in extras and hasattr(models["diffusers"], "fuse_qkv_projections"):
        fused = copy()
        fused.fuse_qkv_projections()
        models["omni_fused_qkv"] = omni_accel.accelerate(Holder(fused), **options)
    result["parameters_per_copy_b"] = sum(p.numel() for p in models["diffusers"].parameters()) / 1e9

    def call(variant: str) -> Callable[[], Any]:
        model = models[variant]
        return (lambda: model.transformer(**x)) if isinstance(model, Holder) else (lambda: model(**x))

    variants = {variant: call(variant) for variant in models}
    for extra in args.extra:
        if extra.startswith("provider="):
            provider = extra.removeprefix("provider=")
            for base in [v for v in ("omni", "omni_fp8") if v in models]:

                def scoped(fn=variants[base], provider=provider):
                    with omni_accel.attention_scope(per_role={"self": provider}):
                        return fn()

                variants[f"{base}_{provider}"] = scoped
    before: dict[str, Callable[[], None]] = {}
    for cached in sorted(extras & set(STEP_CACHES)):
        for base in [v for v in ("diffusers", "omni", "omni_fp8") if v in models]:
            module = models[base].transformer if isinstance(models[base], Holder) else models[base]
            switch = getattr(module, "_bench_step_cache", None) or StepCache(module)
            module._bench_step_cache = switch

            def in_context(fn=variants[base], module=module):
                with module.cache_context("cond"):
                    return fn()

            variants[f"{base}+{cached}"] = in_context
            before[f"{base}+{cached}"] = lambda switch=switch, cached=cached: switch.set(cached)
            before.setdefault(base, lambda switch=switch: switch.set(None))

    first: dict[str, float] = {}
    for variant, fn in variants.items():
        if variant in before:
            before[variant]()
        if variant == "diffusers_best":
            _, first[variant] = first_best_call(models[variant], fn, device, info)
        else:
            _, first[variant] = wall(fn, device)
        if isinstance(models.get(variant), Holder):
            result.setdefault("omni_ready_s", {})[variant], compiler = omni_ready(models[variant], fn, device)
            if variant == "omni":
                result["omni_compiler"] = compiler
    result["first_call_s"] = first
    outputs = {}
    for variant, fn in variants.items():  # one more call each: the outputs compared are warm ones
        if variant in before:
            before[variant]()
        fn()
        outputs[variant] = tensors(fn())
    result["rel_err_vs_diffusers"] = {
        variant: error(outputs[variant], outputs["diffusers"])
        for variant in variants
        if variant != "diffusers"
    }
    del outputs

    stats = interleaved(variants, device, args.rounds, args.calls, before)
    ms = {variant: stat["median_ms"] for variant, stat in stats.items()}
    result["median_ms"], result["timing"] = ms, stats
    result["speedup"] = {
        f"{baseline}/{variant}": ms[baseline] / ms[variant]
        for variant in ms
        for baseline in ("diffusers", "diffusers_best")
        if baseline in ms
        and variant != baseline
        and not (baseline == "diffusers_best" and variant == "diffusers")
    }
    for variant in [v for v in ms if "+" in v]:  # a step cache against the same model without it
        result["speedup"][f"{variant.split('+')[0]}/{variant}"] = ms[variant.split("+")[0]] / ms[variant]
    result["omni_report"] = str(omni_accel.describe(models["omni"]))
    if args.profile and device == "cuda":  # where (b) and ours differ, kernel family by kernel family
        from harness.profiling import gaps, host_ms

        result["profile"] = {}
        for variant in [v for v in variants if v == "diffusers_best" or v.startswith("omni")]:
            if variant in before:
                before[variant]()
            result["profile"][variant] = gaps(variants[variant], steps=2)
            # above the GPU's busy time: the step waits for the host
            result["profile"][variant]["host_ms"] = host_ms(variants[variant], device)
    if args.power and device == "cuda" and not args.no_best:
        result["power"] = [  # interleaved: (b), ours, (b), ours
            {"variant": v, **sustained(variants[v], args.power)}
            for v in ("diffusers_best", "omni", "diffusers_best", "omni")
        ]
    if args.per_layer:
        if "torchao" in extras and device == "cuda":
            models["torchao_fp8_eager"] = torchao_fp8(copy(), compiled=False)
            variants["torchao_fp8_eager"] = call("torchao_fp8_eager")
        for variant in ("diffusers", "omni", "omni_fp8"):  # step caches off: each block runs once
            if variant in before:
                before[variant]()
        result["rel_err_after_each_block"] = per_layer_errors(models, variants)
    if device == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 1024**3
    variants.clear()
    models.clear()
    return result


def summary(name: str, r: dict[str, Any]) -> str:
    """One line per variant: ms, the two ratios, first call, error."""
    ms, first, err, up = r["median_ms"], r["first_call_s"], r["rel_err_vs_diffusers"], r["speedup"]
    lines = [f"{name} ({r['layers_measured']}; {r['inputs']}):"]
    for variant, median in ms.items():
        ratios = " ".join(
            f"x{up[key]:.2f} vs {key.split('/')[0]}" for key in up if key.endswith(f"/{variant}")
        )
        error_text = f"  rel err {err[variant]:.1e}" if variant in err else ""
        lines.append(
            f"  {variant:28s} {median:9.1f} ms  {ratios:40s} first call {first[variant]:.1f} s{error_text}"
        )
    return "\n".join(lines)


def _free(device: str) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["flux"])
    parser.add_argument(
        "--extra", nargs="+", type=_extra, default=[], help="more variants (see the docstring)"
    )
    parser.add_argument(
        "--lora", type=int, default=0, metavar="RANK", help="a LoRA of this rank on every copy"
    )
    parser.add_argument(
        "--no-generic", action="store_true", help="no generic-tier copy of a native model (one copy less)"
    )
    parser.add_argument(
        "--no-best",
        action="store_true",
        help="no (b) copy, where it would not fit beside the variants compared (a step cache's cost on ours)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per variant per round")
    parser.add_argument("--out", help="JSON results path (written after every model)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile (b) and each variant of ours: kernel families, top kernels, GPU idle, host time",
    )
    parser.add_argument(
        "--power",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also run (b) and ours back to back for SECONDS each, twice, sampling SM clock and board power",
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="also the error after every block of ours, ours fp8 and (eager) torchao fp8 against (a)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU, fp32, tiny configs: a smoke run")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "args": vars(args),
        "dtype": str(dtype),
    }
    for name in args.models:
        try:
            results[name] = measure(name, args, device, dtype)
            print(summary(name, results[name]), flush=True)
            for variant, errors in results[name].get("rel_err_after_each_block", {}).items():
                shown = " ".join(f"{e:.1e}" for e in errors[:: max(1, len(errors) // 12)])
                print(f"  {variant} error after blocks 1..{len(errors)} (sampled): {shown}", flush=True)
            print(json.dumps(results[name].get("diffusers_best_switches", {})), flush=True)
            print(results[name]["omni_report"], flush=True)
        except Exception as exc:  # one model's failure (an OOM, a compile error) keeps the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"{name}: FAILED\n{results[name]['traceback']}", file=sys.stderr, flush=True)
        _free(device)
        write_json(results, args.out)
    return results


if __name__ == "__main__":
    failed = [name for name, r in main().items() if isinstance(r, dict) and "error" in r]
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
