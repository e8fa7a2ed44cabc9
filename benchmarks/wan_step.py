"""One Wan 2.1 transformer forward (random weights, bf16): Diffusers vs omni_accel's native Wan.

Baselines in the same process, interleaved: (a) a fresh Diffusers module with nothing toggled, (b)
Diffusers' best switches (cuDNN attention backend, ``compile_repeated_blocks``; ``--compile`` only, since
(b) is a compiled variant). omni_accel: native eager, and with ``--cuda-graphs`` / ``--compile`` the
graph-replayed and compiled variants (eager and replayed share one model, as do the two compiled ones:
four 14B models is what fits on one H200). A denoising step with CFG is two forwards (cond, uncond).

    python benchmarks/wan_step.py --model 14b --compile --cuda-graphs --out wan14b.json
    python benchmarks/wan_step.py --model 1.3b --frames 81 --height 480 --width 832
    python benchmarks/wan_step.py --model 14b --gelu-apart --rounds 2 --calls 2   # the GELU epilogue's A/B
    python benchmarks/wan_step.py --tiny                    # CPU smoke test
"""

from __future__ import annotations

import argparse
import importlib
from unittest import mock

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from random_models import WAN_14B, randomized
from timing import cudnn_backend_for, interleaved, timed, write_json

import omni_accel

CONFIGS = {
    "14b": WAN_14B,
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "tiny": dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=64, num_layers=2),
}


def add_video_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and video shape options every Wan benchmark takes."""
    parser.add_argument("--model", choices=["14b", "1.3b"], default="14b")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)


def rel_err(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def gelu_apart(call):
    """``call()`` with the MLP's up projection and its GELU as two passes (the path before the epilogue)."""
    # By import_module: ``omni_accel.layers.feed_forward`` as an attribute is the function the package re-exports.
    module = importlib.import_module("omni_accel.layers.feed_forward")
    with mock.patch.object(module, "_gelu_epilogue_serves", lambda *args: False):
        return call()


def _scoped(call, provider: str):
    with omni_accel.attention_scope(default=provider):
        return call()


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_video_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="add (b) and omni_accel compile=True")
    parser.add_argument("--cuda-graphs", action="store_true", help="add graph-replayed omni_accel variants")
    parser.add_argument("--attention", default="auto", help="omni_accel's attention provider")
    parser.add_argument(
        "--gelu-apart",
        action="store_true",
        help="add omni_accel eager with the MLP's GELU as a kernel after the GEMM, not in its epilogue",
    )
    parser.add_argument(
        "--fp8",
        nargs="*",
        metavar="PROVIDER",
        help="add omni_accel quantize='fp8' (lossless attention), and the same under each named attention "
        "provider (e.g. sage: lossy attention too)",
    )
    parser.add_argument("--tiny", action="store_true", help="a two-block model on CPU: a smoke test")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    config = CONFIGS["tiny" if args.tiny else args.model]

    def build() -> WanTransformer3DModel:
        torch.manual_seed(0)
        with torch.device(device):
            return randomized(WanTransformer3DModel(**config), dtype)

    frames = (args.frames - 1) // 4 + 1  # the VAE: 4x in time (first frame apart), 8x in space
    shape = (1, 16, frames, args.height // 8, args.width // 8)
    g = torch.Generator(device).manual_seed(1)
    x = dict(
        hidden_states=torch.randn(*shape, generator=g, device=device, dtype=dtype),
        timestep=torch.full((1,), 500.0, device=device),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=g, device=device, dtype=dtype),
        return_dict=False,
    )
    tokens = frames * (args.height // 16) * (args.width // 16)

    def accelerated(**options):
        pipe = WanPipeline(None, None, None, FlowMatchEulerDiscreteScheduler(), transformer=build())
        omni_accel.accelerate(pipe, cuda_graphs=args.cuda_graphs, attention=args.attention, **options)
        return pipe

    def variant(pipe, graphs_on: bool):
        graphs = omni_accel.describe(pipe).components[0].graphs

        def call():
            if graphs is not None:
                graphs.enabled = graphs_on
            return pipe.transformer(**x)[0]

        return call

    diffusers_model = build()
    variants = {"diffusers_default": lambda: diffusers_model(**x)[0]}
    if args.compile:
        best = build()
        if not args.tiny:
            cudnn_backend_for(best)
        best.compile_repeated_blocks(fullgraph=True)
        variants["diffusers_best"] = lambda: best(**x)[0]
    omni = accelerated()
    variants["omni_accel"] = variant(omni, graphs_on=False)
    if args.gelu_apart:
        eager = variants["omni_accel"]
        variants["omni_accel_gelu_apart"] = lambda: gelu_apart(eager)
    if args.cuda_graphs:
        variants["omni_accel_cuda_graphs"] = variant(omni, graphs_on=True)
    if args.fp8 is not None:
        fp8 = accelerated(quantize="fp8")
        variants["omni_accel_fp8"] = variant(fp8, graphs_on=args.cuda_graphs)
        for provider in args.fp8:
            scoped = variant(fp8, graphs_on=args.cuda_graphs)
            variants[f"omni_accel_fp8_{provider}"] = lambda scoped=scoped, provider=provider: _scoped(
                scoped, provider
            )
    if args.compile:
        compiled = accelerated(compile=True, compile_in_background=False)
        variants["omni_accel_compiled"] = variant(compiled, graphs_on=False)
        if args.cuda_graphs:
            variants["omni_accel_compiled_cuda_graphs"] = variant(compiled, graphs_on=True)

    results = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": {**vars(args), "video_tokens": tokens},
        "rel_err_vs_diffusers_default": {},
    }
    reference = None
    first_call = {}
    for name, fn in variants.items():  # warm-up: compilation, autotuning; a graph captures on call two
        out, first_call[name] = timed(fn, device)
        reference = out if reference is None else reference
        results["rel_err_vs_diffusers_default"][name] = rel_err(out, reference)
        fn()
        fn()
    stats = interleaved(variants, device, args.rounds, args.calls)
    base = stats["diffusers_default"]["median_ms"]
    best_ms = stats.get("diffusers_best", {}).get("median_ms")
    for name, stat in stats.items():
        median = stat["median_ms"]
        results[name] = {**stat, "first_call_ms": first_call[name], "speedup_vs_diffusers": base / median}
        line = f"{name:32s} {median:9.1f} ms/forward  x{base / median:.2f} vs (a)"
        if best_ms:
            results[name]["speedup_vs_diffusers_best"] = best_ms / median
            line += f"  x{best_ms / median:.2f} vs (b)"
        err = results["rel_err_vs_diffusers_default"][name]
        print(
            f"{line}  CFG step {2 * median / 1000:.2f} s  spread {stat['spread_ms']:.1f} ms"
            f"  first call {first_call[name] / 1000:.1f} s  rel err vs (a) {err:.2e}"
        )
    print(f"{tokens} video tokens, model {'tiny' if args.tiny else args.model}")
    results["report"] = str(omni_accel.describe(omni))
    print(results["report"])
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
