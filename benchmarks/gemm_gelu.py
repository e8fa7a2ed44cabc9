"""Would cuBLASLt's GELU epilogue (``torch._addmm_activation``: the MLP's up projection and its tanh-GELU
in one pass) beat a GEMM followed by our GELU kernel? Each variant from CUDA-graph replays, at the models'
shapes, then as FLUX's blocks would use it (the single block's QKV and MLP GEMM split in two and its output
projection as two accumulating GEMMs, since the epilogue cannot write into the columns of a wider tensor).

    python benchmarks/gemm_gelu.py
"""

from __future__ import annotations

import statistics

import torch
from timing import graphed, timed

from omni_accel.layers import fused

# name: (tokens, input features, MLP width)
SHAPES = {
    "FLUX double img": (4096, 3072, 12288),
    "FLUX double txt": (512, 3072, 12288),
    "FLUX single (MLP part)": (4608, 3072, 12288),
    "FLUX ulysses/ring rank img": (2048, 3072, 12288),
    "Wan 14B": (32760, 5120, 13824),
    "Wan 14B rank": (16380, 5120, 13824),
}
DEVICE, DTYPE = "cuda", torch.bfloat16


def replayed_us(fn, calls: int = 10, replays: int = 7) -> float:
    replay = graphed(fn, calls)
    return round(1000 * statistics.median(timed(replay, "cuda")[1] / calls for _ in range(replays)), 1)


def _weights(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(rows, cols, device=DEVICE, dtype=DTYPE) / cols**0.5,
        torch.randn(rows, device=DEVICE, dtype=DTYPE),
    )


def up_projection(tokens: int, dim: int, width: int) -> dict[str, float]:
    x = torch.randn(tokens, dim, device=DEVICE, dtype=DTYPE)
    w, b = _weights(width, dim)
    return {
        "GEMM alone": replayed_us(lambda: torch.addmm(b, x, w.t())),
        "GEMM + GELU kernel": replayed_us(lambda: fused.gelu_tanh(torch.addmm(b, x, w.t())[None])),
        "GELU epilogue": replayed_us(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)),
    }


def flux_blocks(dim: int = 3072) -> dict[str, float]:
    """From the norm's output to the output projection's (single block; the attention output given), and
    a double block's image MLP from its input to the down projection's output."""
    x = torch.randn(4608, dim, device=DEVICE, dtype=DTYPE)
    attn = torch.randn(1, 4608, dim, device=DEVICE, dtype=DTYPE)
    w, b = _weights(7 * dim, dim)  # QKV and MLP-up, packed
    wo, bo = _weights(dim, 5 * dim)
    wd, bd = _weights(dim, 4 * dim)
    wq, wm, bq, bm = w[: 3 * dim], w[3 * dim :], b[: 3 * dim], b[3 * dim :]

    def single_packed():
        mlp = torch.addmm(b, x, w.t())[None, :, 3 * dim :]
        return torch.addmm(bo, fused.concat_gelu(attn, mlp)[0], wo.t())

    def single_split():
        torch.addmm(bq, x, wq.t())
        activated = torch._addmm_activation(bm, x, wm.t(), use_gelu=True)
        return torch.addmm(bo, activated, wo[:, dim:].t()).addmm_(attn[0], wo[:, :dim].t())

    img = x[:4096]
    return {
        "single: GEMM, concat-GELU, GEMM": replayed_us(single_packed),
        "single: GEMM, GEMM+GELU, two GEMMs": replayed_us(single_split),
        "double img MLP: GEMM, GELU, GEMM": replayed_us(
            lambda: torch.addmm(bd, fused.gelu_tanh(torch.addmm(bm, img, wm.t())[None])[0], wd.t())
        ),
        "double img MLP: GEMM+GELU, GEMM": replayed_us(
            lambda: torch.addmm(bd, torch._addmm_activation(bm, img, wm.t(), use_gelu=True), wd.t())
        ),
    }


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    for name, shape in SHAPES.items():
        print(name, shape, up_projection(*shape), "us", flush=True)
    print("FLUX blocks", flux_blocks(), "us", flush=True)


if __name__ == "__main__":
    main()
