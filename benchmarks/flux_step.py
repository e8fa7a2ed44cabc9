"""Per-step transformer time of FLUX.1-dev (full size, random weights, bf16): Diffusers vs omni_accel.

Two baselines: a fresh Diffusers module with nothing toggled (what a user runs), and Diffusers' best
switches (fused QKV, cuDNN attention backend, compile_repeated_blocks). Every module and the accelerated
pipelines hold identical weights (same seed) and are timed in
interleaved rounds, so clock drift over the run hits every variant alike; the spread of the per-round
medians is printed as the noise level. Accuracy is measured against an fp32 run of Diffusers' module: the
error of Diffusers' own bf16 kernels against it is the bar omni_accel's bf16 path has to meet.

    python benchmarks/flux_step.py --providers auto flashinfer sage --out results.json
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from timing import cudnn_backend_for, interleaved, timed, write_json

import omni_accel
from omni_accel.models.random_pipelines import FLUX_DEV_TRANSFORMER

FLUX_DEV = dict(FLUX_DEV_TRANSFORMER)  # a copy: --tiny shrinks it


def build_transformer(device: str, dtype: torch.dtype, seed: int = 0, **overrides) -> FluxTransformer2DModel:
    """Random weights drawn on the device (a CPU init of 12B parameters takes minutes); same seed, same weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = FluxTransformer2DModel(**{**FLUX_DEV, **overrides}).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


def graphs_switched(pipe: FluxPipeline, fn, on: bool):
    """``fn`` with ``pipe``'s CUDA graphs (if it has them) switched on or off first: one accelerated model
    serves an eager and a graph-replayed variant, since a 12B model per variant would not fit."""
    graphs = omni_accel.describe(pipe).components[0].graphs

    def call():
        if graphs is not None:
            graphs.enabled = on
        return fn()

    return call


def bare_pipeline(model: FluxTransformer2DModel) -> FluxPipeline:
    """A FluxPipeline around ``model`` without text encoders or VAE: callers pass embeddings, take latents."""
    return FluxPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, None, None, model)


def inputs(
    batch: int,
    image_tokens: int,
    text_tokens: int,
    device: str,
    dtype: torch.dtype,
    grid: tuple[int, int] | None = None,
) -> dict:
    """One transformer call's arguments; ``grid`` is the (rows, columns) of image tokens (square if None)."""
    g = torch.Generator(device).manual_seed(1)
    rows, cols = grid or (int(image_tokens**0.5),) * 2
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(rows).float(), torch.arange(cols).float(), indexing="ij"),
        -1,
    ).reshape(-1, 3)
    return dict(
        hidden_states=torch.randn(batch, image_tokens, 64, generator=g, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, 4096, generator=g, device=device, dtype=dtype),
        pooled_projections=torch.randn(batch, 768, generator=g, device=device, dtype=dtype),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device, dtype=dtype),
        img_ids=img_ids.to(device),
        txt_ids=torch.zeros(text_tokens, 3, device=device),
        return_dict=False,
    )


def rel_err(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got.float() - reference).abs().max() / reference.abs().max()).item()


