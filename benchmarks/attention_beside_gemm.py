"""Attention and an independent GEMM, one after the other or on two streams at once, at the shapes a
FLUX single block runs per GPU (one GPU; a ring=2, tp=2 or Ulysses-2 rank): does the GEMM fill the SMs the
attention kernel's last wave leaves idle?

A rank's attention at two ranks is 432 tiles of 128 queries (24 heads x 2304 queries, or 12 x 4608) on
132 SMs: four waves for 3.3 waves of work; one GPU's 864 tiles take seven for 6.5. The MLP-input GEMM of
the same block does not depend on the attention. Each variant is captured as a CUDA graph of ``--calls``
calls and replayed; median ms per call of warm replays (CUDA events), interleaved rounds.

    python benchmarks/attention_beside_gemm.py --out attention_beside_gemm.json
"""

from __future__ import annotations

import argparse

import torch
from timing import graphed, interleaved, write_json

from omni_accel.attention import get_provider

# name: (query tokens, key tokens, heads, GEMM rows, GEMM output columns), FLUX.1-dev at 1024x1024
SHAPES = {
    "one_gpu": (4608, 4608, 24, 4608, 12288),
    "ring2_rank": (2304, 4608, 24, 2304, 12288),
    "tp2_rank": (4608, 4608, 12, 4608, 6144),
    "ulysses2_rank": (4608, 4608, 12, 2304, 12288),  # both head stages' heads in one kernel
}


def _variants(shape: tuple[int, ...], provider: str) -> dict:
    q_len, kv_len, heads, rows, cols = shape
    g = torch.Generator("cuda").manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(1, q_len, heads, 128), randn(1, kv_len, heads, 128), randn(1, kv_len, heads, 128)
    x, w = randn(rows, 3072), randn(cols, 3072) / 64
    attend = get_provider(provider)
    side = torch.cuda.Stream()

    def attention():
        attend.forward(q, k, v)

    def gemm():
        torch.mm(x, w.t())

    def both_at_once(gemm_first: bool):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            if gemm_first:
                with torch.cuda.stream(side):
                    gemm()
                attention()
            else:
                attention()
                with torch.cuda.stream(side):
                    gemm()
            torch.cuda.current_stream().wait_stream(side)

        return run

    return {
        "attention": attention,
        "gemm": gemm,
        "one_after_the_other": lambda: (attention(), gemm()),
        "at_once_attention_launched_first": both_at_once(False),
        "at_once_gemm_launched_first": both_at_once(True),
    }


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--provider", default="sdpa_cudnn")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "provider": args.provider}
    for name, shape in SHAPES.items():
        replays = {
            variant: graphed(fn, args.calls, "thread_local")
            for variant, fn in _variants(shape, args.provider).items()
        }
        stats = interleaved(replays, "cuda", args.rounds, calls=3)
        results[name] = {variant: s["median_ms"] / args.calls for variant, s in stats.items()}
        row = results[name]
        row["saved_us"] = 1000 * (
            row["one_after_the_other"] - min(row[v] for v in row if v.startswith("at_once"))
        )
        print(name, {key: round(value, 4) for key, value in row.items()}, flush=True)
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
