"""The blocks' GEMMs: at the token counts our layouts give a rank (cuBLAS, and Inductor's autotuned pick),
and the MLP's up projection with its tanh-GELU in cuBLASLt's epilogue against our GELU kernel after it."""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from omni_accel.layers import fused

from .kernels_run import Commands, Run, option
from .timing import median_ms

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
# --tiny: the same GEMMs with their widths divided by these, at token counts with the same pattern (Wan's
# rank count not a multiple of 8, beside aligned ones).
TINY_WIDTH_DIVISOR = {"flux": 48, "wan": 64}
TINY_TOKENS = {"flux": (64, 72, 32, 36), "wan": (126, 63, 56, 64)}


def gemm_shapes(run: Run, args: argparse.Namespace) -> None:
    """The blocks' GEMMs at the token counts our layouts give a rank: cuBLAS, and Inductor's autotuned pick.

    cuBLAS as the eager blocks call it (``F.linear``), and with ``--autotune`` what Inductor's autotuning
    (``max-autotune``: Triton templates against cuBLAS) picks: do autotuned GEMMs pay, and does a rank's
    token count cost GEMM efficiency (Wan's 32760 tokens split in two give 16380, not a multiple of 8)?
    Median ms and TFLOP/s per GEMM and token count."""
    eager = "cublas" if run.cuda else run.device  # the library F.linear runs
    if args.autotune and not run.cuda:
        run.skip(
            "--autotune", "needs CUDA: Inductor's max-autotune GEMMs are Triton templates against cuBLAS"
        )
    rows = run.results["rows"] = []
    g = run.generator()

    def ms(fn) -> float:
        return median_ms(fn, run.device, warmup=3, runs=args.calls)["median_ms"]

    for model in args.models:
        divisor = TINY_WIDTH_DIVISOR[model] if run.tiny else 1
        for name, k, n in GEMMS[model]:
            k, n = k // divisor, n // divisor
            weight = run.randn(n, k, generator=g) / k**0.5
            bias = run.randn(n, generator=g)
            for m in (TINY_TOKENS if run.tiny else TOKENS)[model]:
                x = run.randn(m, k, generator=g)
                row = {"model": model, "gemm": name, "m": m, "k": k, "n": n}
                row[f"{eager}_ms"] = ms(functools.partial(F.linear, x, weight, bias))
                if args.autotune and run.cuda:
                    tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                    row["autotuned_ms"] = ms(functools.partial(tuned, x, weight, bias))
                    torch._dynamo.reset()
                flop = 2 * m * k * n
                for key in [key for key in row if key.endswith("_ms")]:
                    row[key.replace("_ms", "_tflops")] = round(flop / row[key] / 1e9, 1)
                rows.append(row)
                print({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}, flush=True)


# name: (tokens, input features, MLP width)
GELU_SHAPES = {
    "FLUX double img": (4096, 3072, 12288),
    "FLUX double txt": (512, 3072, 12288),
    "FLUX single (MLP part)": (4608, 3072, 12288),
    "FLUX ulysses/ring rank img": (2048, 3072, 12288),
    "Wan 14B": (32760, 5120, 13824),
    "Wan 14B rank": (16380, 5120, 13824),
}
TINY_GELU_SHAPES = {"tiny": (64, 32, 128), "tiny rank": (32, 32, 128)}
# FLUX's blocks as _flux_blocks runs them: (tokens, image tokens, width), and at --tiny
FLUX_BLOCKS, TINY_FLUX_BLOCKS = (4608, 4096, 3072), (72, 64, 32)


def _replayed_us(run: Run, args: argparse.Namespace, fn) -> float:
    return round(1000 * run.replayed_ms(fn, args.calls, args.replays), 1)


def _weights(run: Run, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return run.randn(rows, cols) / cols**0.5, run.randn(rows)


def _up_projection(run: Run, args: argparse.Namespace, tokens: int, dim: int, width: int) -> dict[str, float]:
    x = run.randn(tokens, dim)
    w, b = _weights(run, width, dim)
    return {
        "GEMM alone": _replayed_us(run, args, lambda: torch.addmm(b, x, w.t())),
        "GEMM + GELU kernel": _replayed_us(
            run, args, lambda: fused.gelu_tanh(torch.addmm(b, x, w.t())[None])
        ),
        "GELU epilogue": _replayed_us(run, args, lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)),
    }


