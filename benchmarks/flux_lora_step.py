"""Per-step time of FLUX.1-dev (full size, random bf16 weights) with an unfused rank-16 LoRA on every
attention projection: plain Diffusers vs omni_accel, the same adapter on each, in one process.

Variants, timed in interleaved rounds (see flux_step.py for why):
  diffusers_default    a fresh Diffusers module with the LoRA loaded, nothing toggled;
  diffusers_best       + cuDNN attention backend + compile_repeated_blocks(fullgraph=True) (Diffusers'
                       fuse_qkv_projections() would drop unfused adapters, so it is not a switch here);
  omni_eager           accelerate(pipe): the adapters run as low-rank terms inside the packed GEMMs;
  omni_cuda_graphs     the same model with cuda_graphs=True: each step one graph launch;
  omni_compiled        accelerate(pipe, compile=True).
Accuracy: max |diff| / max |default| of each variant's output against diffusers_default (bf16; the
distance between the two Diffusers variants is the bar).

    python benchmarks/flux_lora_step.py --out lora.json
"""

from __future__ import annotations

import argparse

import torch
from flux_step import bare_pipeline, build_transformer, graphs_switched, inputs, rel_err
from peft import LoraConfig
from timing import cudnn_backend_for, interleaved, timed, write_json

import omni_accel

ATTENTION_PROJECTIONS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
]


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """The same random adapter on every model (seeded), B nonzero so the adapter changes the output."""
    config = LoraConfig(
        r=rank, lora_alpha=rank, target_modules=ATTENTION_PROJECTIONS, init_lora_weights=False
    )
    model.add_adapter(config, adapter_name="style")
    generator = torch.Generator(model.device).manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * 0.02)
    return model


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    x = inputs(args.batch, args.image_tokens, args.text_tokens, device, dtype)

    def model():
        return with_lora(build_transformer(device, dtype), args.rank)

    default = model()
    best = model()
    cudnn_backend_for(best)
    best.compile_repeated_blocks(fullgraph=True)
    eager = omni_accel.accelerate(bare_pipeline(model()), cuda_graphs=True)
    compiled = omni_accel.accelerate(bare_pipeline(model()), compile=True, compile_in_background=False)
    variants = {
        "diffusers_default": lambda: default(**x)[0],
        "diffusers_best": lambda: best(**x)[0],
        "omni_eager": graphs_switched(eager, lambda: eager.transformer(**x)[0], on=False),
        "omni_cuda_graphs": graphs_switched(eager, lambda: eager.transformer(**x)[0], on=True),
        "omni_compiled": lambda: compiled.transformer(**x)[0],
    }
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": vars(args)}
    reference = variants["diffusers_default"]()
    first_call, errors = {}, {}
    for name, fn in variants.items():
        out, first_call[name] = timed(fn, device)
        errors[name] = rel_err(out, reference.float())
        fn()
        fn()  # a graph-replayed variant captures on its second call
    stats = interleaved(variants, device, args.rounds, args.calls)
    medians = {name: stat["median_ms"] for name, stat in stats.items()}
    for name, stat in stats.items():
        results[name] = {
            **stat,
            "first_call_s": first_call[name] / 1000,
            "vs_default": medians["diffusers_default"] / medians[name],
            "vs_best": medians["diffusers_best"] / medians[name],
            "rel_err_vs_default": errors[name],
        }
        r = results[name]
        print(
            f"{name:18s} {r['median_ms']:7.1f} ms/step  x{r['vs_default']:.2f} vs default  "
            f"x{r['vs_best']:.2f} vs best  spread {r['spread_ms']:.1f} ms  first {r['first_call_s']:.1f} s  "
            f"rel err {r['rel_err_vs_default']:.2e}"
        )
    results["report"] = str(omni_accel.describe(eager))
    print(results["report"])
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
