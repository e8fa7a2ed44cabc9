"""Kernel micro-benchmarks at our models' shapes, one subcommand per measurement.

    attention-shapes       attention providers (cuDNN, flash, SDPA's dispatch, FlashInfer) per model shape
    masked-attention       a key-padding mask at Qwen-Image's shape: dense mask, pinned kernels, mask-free ways
    attention-beside-gemm  attention and an independent GEMM in turn or on two streams (FLUX single block)
    attention-plans-per-thread  whether a cuDNN plan built on one thread serves another's first call
    lossy-attention        the lossy providers (FlashInfer FP8, SageAttention) against fp64, by key length
    gemm-shapes            the blocks' GEMMs at a rank's token counts: cuBLAS, and Inductor's autotuned pick
    gemm-gelu              cuBLASLt's GELU epilogue against a GEMM then our GELU kernel
    fused-kernels          bandwidth of our fused elementwise kernels against a device copy
    power-floor            a FLUX step's GEMMs and attention alone, burst and sustained, against our step
    collectives            bandwidth of the parallel layouts' exchanges on two GPUs (NCCL, symmetric memory)
    overlap                whether a Ulysses transfer runs beside the attention kernel on two GPUs

    python benchmarks/kernel_bench.py attention-shapes --out attention_shapes.json
    python benchmarks/kernel_bench.py masked-attention --out masked_attention.json
    python benchmarks/kernel_bench.py attention-beside-gemm --out attention_beside_gemm.json
    python benchmarks/kernel_bench.py attention-plans-per-thread
    python benchmarks/kernel_bench.py lossy-attention --out lossy_attention.json
    python benchmarks/kernel_bench.py gemm-shapes --models flux --autotune --out gemm_shapes.json
    python benchmarks/kernel_bench.py gemm-gelu
    python benchmarks/kernel_bench.py fused-kernels
    python benchmarks/kernel_bench.py power-floor --out floor.json
    torchrun --nproc-per-node 2 benchmarks/kernel_bench.py collectives --shape wan
    torchrun --nproc-per-node 2 benchmarks/kernel_bench.py overlap

Each runs on one CUDA GPU in bf16 (collectives and overlap on two, under torchrun) and prints its rows;
``--out`` also writes them as JSON. ``--tiny`` runs any of them at small shapes on the CPU in fp32 in
seconds (collectives and overlap as two forked processes over gloo), a smoke run of the same code; it
prints one ``skipped:`` line naming what needs CUDA (graphs, streams, Triton or cuDNN kernels, peer
memory) and why.
``python benchmarks/kernel_bench.py <subcommand> --help`` lists its options.

(Not ``kernels.py``: every script here has ``benchmarks/`` on its path, where that name would shadow
Hugging Face's ``kernels`` package, which transformers imports when it is installed.)
"""

from __future__ import annotations

from typing import Any

import torch
from harness import kernels_attention, kernels_comm, kernels_floor, kernels_fused, kernels_gemm
from harness.kernels_run import Commands, Run


def commands() -> Commands:
    """Every subcommand, registered by the harness module that measures it."""
    commands = Commands(__doc__)
    for module in (kernels_attention, kernels_gemm, kernels_fused, kernels_floor, kernels_comm):
        module.register(commands)
    return commands


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs one subcommand; returns its results (what ``--out`` writes)."""
    args = commands().parse(argv)
    run = Run.start(args.tiny)
    threads = torch.get_num_threads()
    if args.tiny:  # tiny ops gain nothing from threads, and wait on every busy core they use
        torch.set_num_threads(1)
    try:
        with torch.no_grad():
            args.measure(run, args)
    finally:
        torch.set_num_threads(threads)
    return run.finish(args.out)


if __name__ == "__main__":
    main()