def _flux_blocks(run: Run, args: argparse.Namespace, tokens: int, image: int, dim: int) -> dict[str, float]:
    """From the norm's output to the output projection's (single block; the attention output given), and
    a double block's image MLP from its input to the down projection's output."""
    x = run.randn(tokens, dim)
    attn = run.randn(1, tokens, dim)
    w, b = _weights(run, 7 * dim, dim)  # QKV and MLP-up, packed
    wo, bo = _weights(run, dim, 5 * dim)
    wd, bd = _weights(run, dim, 4 * dim)
    wq, wm, bq, bm = w[: 3 * dim], w[3 * dim :], b[: 3 * dim], b[3 * dim :]

    def single_packed():
        mlp = torch.addmm(b, x, w.t())[None, :, 3 * dim :]
        return torch.addmm(bo, fused.concat_gelu(attn, mlp)[0], wo.t())

    def single_split():
        torch.addmm(bq, x, wq.t())
        activated = torch._addmm_activation(bm, x, wm.t(), use_gelu=True)
        return torch.addmm(bo, activated, wo[:, dim:].t()).addmm_(attn[0], wo[:, :dim].t())

    img = x[:image]
    return {
        "single: GEMM, concat-GELU, GEMM": _replayed_us(run, args, single_packed),
        "single: GEMM, GEMM+GELU, two GEMMs": _replayed_us(run, args, single_split),
        "double img MLP: GEMM, GELU, GEMM": _replayed_us(
            run, args, lambda: torch.addmm(bd, fused.gelu_tanh(torch.addmm(bm, img, wm.t())[None])[0], wd.t())
        ),
        "double img MLP: GEMM+GELU, GEMM": _replayed_us(
            run,
            args,
            lambda: torch.addmm(bd, torch._addmm_activation(bm, img, wm.t(), use_gelu=True), wd.t()),
        ),
    }


def gemm_gelu(run: Run, args: argparse.Namespace) -> None:
    """cuBLASLt's GELU epilogue against a GEMM followed by our GELU kernel, alone and in FLUX's blocks.

    Would cuBLASLt's GELU epilogue (``torch._addmm_activation``: the MLP's up projection and its tanh-GELU
    in one pass) beat a GEMM followed by our GELU kernel? Each variant from CUDA-graph replays (us per
    call), at the models' shapes, then as FLUX's blocks would use it (the single block's QKV and MLP GEMM
    split in two and its output projection as two accumulating GEMMs, since the epilogue cannot write into
    the columns of a wider tensor)."""
    if not run.cuda:
        run.skip(
            "cuBLASLt's GELU epilogue and our Triton GELU kernel",
            f"need CUDA: on {run.device} _addmm_activation is the GEMM then a GELU, and fused runs PyTorch's GELU",
        )
    torch.manual_seed(0)
    for name, shape in (TINY_GELU_SHAPES if run.tiny else GELU_SHAPES).items():
        run.results[name] = _up_projection(run, args, *shape)
        print(name, shape, run.results[name], "us", flush=True)
    run.results["FLUX blocks"] = _flux_blocks(run, args, *(TINY_FLUX_BLOCKS if run.tiny else FLUX_BLOCKS))
    print("FLUX blocks", run.results["FLUX blocks"], "us", flush=True)


def register(commands: Commands) -> None:
    parser = commands.add("gemm-shapes", gemm_shapes)
    parser.add_argument("--models", nargs="+", choices=list(GEMMS), default=list(GEMMS))
    parser.add_argument("--autotune", action="store_true", help="also Inductor's max-autotune GEMM")
    option(parser, "--calls", 20, 2, "timed calls per GEMM")

    parser = commands.add("gemm-gelu", gemm_gelu)
    option(parser, "--calls", 10, 2, "calls per captured graph")
    option(parser, "--replays", 7, 2, "timed replays per variant")
