"""Fused elementwise steps of the native blocks: one pass over the activations where PyTorch's eager ops
make several (each a full read and write of a 4608 x 3072 tensor at FLUX's size).

* ``norm_modulate``: LayerNorm (no affine) then AdaLN, ``norm(x) * (1 + scale) + shift``;
* ``gated_residual``: ``x + gate * y``;
* ``gelu_tanh`` and ``concat_gelu``: GELU (tanh) in one bandwidth-bound pass, the latter writing it next to
  another tensor (a single-stream block's attention output) so the MLP half is never concatenated;
  ``swiglu`` and ``concat_swiglu`` the same for a SwiGLU MLP (Diffusers' ops, fused by the compiler);
* ``qkv_norm_rope``: RMSNorm (per head, or across all heads as Wan's) then RoPE of q and k of one or more
  sequence segments (text, image), written straight into the joint ``[B, S, H, D]`` tensors attention
  reads (or where a parallel layout's exchange wants each head), v joined in the same pass (no
  concatenation).

Each computes in float32 and rounds once (Diffusers' unfused ops round after every op), so a bf16 result
may differ from Diffusers' by a rounding step, as two of Diffusers' own kernels do. On CUDA
with Triton installed the kernels run as ``torch.library`` custom ops (with fakes, so a traced graph can
hold them); on CPU or without Triton the reference runs, so the CPU suite stays exact against Diffusers.
While compiling, the norm and residual references are left to inductor (which fuses them with their
neighbours); the GELU and q/k/v kernels stay, being faster than inductor's versions of their references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..parallel.placement import Placement
from ..parallel.token_rows import Rows, gather_targets, gathered_together
from ..utils.kernels import HAS_TRITON, kernels_can_run
from ..utils.triton_builds import first_launches
from .fp8 import Fp8Rows, quantize_rows
from .modulation import modulate
from .norms import layer_norm
from .rope import apply_rope


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``modulate(layer_norm(x, eps), shift, scale)`` for ``x`` ``[B, S, D]`` and ``[B, D]`` (per sample) or
    ``[B, S, D]`` (per token) modulation. The modulation's dtype is the precision of the math (Wan keeps
    it in float32, FLUX in the activations' dtype); the result has ``x``'s dtype."""
    if _norm_modulate_kernel_serves(x, shift, scale):
        return torch.ops.omni_accel.norm_modulate(x, shift, scale, eps)
    return norm_modulate_reference(x, shift, scale, eps)


def norm_modulate_reference(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """``norm_modulate`` in PyTorch's ops (as each reference below: CPU, and CUDA until our kernel is built
    in the process, ``utils/triton_builds.py``)."""
    return modulate(layer_norm(x.to(shift.dtype), eps), shift, scale).to(x.dtype)


def norm_modulate_fp8(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> Fp8Rows:
    """``quantize_rows(norm_modulate(x, shift, scale, eps))``, on CUDA in one kernel that never writes the
    bf16 rows (the input of an FP8 GEMM that nothing else reads)."""
    if _norm_modulate_kernel_serves(x, shift, scale):
        data, row_scale = torch.ops.omni_accel.norm_modulate_fp8(x, shift, scale, eps)
        return Fp8Rows(data, row_scale, tuple(x.shape[:-1]), x.dtype)
    return quantize_rows(norm_modulate(x, shift, scale, eps))


def norm_modulate_gathered(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    rows: Rows | None,
    quantized: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, Rows | None]:
    """``norm_modulate`` for the input of a column-split projection under tensor parallelism with the
    tokens split (``rows``): where the gather is by peer writes, every rank's tokens joined, written into
    the gather's buffers by the kernel itself (no copy), and None; else this rank's tokens and ``rows``,
    which the projection then gathers (``apply_linear(h, weights, rows)`` either way)."""
    return norm_modulate_gathered_together([(x, shift, scale, rows)], eps, [quantized])[0]


def norm_modulate_gathered_together(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Rows | None]],
    eps: float,
    quantized: Sequence[bool] = (),
) -> list[tuple[torch.Tensor | Fp8Rows, Rows | None]]:
    """``norm_modulate_gathered`` of each ``(x, shift, scale, rows)`` (independent streams of a block, of
    one TP group): their gathers by peer writes end behind one barrier. ``quantized[i]``: item ``i``'s
    result feeds only an FP8 GEMM (``projection.takes_fp8_rows``); unless its tokens are gathered, it comes
    quantized (``norm_modulate_fp8``)."""
    results, targets = [], []
    for i, (x, shift, scale, rows) in enumerate(items):
        if rows is None and i < len(quantized) and quantized[i]:
            results.append((norm_modulate_fp8(x, shift, scale, eps), None))
            continue
        target = None if rows is None else gather_targets(x, rows)
        if target is None:
            results.append((norm_modulate(x, shift, scale, eps), rows))
            continue
        if _norm_modulate_kernel_serves(x, shift, scale):
            for start, length, places in target.segments:
                fused_kernels.norm_modulate_into(x.narrow(1, start, length), shift, scale, eps, list(places))
        else:
            target.write(norm_modulate(x, shift, scale, eps))
        targets.append(target)
        results.append(None)
    joined = iter(gathered_together(targets))
    return [(next(joined), None) if result is None else result for result in results]


