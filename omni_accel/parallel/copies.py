"""``dst.copy_(src)`` for the permuted layouts around Ulysses' all-to-alls, at memory speed.

Packing a stage's heads rank by rank (and unpacking the output) permutes tensors whose innermost run (a
rank's heads times the head size) is contiguous on both sides. PyTorch copies such permutations with its
generic strided kernel, far below a plain copy's bandwidth (docs/PARALLELISM.md); the Triton kernel here
moves whole rows instead. Elsewhere (CPU, no Triton, short rows) it is ``dst.copy_(src)``.
"""

from __future__ import annotations

import torch

from ..utils.kernels import HAS_TRITON, INTERPRETED
from ..utils.triton_builds import wait_for_driver

_KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"  # the interpreter (CPU tests) takes CPU tensors
_MIN_ROW = 64  # shorter contiguous runs are left to PyTorch
_OUTER_DIMS = 3


def copy_rows_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` (same shape and dtype); returns ``dst``."""
    use_kernel = HAS_TRITON and dst.device.type == _KERNEL_DEVICE and not torch.compiler.is_dynamo_compiling()
    plan = _rows(dst, src) if use_kernel else None
    if plan is None:
        return dst.copy_(src)
    sizes, dst_strides, src_strides, length = plan
    wait_for_driver()
    block = min(triton.next_power_of_2(length), 4096)
    grid = (sizes[0] * sizes[1] * sizes[2], triton.cdiv(length, block))
    _copy_rows_kernel[grid](dst, src, sizes[1], sizes[2], *dst_strides, *src_strides, length, BLOCK=block)
    return dst


def _rows(dst: torch.Tensor, src: torch.Tensor):
    """(outer sizes, dst strides, src strides, row length) of the copy as rows contiguous on both sides,
    at most three outer dims; None when the layouts do not allow it."""
    if dst.shape != src.shape or dst.dtype != src.dtype or src.device != dst.device or not dst.numel():
        return None
    dims = [(n, ds, ss) for n, ds, ss in zip(dst.shape, dst.stride(), src.stride(), strict=True) if n != 1]
    length = 1
    while dims and dims[-1][1] == dims[-1][2] == length:
        length *= dims.pop()[0]
    if length < _MIN_ROW or len(dims) > _OUTER_DIMS:
        return None
    dims = [(1, 0, 0)] * (_OUTER_DIMS - len(dims)) + dims
    sizes, dst_strides, src_strides = zip(*dims, strict=True)
    return sizes, dst_strides, src_strides, length


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows_kernel(DST, SRC, n1, n2, d0, d1, d2, s0, s1, s2, length, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i2 = row % n2
        i1 = (row // n2) % n1
        i0 = row // (n1 * n2)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < length
        x = tl.load(SRC + i0 * s0 + i1 * s1 + i2 * s2 + cols, mask=mask)
        tl.store(DST + i0 * d0 + i1 * d1 + i2 * d2 + cols, x, mask=mask)
