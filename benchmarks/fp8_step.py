"""Per-step transformer time of FLUX.1-dev with ``quantize="fp8"`` against Diffusers and torchao's FP8.

Variants, every one built from the same random bf16 weights (same seed) and timed in interleaved rounds in
one process: (a) Diffusers' module as ``from_pretrained`` gives it; (b) Diffusers' best switches (fused
QKV, cuDNN attention, ``compile_repeated_blocks(fullgraph=True)``); (c) with ``--torchao``, (b) plus
torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (its first call compiles);
omni_accel lossless; omni_accel ``quantize="fp8"``. Both omni_accel variants replay CUDA graphs (the
default on a GPU). Errors are relative to (a)'s bf16 output (max abs difference over max abs value), so
the lossy variants are compared on the same inputs; the weights are random, which the errors say nothing
about real checkpoints' quality (``benchmarks/quality.py`` measures that with real weights).

    python benchmarks/fp8_step.py --torchao --out fp8.json
"""

from __future__ import annotations

import argparse

import torch
from flux_step import bare_pipeline, build_transformer, inputs, rel_err
from timing import cudnn_backend_for, interleaved, timed, write_json

import omni_accel


def torchao_fp8(model: torch.nn.Module, compiled: bool = True) -> torch.nn.Module:
    """Diffusers' documented FP8 recipe: torchao's dynamic float8 (row scales) on every linear, then the
    best switches. ``fuse_qkv_projections`` first: it concatenates bf16 weights, which torchao then
    quantizes. ``compiled=False``: the same quantization run eagerly (its errors per block can be read
    with hooks, which a fullgraph-compiled block would not take)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    model.fuse_qkv_projections()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    cudnn_backend_for(model)
    if compiled:
        model.compile_repeated_blocks(fullgraph=True)
    return model


def block_outputs(model: torch.nn.Module, call) -> list[torch.Tensor]:
    """The image stream's output of every block (double then single) of one ``call()``, in float32."""
    outputs, handles = [], []

    def keep(module, args, output):
        outputs.append((output[1] if isinstance(output, tuple) else output).float())

    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        handles += [block.register_forward_hook(keep) for block in blocks]
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def per_layer_errors(models: dict[str, tuple[torch.nn.Module, object]]) -> dict[str, list[float]]:
    """Each variant's relative error after every block against the first variant's (its own chain of
    blocks from the same inputs: the error accumulated up to that block). Hooks make the steps run
    eagerly (no CUDA graph), which the timing above does not see."""
    outputs = {name: block_outputs(model, call) for name, (model, call) in models.items()}
    reference = next(iter(outputs.values()))
    return {
        name: [rel_err(got, ref) for got, ref in zip(outs, reference, strict=True)]
        for name, outs in list(outputs.items())[1:]
    }


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per variant per round")
    parser.add_argument("--torchao", action="store_true", help="add (c): torchao FP8 + best switches")
    parser.add_argument("--no-baselines", action="store_true", help="only the omni_accel variants")
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="only the errors after every block (no timing, nothing compiled; with --torchao its FP8 eagerly): "
        "a separate launch, since the timed variants and one more model do not fit in 141 GB together",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    x = inputs(1, args.image_tokens, args.text_tokens, device, dtype)

    variants, models = {}, {}
    reference_model = build_transformer(device, dtype)
    variants["a_diffusers_default"] = lambda: reference_model(**x)[0]
    if args.per_layer:
        return _per_layer_launch(args, reference_model, x)
    if not args.no_baselines:
        best = build_transformer(device, dtype)
        best.fuse_qkv_projections()
        cudnn_backend_for(best)
        best.compile_repeated_blocks(fullgraph=True)
        variants["b_diffusers_best"] = lambda: best(**x)[0]
    if args.torchao:
        models["c"] = torchao_fp8(build_transformer(device, dtype))
        variants["c_torchao_fp8_best"] = lambda: models["c"](**x)[0]
    lossless = omni_accel.accelerate(bare_pipeline(build_transformer(device, dtype)))
    variants["omni_accel_lossless"] = lambda: lossless.transformer(**x)[0]
    fp8 = omni_accel.accelerate(bare_pipeline(build_transformer(device, dtype)), quantize="fp8")
    variants["omni_accel_fp8"] = lambda: fp8.transformer(**x)[0]

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": vars(args)}
    reference = None
    for name, fn in variants.items():  # warm-up: compiles, JIT builds, graph captures (second call)
        out, first = timed(fn, device)
        reference = out.float() if reference is None else reference
        fn()
        fn()
        results[name] = {"first_call_ms": first, "rel_err_vs_a": rel_err(out, reference)}
    stats = interleaved(variants, device, args.rounds, args.calls)
    a_ms = stats["a_diffusers_default"]["median_ms"]
    for name, stat in stats.items():
        results[name].update(stat)
        ratios = {"vs_a": a_ms / stat["median_ms"]}
        for key, label in (("b_diffusers_best", "vs_b"), ("c_torchao_fp8_best", "vs_c")):
            if key in stats:
                ratios[label] = stats[key]["median_ms"] / stat["median_ms"]
        results[name].update(ratios)
        shown = "  ".join(f"x{v:.2f} {k}" for k, v in ratios.items())
        print(
            f"{name:24s} {stat['median_ms']:8.1f} ms/step  {shown}  spread {stat['spread_ms']:.1f} ms  first call "
            f"{results[name]['first_call_ms'] / 1000:.1f} s  rel err vs (a) {results[name]['rel_err_vs_a']:.3e}"
        )
    results["fp8_weight_bytes"] = omni_accel.describe(fp8).components[0].runtime.fp8.bytes_used
    results["report"] = str(omni_accel.describe(fp8))
    print(results["report"])
    write_json(results, args.out)
    return results


def _per_layer_launch(args, reference_model: torch.nn.Module, x: dict) -> dict:
    device, dtype = "cuda", torch.bfloat16
    lossless = omni_accel.accelerate(bare_pipeline(build_transformer(device, dtype)))
    fp8 = omni_accel.accelerate(bare_pipeline(build_transformer(device, dtype)), quantize="fp8")
    layered = {
        "a_diffusers_default": (reference_model, lambda: reference_model(**x)[0]),
        "omni_accel_lossless": (lossless.transformer, lambda: lossless.transformer(**x)[0]),
        "omni_accel_fp8": (fp8.transformer, lambda: fp8.transformer(**x)[0]),
    }
    if args.torchao:
        eager_c = torchao_fp8(build_transformer(device, dtype), compiled=False)
        layered["c_torchao_fp8_eager"] = (eager_c, lambda: eager_c(**x)[0])
    results = {"rel_err_after_each_block_vs_a": per_layer_errors(layered)}
    for name, values in results["rel_err_after_each_block_vs_a"].items():
        step = max(1, len(values) // 12)
        shown = " ".join(f"{v:.3f}" for v in values[::step])
        print(f"{name:24s} error after blocks 1..{len(values)} (every {step}th): {shown}")
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
