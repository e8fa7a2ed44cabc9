"""When our Triton kernels may run: written once for the fused layers, the ring merge and the Ulysses copies."""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton's CPU interpreter (the CPU tests of the kernels): no libdevice, and kernels take CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernels_can_run(*tensors: torch.Tensor) -> bool:
    """True on CUDA with Triton installed, outside compilation (inductor fuses the references itself), for
    tensors of the dtypes the kernels take."""
    return (
        HAS_TRITON
        and not torch.compiler.is_compiling()
        and all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors)
    )
