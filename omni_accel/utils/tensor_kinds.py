"""What kind of tensor a weight is: one our code may read, slice and multiply as plain data, or one that
computes its own way (torchao's and GGUF's quantized tensors), is stored in a dtype that is no compute dtype
(layerwise casting's float8, raw quantized data) or holds no data (meta: offloaded). The native math, the
FP8 linears and tensor parallelism all decide by it, so it lives below them."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

_COMPUTE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


def quantized_or_absent(tensor: torch.Tensor) -> bool:
    """A weight our GEMMs cannot read as it is: a tensor subclass that computes its own way (torchao, GGUF:
    their own matmul), storage in a dtype that is not a compute dtype (float8, int8: layerwise casting or
    raw quantized data), or one with no data (meta: offloaded)."""
    return not plain_class(type(tensor)) or tensor.dtype not in _COMPUTE_DTYPES or tensor.is_meta


def _unbound(method: Any) -> Any:
    return getattr(method, "__func__", method)


_PLAIN_TORCH_FUNCTIONS = (_unbound(torch.Tensor.__torch_function__), nn.Parameter.__torch_function__)


@functools.cache
def plain_class(cls: type) -> bool:
    """A tensor class that computes as a tensor does: ``Tensor``, ``Parameter`` and subclasses that only add
    bookkeeping (``utils.watched.WatchedParameter``), not a ``__torch_function__``/``__torch_dispatch__``."""
    return _unbound(cls.__torch_function__) in _PLAIN_TORCH_FUNCTIONS and _unbound(
        cls.__torch_dispatch__
    ) is _unbound(torch.Tensor.__torch_dispatch__)


def tensor_kind(tensor: torch.Tensor) -> str:
    if not plain_class(type(tensor)):
        return f"a {type(tensor).__name__} (a quantized or wrapped tensor)"
    if tensor.is_meta:
        return "on the meta device (offloaded; loaded by a hook at call time)"
    return f"stored in {str(tensor.dtype).removeprefix('torch.')}"