def _norm_modulate_kernel_serves(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> bool:
    """The kernel takes per-sample modulation and rows with unit stride."""
    return shift.ndim == 2 and x.stride(-1) == 1 and kernels_can_run(x, shift, scale)


_FP16_MAX = 65504.0


def clip_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` clipped to float16's range when it is float16 (as Diffusers' MMDiT blocks end), else ``x``."""
    return x.clip(-_FP16_MAX, _FP16_MAX) if x.dtype == torch.float16 else x


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` for ``[B, S, D]`` activations and a ``[B, D]`` (per sample) or ``[B, S, D]`` (per
    token) gate, in the gate's precision if it is wider; the result has ``x``'s dtype."""
    if (
        gate.ndim == 2
        and x.is_contiguous()
        and y.is_contiguous()
        and kernels_can_run(x, gate, y)
        and x.dtype == y.dtype
    ):
        return torch.ops.omni_accel.gated_residual(x, gate, y)
    return gated_residual_reference(x, gate, y)


def gated_residual_reference(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x + (gate.unsqueeze(1) if gate.ndim == 2 else gate) * y).to(x.dtype)


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` for ``[B, S, D]`` activations (rows maybe strided), written into
    ``out`` when given (maybe columns of a wider tensor) and returned."""
    if out is None:
        return concat_gelu(x[..., :0], x)
    if _gelu_kernel_serves(x, out) and not torch.compiler.is_dynamo_compiling():
        with first_launches() as launches:
            if not launches.deferred:
                fused_kernels.concat_gelu_into(x[..., :0], x, out)
        if not launches.deferred:
            return out
    return out.copy_(F.gelu(x, approximate="tanh"))


def concat_gelu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``cat([a, gelu_tanh(b)], dim=-1)`` for ``[B, S, D]`` tensors (rows maybe strided)."""
    if _gelu_kernel_serves(a, b):
        return torch.ops.omni_accel.concat_gelu(a, b)
    return concat_gelu_reference(a, b)


def concat_gelu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    activated = F.gelu(b, approximate="tanh")
    return activated if a.shape[-1] == 0 else torch.cat([a, activated], dim=-1)


def concat_gelu_fp8(a: torch.Tensor, b: torch.Tensor) -> Fp8Rows:
    """``quantize_rows(concat_gelu(a, b))``, on CUDA in one kernel that never writes the bf16 rows."""
    if _gelu_kernel_serves(a, b):
        data, row_scale = torch.ops.omni_accel.concat_gelu_fp8(a, b)
        return Fp8Rows(data, row_scale, tuple(b.shape[:-1]), b.dtype)
    return quantize_rows(concat_gelu(a, b))


def gelu_tanh_fp8(x: torch.Tensor) -> Fp8Rows:
    """``quantize_rows(gelu_tanh(x))`` (an MLP's activation feeding an FP8 down projection)."""
    return concat_gelu_fp8(x[..., :0], x)


def swiglu(x: torch.Tensor, gate_first: bool = True) -> torch.Tensor:
    """SwiGLU of a projection packing its gate and linear halves, ``x = [gate, linear]`` (FLUX.2's MLPs;
    ``gate_first`` False: ``[linear, gate]``, Diffusers' ``SwiGLU``): ``silu(gate) * linear``. Under tp each
    rank holds its slice of both halves, in the same order."""
    gate, linear = x.chunk(2, dim=-1) if gate_first else x.chunk(2, dim=-1)[::-1]
    return F.silu(gate) * linear


def concat_swiglu(a: torch.Tensor, gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """``cat([a, silu(gate) * linear], dim=-1)``, the product written into its columns of the result (the
    MLP half, the widest, never concatenated); Diffusers' ops and roundings, which compiled code fuses."""
    if torch.compiler.is_dynamo_compiling():  # no out= into columns there; inductor writes them in place
        return torch.cat([a, F.silu(gate) * linear], dim=-1)
    width = a.shape[-1]
    out = a.new_empty(*a.shape[:-1], width + gate.shape[-1])
    out[..., :width] = a
    torch.mul(F.silu(gate), linear, out=out[..., width:])
    return out


def _gelu_kernel_serves(*tensors: torch.Tensor) -> bool:
    """The GELU kernel takes ``[B, S, D]`` tensors of one dtype with evenly spaced rows."""
    return (
        all(t.ndim == 3 and _evenly_spaced_rows(t) and t.dtype == tensors[0].dtype for t in tensors)
        and kernels_can_run(*tensors, when_compiling=True)  # inductor's GELU is tanhf's, compute-bound
    )


def _evenly_spaced_rows(x: torch.Tensor) -> bool:
    """``[B, S, D]`` whose ``B * S`` rows are contiguous and one stride apart, as the kernel indexes them."""
    return x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))


Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def qkv_norm_rope(
    segments: Sequence[Segment],
    weights: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
    head_dim: int,
    eps: float | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    across_heads: bool = False,
    placement: Placement | None = None,
) -> Segment:
    """Attention's joint BSHD ``q, k, v`` from the projections of one or more sequence segments (text,
    image): ``q`` and ``k`` RMSNormed with their segment's ``weights`` (per head as FLUX's, or
    ``across_heads`` over the whole row with a weight per channel as Wan's) then rotated, ``v`` joined.
    Each ``(q_i, k_i, v_i)`` is ``[B, S_i, H * head_dim]``, maybe strided views of a packed projection; a
    lone segment's ``v`` is returned as a view, not copied. ``placement``: where the layout wants them
    (``layers.attention.input_placement``); what attention takes from there is returned."""
    qs, ks, vs = (list(t) for t in zip(*segments, strict=True))
    q_weights, k_weights = (list(w) for w in zip(*weights, strict=True))
    if (
        rope is not None
        and (rope[0].ndim == 2 or rope[0].shape[0] == 1)  # one table for every sample
        and head_dim & (head_dim - 1) == 0  # a power of two: the kernel holds a head in one tile
        and all(w is not None for w in q_weights + k_weights)
        and all(t.stride(-1) == 1 for t in qs + ks + vs)
        and kernels_can_run(*qs, *ks, *vs, *q_weights, *k_weights, when_compiling=True)
    ):
        if placement is not None and not torch.compiler.is_dynamo_compiling():
            first = qs[0]
            shape = (first.shape[0], sum(t.shape[1] for t in qs), first.shape[2] // head_dim, head_dim)
            q = first.new_empty(shape) if placement.q is None else None
            args = (qs, ks, vs, q_weights, k_weights, head_dim, eps, *rope, across_heads)
            fused_kernels.qkv_norm_rope_into(*args, placement.pieces(q))
            return placement.written(q)
        joint_vs = vs if len(segments) > 1 else []
        q, k, *v = torch.ops.omni_accel.qkv_norm_rope(
            qs, ks, joint_vs, q_weights, k_weights, head_dim, eps, *rope, across_heads
        )
        return _placed(placement, q, k, v[0] if v else vs[0].unflatten(-1, (-1, head_dim)))
    q, k, v = qkv_norm_rope_reference(qs, ks, vs, q_weights, k_weights, head_dim, eps, rope, across_heads)
    return _placed(placement, q, k, v)


def qkv_norm_rope_reference(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    q_weights: Sequence[torch.Tensor | None],
    k_weights: Sequence[torch.Tensor | None],
    head_dim: int,
    eps: float | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    across_heads: bool,
) -> list[torch.Tensor]:
    """The joint ``[q, k]`` of ``qkv_norm_rope``, and ``v`` when ``vs`` is not empty."""

    def norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if across_heads:
            return F.rms_norm(x, (x.shape[-1],), w, eps).unflatten(-1, (-1, head_dim))
        return F.rms_norm(x.unflatten(-1, (-1, head_dim)), (head_dim,), w, eps)

    q = _joint([norm(x, w) for x, w in zip(qs, q_weights, strict=True)])
    k = _joint([norm(x, w) for x, w in zip(ks, k_weights, strict=True)])
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return [q, k, _joint([x.unflatten(-1, (-1, head_dim)) for x in vs])] if vs else [q, k]


def _joint(segments: list[torch.Tensor]) -> torch.Tensor:
    return segments[0] if len(segments) == 1 else torch.cat(segments, dim=1)


def _placed(placement: Placement | None, q, k, v) -> Segment:
    return (q, k, v) if placement is None else placement.place(q, k, v)


if HAS_TRITON:
    from . import fused_kernels  # registers the custom ops
