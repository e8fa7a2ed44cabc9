"""The blocks' GEMMs at the token counts our layouts give a rank: cuBLAS as the eager blocks call it, and
what Inductor's autotuning (``max-autotune``: Triton templates against cuBLAS) picks, to see whether
autotuned GEMMs pay and whether a rank's token count costs GEMM efficiency (Wan's 32760 tokens split in
two give 16380, not a multiple of 8).

    python benchmarks/gemm_shapes.py --out gemm_shapes.json
    python benchmarks/gemm_shapes.py --models flux --autotune   # adds the autotuned GEMM per shape
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from timing import median_ms, write_json

# Per model, a block's GEMMs as (name, input features, output features), and the token counts to run them
# at: one GPU, a rank under ulysses=2, and the neighbouring aligned counts.
GEMMS = {
    "flux": [
        ("double: img QKV", 3072, 9216),
        ("double: img out", 3072, 3072),
        ("double: img MLP up", 3072, 12288),
        ("double: img MLP down", 12288, 3072),
        ("single: QKV + MLP up", 3072, 21504),
        ("single: out", 15360, 3072),
    ],
    "wan": [
        ("self QKV", 5120, 15360),
        ("self out", 5120, 5120),
        ("MLP up", 5120, 13824),
        ("MLP down", 13824, 5120),
    ],
}
TOKENS = {"flux": (4096, 4608, 2048, 2304), "wan": (32760, 16380, 16376, 16384)}


def _ms(fn, calls: int) -> float:
    return median_ms(fn, "cuda", warmup=3, runs=calls)["median_ms"]


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(GEMMS), default=list(GEMMS))
    parser.add_argument("--autotune", action="store_true", help="also Inductor's max-autotune GEMM")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    g = torch.Generator("cuda").manual_seed(0)
    for model in args.models:
        for name, k, n in GEMMS[model]:
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
            for m in TOKENS[model]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                row = {"model": model, "gemm": name, "m": m, "k": k, "n": n}
                row["cublas_ms"] = _ms(functools.partial(F.linear, x, weight, bias), args.calls)
                if args.autotune:
                    tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                    row["autotuned_ms"] = _ms(functools.partial(tuned, x, weight, bias), args.calls)
                    torch._dynamo.reset()
                flop = 2 * m * k * n
                for key in [key for key in row if key.endswith("_ms")]:
                    row[key.replace("_ms", "_tflops")] = round(flop / row[key] / 1e9, 1)
                results["rows"].append(row)
                print({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
