"""Attention kernels at the shapes our models run, one provider against another: which is fastest where.

Every lossless provider that can serve the shape (PyTorch's cuDNN and flash kernels, PyTorch's own
dispatch, FlashInfer when installed) on the same bf16 inputs: median ms of warm calls (CUDA events),
TFLOP/s, the first call's time (FlashInfer JIT-compiles its kernel there: a cold start), and the largest
difference from cuDNN's output.

    python benchmarks/attention_shapes.py --out attention_shapes.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import timed, write_json

from omni_accel.attention import get_provider

# (batch, query tokens, heads, head size, key tokens, log-sum-exp returned): one GPU, one rank's share of
# the heads under ulysses=2 and one of its two head stages, and a ring=2 rank's kernels: over one block of
# keys with the LSE (the local block first, then the peer's, merged) or over all keys at once.
SHAPES = {
    "flux_1024": (1, 4608, 24, 128, 4608, False),
    "flux_1024_ulysses2": (1, 4608, 12, 128, 4608, False),
    "flux_1024_ulysses2_stage": (1, 4608, 6, 128, 4608, False),  # one of Ulysses' two head stages
    "flux_1024_ring2_block": (1, 2304, 24, 128, 2304, True),
    "flux_1024_ring2_whole": (1, 2304, 24, 128, 4608, False),
    "wan14b_480p_81f": (1, 32760, 40, 128, 32760, False),
    "wan14b_480p_81f_ulysses2": (1, 32760, 20, 128, 32760, False),
    "wan14b_480p_81f_ulysses2_stage": (1, 32760, 10, 128, 32760, False),
    "wan14b_480p_81f_ring2_block": (1, 16380, 40, 128, 16380, True),
    "wan14b_480p_81f_ring2_whole": (1, 16380, 40, 128, 32760, False),
    # the generic tier's models (benchmarks/generic_step.py's shapes): joint image + text self-attention
    "sd35_large_1024": (1, 4429, 38, 64, 4429, False),
    "zimage_1024": (1, 4352, 30, 128, 4352, False),
    "flux2_1024": (1, 4608, 48, 128, 4608, False),
    "qwenimage_1024": (1, 4352, 24, 128, 4352, False),
    "ltx2_768x512_121f_video": (1, 6144, 32, 128, 6144, False),
    "hunyuanvideo15_480p_81f": (1, 35375, 16, 128, 35375, False),
}
PROVIDERS = ("sdpa_cudnn", "sdpa_flash", "sdpa", "flashinfer")


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for shape_name in args.shapes:
        batch, tokens, heads, head_dim, kv_tokens, lse = SHAPES[shape_name]
        g = torch.Generator("cuda").manual_seed(0)
        q, k, v = (
            torch.randn(batch, n, heads, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
            for n in (tokens, kv_tokens, kv_tokens)
        )
        flops = 4 * batch * heads * tokens * kv_tokens * head_dim
        reference, rows = None, {}
        for name in PROVIDERS:
            provider = get_provider(name)
            reason = provider.unavailable_reason()
            if reason is not None:
                rows[name] = {"unavailable": reason}
                continue

            if lse and not provider.capabilities.returns_lse:
                rows[name] = {"unavailable": "does not return the log-sum-exp"}
                continue

            def call(provider=provider, q=q, k=k, v=v, lse=lse):
                out = provider.forward(q, k, v, return_lse=lse)
                return out[0] if lse else out

            out, first_ms = timed(call, "cuda")
            reference = out if reference is None else reference
            times = [timed(call, "cuda")[1] for _ in range(args.calls)]
            median = statistics.median(times)
            rows[name] = {
                "median_ms": median,
                "tflops": flops / median / 1e9,
                "first_call_ms": first_ms,
                "max_abs_diff_vs_cudnn": (out.float() - reference.float()).abs().max().item(),
            }
            print(f"{shape_name:26s} {name:12s} {median:8.2f} ms {flops / median / 1e9:6.0f} TFLOP/s "
                  f"first {first_ms / 1000:6.1f} s  diff {rows[name]['max_abs_diff_vs_cudnn']:.2e}", flush=True)  # fmt: skip
        results[shape_name] = rows
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
