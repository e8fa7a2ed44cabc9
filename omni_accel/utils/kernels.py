"""When our Triton kernels may run: written once for the fused layers, the ring merge and the Ulysses copies."""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton's CPU interpreter (the CPU tests of the kernels): no libdevice, and kernels take CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernels_can_run(*tensors: torch.Tensor, when_compiling: bool = False) -> bool:
    """True on CUDA with Triton installed, for tensors of the dtypes the kernels take; while compiling only
    for kernels that beat what inductor makes of their reference (``when_compiling``; the others' references
    are fused by inductor with their neighbours)."""
    return (
        HAS_TRITON
        and (when_compiling or not torch.compiler.is_dynamo_compiling())
        and all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors)
    )
