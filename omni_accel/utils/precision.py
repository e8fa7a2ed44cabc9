"""How float32 matmuls and convolutions round (TF32, bf16 passes or IEEE), read so that it never raises.

PyTorch 2.9 added per-backend ``fp32_precision`` settings; once a user sets one of them, the legacy getters
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.get_float32_matmul_precision()``) raise instead of
answering, while the new ones also follow what the legacy setters set. So the new ones are read wherever
this PyTorch has them.
"""

from __future__ import annotations

import torch


def float32_precision() -> tuple:
    """Every switch that decides how float32 GEMMs and convolutions round, on any backend."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        return tuple(
            getattr(where, "fp32_precision", None)
            for where in (
                backends,
                backends.cuda.matmul,
                backends.cudnn,
                getattr(backends.cudnn, "conv", None),
                getattr(backends.cudnn, "rnn", None),
                backends.mkldnn,
                getattr(backends.mkldnn, "matmul", None),
                getattr(backends.mkldnn, "conv", None),
            )
        )
    return (
        torch.get_float32_matmul_precision(),
        backends.cuda.matmul.allow_tf32,
        backends.cudnn.allow_tf32,
    )