def image_times(
    side: int, pick, names: list[str], steps: int, device: str, dtype: torch.dtype, repeats: int = 2
) -> dict:
    """Seconds per image of a whole FluxPipeline call (prompt embeddings in, latents out), interleaved;
    ``pick(name)`` readies and returns the pipeline of a variant; images are ``side`` pixels square."""
    g = torch.Generator(device).manual_seed(2)
    embeds = dict(
        prompt_embeds=torch.randn(1, 512, 4096, generator=g, device=device, dtype=dtype),
        pooled_prompt_embeds=torch.randn(1, 768, generator=g, device=device, dtype=dtype),
    )

    def call(pipe):
        return pipe(**embeds, height=side, width=side, num_inference_steps=steps, output_type="latent")

    for name in names:
        pipe = pick(name)
        pipe.set_progress_bar_config(disable=True)
        call(pipe)  # warm-up
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            pipe = pick(name)
            times[name].append(timed(lambda pipe=pipe: call(pipe), device)[1] / 1000)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--providers", nargs="+", default=["auto"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per variant per round")
    parser.add_argument("--compile", action="store_true", help="add compiled variants of both")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="add omni_accel variants replayed from CUDA graphs"
    )
    parser.add_argument(
        "--pipeline-steps", type=int, default=0, help="also time whole FluxPipeline calls of this many steps"
    )
    parser.add_argument("--tiny", action="store_true", help="a one-block model on CPU: a smoke test")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    side = int(args.image_tokens**0.5) * 16  # pixels: 2x2 latent patches of an 8x VAE
    if args.tiny:
        FLUX_DEV.update(num_layers=1, num_single_layers=1, num_attention_heads=2)

    diffusers_model = build_transformer(device, dtype)
    x = inputs(args.batch, args.image_tokens, args.text_tokens, device, dtype)
    fp32 = copy.deepcopy(diffusers_model).float()
    reference = fp32(
        **{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}
    )[0]
    del fp32
    torch.cuda.empty_cache()

    results = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": vars(args),
        "rel_err_vs_fp32": {},
    }
    # One accelerated model serves the eager and the graph-replayed variants (they differ in a switch):
    # six full-size FLUX models would not fit next to each other.
    pipe = omni_accel.accelerate(
        bare_pipeline(build_transformer(device, dtype)), cuda_graphs=args.cuda_graphs
    )
    cache = omni_accel.describe(pipe).components[0].cache

    def omni(provider: str, cached: bool = True):
        def call():
            if cache is not None:
                cache.max_bytes = 256 * 1024**2 if cached else 0
            with omni_accel.attention_scope(default=provider):
                return pipe.transformer(**x)[0]

        return graphs_switched(pipe, call, on=False)

    # Diffusers' best switches: fused QKV, the cuDNN attention backend, compiled repeated blocks.
    best = build_transformer(device, dtype)
    best.fuse_qkv_projections()
    if not args.tiny:
        cudnn_backend_for(best)
        best.compile_repeated_blocks(fullgraph=True)
    variants = {"diffusers_default": lambda: diffusers_model(**x)[0], "diffusers_best": lambda: best(**x)[0]}
    for provider in args.providers:
        variants[f"omni_accel_{provider}"] = omni(provider)
    if cache is not None:
        variants["omni_accel_auto_no_cache"] = omni("auto", cached=False)
    if args.cuda_graphs:
        variants["omni_accel_cuda_graphs"] = graphs_switched(pipe, lambda: pipe.transformer(**x)[0], on=True)
    if args.compile:
        compiled = omni_accel.accelerate(
            bare_pipeline(build_transformer(device, dtype)),
            compile=True,
            compile_in_background=False,  # timed calls are compiled ones
            cuda_graphs=args.cuda_graphs,
        )
        run_compiled = lambda: compiled.transformer(**x)[0]  # noqa: E731
        variants["omni_accel_compiled"] = graphs_switched(compiled, run_compiled, on=False)
        if args.cuda_graphs:
            variants["omni_accel_compiled_cuda_graphs"] = graphs_switched(compiled, run_compiled, on=True)

    first_call = {}
    for name, fn in variants.items():  # warm-up: JIT compilation (FlashInfer, Triton), autotuning, caches
        out, first_call[name] = timed(fn, device)
        results["rel_err_vs_fp32"][name] = rel_err(out, reference)
        fn()
        fn()  # a graph-replayed variant captures on its second call
    stats = interleaved(variants, device, args.rounds, args.calls)
    base = stats["diffusers_default"]["median_ms"]
    best_ms = stats["diffusers_best"]["median_ms"]
    for name, stat in stats.items():
        median = stat["median_ms"]
        results[name] = {
            **stat,
            "first_call_ms": first_call[name],
            "speedup_vs_diffusers": base / median,
            "speedup_vs_diffusers_best": best_ms / median,
        }
        err = results["rel_err_vs_fp32"][name]
        print(
            f"{name:28s} {median:8.1f} ms/step  x{base / median:.2f} vs default  x{best_ms / median:.2f} vs best"
            f"  spread {results[name]['spread_ms']:.1f} ms"
            f"  first call {first_call[name] / 1000:.1f} s  rel err vs fp32 {err:.2e}"
        )
    if cache is not None:
        cache.max_bytes = 256 * 1024**2  # the no-cache variant turned it off last
    if args.pipeline_steps:
        pipelines = {
            "diffusers_default": lambda: bare_pipeline(diffusers_model),
            "diffusers_best": lambda: bare_pipeline(best),
            "omni_accel_auto": lambda: pipe,
        }
        if args.cuda_graphs:
            pipelines["omni_accel_cuda_graphs"] = lambda: pipe
        if args.compile:
            pipelines["omni_accel_compiled"] = lambda: compiled
            if args.cuda_graphs:
                pipelines["omni_accel_compiled_cuda_graphs"] = lambda: compiled

        def pick(name):
            chosen = pipelines[name]()
            if name.startswith("omni"):
                graphs_switched(chosen, lambda: None, on=name.endswith("cuda_graphs"))()
            return chosen

        results["pipeline_s_per_image"] = image_times(
            side, pick, list(pipelines), args.pipeline_steps, device, dtype
        )
        for name, seconds in results["pipeline_s_per_image"].items():
            print(f"{name:28s} {args.pipeline_steps}-step {side}x{side} image: {seconds:.2f} s")
    results["report"] = str(omni_accel.describe(pipe))
    print(results["report"])
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
