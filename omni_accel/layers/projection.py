"""Projections read from a Diffusers module's own linears: plain, LoRA-wrapped, or packed into one GEMM.

A native block owns no weights. At each call it reads the weights of the Diffusers submodules it adopted,
so whatever a user does to them (load LoRA, scale or disable adapters, ``load_state_dict``, ``.to()``)
is what runs. ``read_linear`` turns one such submodule into ``LinearWeights`` (the base weight and the
active, unmerged low-rank adapter terms, exactly as peft would apply them), or says why it cannot, in
which case the caller runs Diffusers' own forward.

Packing: the weights of projections that read the same input (Q, K, V...) are moved into one storage and
each Diffusers parameter becomes a view of its rows (``pack``), so one GEMM serves them all at no extra
memory and the Diffusers names stay valid. Anything that breaks the views (``deepcopy``, ``.to()``,
``load_state_dict(assign=True)``, a safe LoRA fuse) is noticed on the next call by a host-side check of
storage and offsets, and the projection is packed again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.comm import all_reduce_sum
from ..parallel.token_rows import (
    Rows,
    SumInFlight,
    gather_rows,
    linear_of_gathered,
    start_sum,
    sum_together,
)
from ..utils.kernels import HAS_TRITON, kernels_can_run
from ..utils.storage import contiguous_run
from ..utils.tensor_kinds import quantized_or_absent, tensor_kind
from .fp8 import Fp8Rows, Fp8Weight, Fp8Weights, fp8_linear, fp8_reason, weight_only_linear

_PACK_LOCK = threading.Lock()


@dataclass(frozen=True)
class LowRank:
    """One active LoRA adapter: ``up(down(x)) * scale`` added to the base output, as peft computes it."""

    down: torch.Tensor
    up: torch.Tensor
    up_bias: torch.Tensor | None
    scale: (
        torch.Tensor
    )  # 0-d, on the CPU: a compiled graph takes it as an input, so a new scale is no recompile
    cast_input: bool


@dataclass(frozen=True)
class LinearWeights:
    """The effective weights of one projection, or of several packed side by side (``sizes``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None  # of an input-split projection: on the group's first rank only
    sizes: tuple[int, ...]
    adapters: tuple[tuple[LowRank, ...], ...]  # per packed output
    reduce: dist.ProcessGroup | None = None  # tensor-parallel input split: outputs are summed over this group
    sources: tuple[torch.Tensor, ...] = ()  # the parameters ``weight`` is made of (one per packed linear)
    fp8: Fp8Weight | None = None  # its e4m3 copy, when the GEMM runs in FP8 (``layers.fp8``)
    weight_only: bool = False  # with ``fp8``: the inputs stay unquantized (a per-sample projection)


class Unsupported(Exception):
    """A submodule the native path cannot read; the message says why (and the block runs Diffusers')."""


def _is_adapter_layer(module: nn.Module) -> bool:
    if type(module) is nn.Linear:  # the common case, without three failing attribute probes
        return False
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "scaling")


def _plain_linear(module: nn.Module, where: str) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise Unsupported(f"{where} is a {type(module).__name__}, not a plain nn.Linear")
    for name in ("weight", "bias"):
        tensor = module._parameters[name]
        if tensor is not None and quantized_or_absent(tensor):
            raise Unsupported(
                f"{where}.{name} is {tensor_kind(tensor)}: the block runs as the Diffusers module computes"
            )
    return module


def _adapters(layer: nn.Module, where: str) -> tuple[nn.Linear, tuple[LowRank, ...]]:
    """The base linear and the adapter terms peft's ``lora.Linear.forward`` would add, in its order."""
    base = _plain_linear(layer.get_base_layer(), f"{where}.base_layer")
    if layer.disable_adapters:
        if layer.merged:
            raise Unsupported(f"{where}: adapters disabled while merged (peft unmerges them on the call)")
        return base, ()
    if layer.merged:  # the merged deltas are in the base weight already
        return base, ()
    terms = []
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in getattr(layer, "lora_variant", {}):
            raise Unsupported(f"{where}: adapter {name!r} is a LoRA variant (DoRA...)")
        dropout = layer.lora_dropout[name]
        if not isinstance(dropout, nn.Identity) and dropout.training and dropout.p > 0:
            raise Unsupported(f"{where}: adapter {name!r} applies dropout (training mode)")
        down = _plain_linear(layer.lora_A[name], f"{where}.lora_A[{name!r}]")
        up = _plain_linear(layer.lora_B[name], f"{where}.lora_B[{name!r}]")
        if down.bias is not None:
            raise Unsupported(f"{where}: adapter {name!r} has a bias on lora_A")
        cast = getattr(layer, "cast_input_dtype_enabled", True)
        terms.append(LowRank(down.weight, up.weight, up.bias, _scale_tensor(layer.scaling[name]), cast))
    return base, tuple(terms)


_SCALES: dict[float, torch.Tensor] = {}


def _scale_tensor(scale: float) -> torch.Tensor:
    """The 0-d tensor of ``scale``, one per value (a few distinct scales are in use at any time)."""
    tensor = _SCALES.get(scale)
    if tensor is None:
        if len(_SCALES) >= 256:
            _SCALES.clear()
        tensor = _SCALES[scale] = torch.tensor(float(scale), dtype=torch.float64)
    return tensor


def _resolve(module: nn.Module, where: str) -> tuple[nn.Linear, tuple[LowRank, ...]]:
    base, terms = (
        _adapters(module, where) if _is_adapter_layer(module) else (_plain_linear(module, where), ())
    )
    shard = getattr(base, "omni_tp", None)  # set by tensor parallelism: adapters take the same slice
    if shard is not None:
        terms = tuple(_local_term(term, shard) for term in terms)
    return base, terms


def _local_term(term: LowRank, shard) -> LowRank:
    """The adapter term acting on this rank's slice: an output split slices ``up``, an input split ``down``."""
    if shard.reduces:
        return replace(term, down=shard.take(term.down, 1))
    up_bias = None if term.up_bias is None else shard.take(term.up_bias, 0)
    return replace(term, up=shard.take(term.up, 0), up_bias=up_bias)


def _local_size(base: nn.Linear) -> int:
    return base.weight.shape[0]  # out_features stays the full size under tensor parallelism


def read_linear(module: nn.Module, where: str, parts_attr: str = "") -> LinearWeights:
    """The weights of one Diffusers linear (maybe LoRA-wrapped); raises ``Unsupported`` with the reason.
    ``parts_attr``: the linear's attribute listing the full sizes of the projections packed in its outputs
    (Diffusers' ``_tp_packed_col_blocks``): they come out as parts, as from ``read_packed``, this rank's
    slice of each under tensor parallelism."""
    base, terms = _resolve(module, where)
    shard = getattr(base, "omni_tp", None)
    reduce = shard.group if shard is not None and shard.reduces else None
    bias = None if reduce is not None and shard.rank != 0 else base.bias  # summed over the ranks: once
    weights = LinearWeights(base.weight, bias, (_local_size(base),), (terms,), reduce, (base.weight,))
    return _in_parts(weights, _local_parts(base, parts_attr, where)) if parts_attr else weights


def _local_parts(base: nn.Linear, parts_attr: str, where: str) -> tuple[int, ...]:
    """This rank's sizes of the projections packed in ``base``'s outputs."""
    parts = tuple(getattr(base, parts_attr, None) or ())
    if sum(parts) != base.out_features:
        raise Unsupported(
            f"{where}: its {parts_attr} {list(parts)} does not list its {base.out_features} outputs"
        )
    shard = getattr(base, "omni_tp", None)
    if shard is None:
        return parts
    if shard.dim != 0 or shard.parts != parts:
        raise Unsupported(
            f"{where} is split over the TP ranks other than by its packed outputs {list(parts)}"
        )
    return tuple(part // shard.size for part in parts)


def _in_parts(weights: LinearWeights, sizes: tuple[int, ...]) -> LinearWeights:
    """One projection's outputs as the parts ``sizes`` (one GEMM still), each with its rows of the adapters."""
    (terms,) = weights.adapters
    adapters, start = [], 0
    for size in sizes:
        adapters.append(_adapter_rows(terms, slice(start, start + size)))
        start += size
    return replace(weights, sizes=sizes, adapters=tuple(adapters))


def _adapter_rows(terms: tuple[LowRank, ...], rows: slice) -> tuple[LowRank, ...]:
    """The adapter terms of output rows ``rows`` of their projection."""
    return tuple(
        replace(t, up=t.up[rows], up_bias=None if t.up_bias is None else t.up_bias[rows]) for t in terms
    )


def read_packed(modules: Sequence[nn.Module], paths: Sequence[str]) -> LinearWeights:
    """The weights of several linears that read one input, as one packed GEMM (packing them if needed).
    ``paths``: each linear's name in the block, as Diffusers names it (what an ``Unsupported`` reason says)."""
    resolved = [_resolve(m, path) for m, path in zip(modules, paths, strict=True)]
    bases = [base for base, _ in resolved]
    packed = _packed_view(bases)
    if packed is None:
        with _PACK_LOCK:
            packed = _packed_view(bases)
            if packed is None:
                pack(bases)
                packed = _packed_view(bases)
    weight, bias = packed
    return LinearWeights(
        weight,
        bias,
        tuple(_local_size(b) for b in bases),
        tuple(terms for _, terms in resolved),
        sources=tuple(b.weight for b in bases),
    )


def with_fp8(weights: LinearWeights, store: Fp8Weights, weight_only: bool = False) -> LinearWeights:
    """``weights`` with the e4m3 copy of their weight from ``store`` (made if needed), or as they are where
    the FP8 GEMM cannot take them (``store.declined`` counts why). ``weight_only``: a per-sample projection
    (the AdaLN modulation), its few rows multiplied unquantized (``layers.fp8.weight_only_linear``)."""
    reason = fp8_reason(weights.weight)
    if reason is not None:
        store.declined.count(reason)
        return weights
    return replace(weights, fp8=store.of(weights.weight, weights.sources), weight_only=weight_only)


def takes_fp8_rows(weights: LinearWeights) -> bool:
    """The projection's GEMM runs in FP8 and nothing else reads its input (no adapter): the kernel making
    the input may write it quantized (``layers.fp8.Fp8Rows``) instead of in bf16."""
    return weights.fp8 is not None and not weights.weight_only and not any(weights.adapters)


def prepack(modules: Sequence[nn.Module], paths: Sequence[str]) -> None:
    """Packs the linears of ``modules`` (as ``read_packed`` would at a call) when they can be; a projection
    that cannot (quantized, offloaded, mixed dtypes...) is left alone and says why at its calls."""
    with contextlib.suppress(Unsupported):
        read_packed(modules, paths)


def unpack(modules: Sequence[nn.Module], paths: Sequence[str]) -> None:
    """Undoes ``pack`` of these linears: each weight and bias gets a storage of its own again, as Diffusers
    made them. ``restore`` calls it, so that a restored module is laid out as before ``accelerate`` (savers
    such as safetensors' ``save_model`` refuse or drop parameters that are views of one storage)."""
    with contextlib.suppress(Unsupported):
        bases = [_resolve(m, path)[0] for m, path in zip(modules, paths, strict=True)]
        if len(bases) == 1 or _packed_view(bases) is None:
            return
        with torch.inference_mode(False), torch.no_grad():
            for base in bases:
                for param in (base.weight, base.bias):
                    if param is not None:
                        param.data = param.data.clone()


def _packed_view(bases: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if len(bases) == 1:
        return bases[0].weight, bases[0].bias
    weight = contiguous_run([b.weight for b in bases])
    if weight is None:
        return None
    if bases[0].bias is None:
        return (weight, None) if all(b.bias is None for b in bases) else None
    if any(b.bias is None for b in bases):
        return None
    bias = contiguous_run([b.bias for b in bases])
    return None if bias is None else (weight, bias)


def _check_packable(bases: Sequence[nn.Linear]) -> None:
    first = bases[0].weight
    for base in bases:
        for param in (base.weight, base.bias):
            if param is None:
                continue
            if (param.dtype, param.device) != (first.dtype, first.device) or param.is_meta:
                raise Unsupported(
                    f"packed projections hold {param.dtype} on {param.device} and {first.dtype} on "
                    f"{first.device}; put the model on one dtype and device"
                )
        if base.in_features != bases[0].in_features:
            raise Unsupported("packed projections read inputs of different sizes")
    if len({b.bias is None for b in bases}) > 1:
        raise Unsupported("some packed projections have a bias and some do not")


def pack(bases: Sequence[nn.Linear]) -> None:
    """Moves the weights (and biases) of ``bases`` into one storage; each parameter becomes a view of it.

    Outside inference mode whatever mode the caller is in: parameters made of inference tensors could never
    take part in autograd again (a later ``requires_grad_``, LoRA training or input gradients would fail,
    even after ``restore``)."""
    if len(bases) == 1:
        return
    _check_packable(bases)
    names = ["weight"] if bases[0].bias is None else ["weight", "bias"]
    with torch.inference_mode(False), torch.no_grad():
        for name in names:
            params = [getattr(b, name) for b in bases]
            storage = torch.cat([p.detach() for p in params])
            start = 0
            for param in params:
                param.data = storage[start : start + param.shape[0]]
                start += param.shape[0]


def split_packed(weights: LinearWeights, count: int) -> tuple[LinearWeights, LinearWeights]:
    """The first ``count`` packed projections and the others, as two (views of the same weights), for
    callers that run their GEMMs apart."""
    if weights.reduce is not None:
        raise ValueError("only output-packed projections without a collective can be split")
    at = sum(weights.sizes[:count])

    def part(rows: slice, parts: slice) -> LinearWeights:
        bias = None if weights.bias is None else weights.bias[rows]
        return replace(
            weights,
            weight=weights.weight[rows],
            bias=bias,
            sizes=weights.sizes[parts],
            adapters=weights.adapters[parts],
            fp8=_fp8_rows(weights.fp8, rows),
        )

    return part(slice(None, at), slice(None, count)), part(slice(at, None), slice(count, None))


def output_rows(weights: LinearWeights, start: int, size: int) -> LinearWeights:
    """The projection of outputs ``start:start + size`` of one unpacked projection (views of its weights)."""
    if len(weights.sizes) != 1 or weights.reduce is not None:
        raise ValueError("only one projection without a collective can be sliced by outputs")
    rows = slice(start, start + size)
    (terms,) = weights.adapters
    terms = _adapter_rows(terms, rows)
    bias = None if weights.bias is None else weights.bias[rows]
    return replace(
        weights,
        weight=weights.weight[rows],
        bias=bias,
        sizes=(size,),
        adapters=(terms,),
        fp8=_fp8_rows(weights.fp8, rows),
    )


def _fp8_rows(fp8: Fp8Weight | None, rows: slice) -> Fp8Weight | None:
    """The e4m3 copy of output channels ``rows`` (views)."""
    return None if fp8 is None else Fp8Weight(fp8.data[rows], fp8.scale[:, rows])


def apply_linear(
    x: torch.Tensor | Fp8Rows, weights: LinearWeights, rows: Rows | None = None
) -> tuple[torch.Tensor, ...]:
    """``x`` through the (packed) projection: one output per packed linear, adapters added as peft does.
    ``rows``: under tensor parallelism with the tokens split (``parallel/token_rows.py``), which tokens this
    rank holds of ``x`` (a column-split projection gathers every rank's first) or of the output (a row-split
    one sums its partial sums of them over the ranks). ``x`` may be quantized already (``takes_fp8_rows``)
    where ``rows`` is None."""
    if weights.reduce is not None:
        return (_summed_over_ranks(x, weights, rows),)
    if rows is None:
        y = _gemm(x, weights)
    elif any(weights.adapters) or weights.fp8 is not None:  # these read the gathered tokens too
        x = gather_rows(x, rows)
        y = _gemm(x, weights)
    else:
        y = linear_of_gathered(x, weights.weight, weights.bias, rows)
    parts = y.split(weights.sizes, dim=-1) if len(weights.sizes) > 1 else (y,)
    return tuple(_add_adapters(x, part, terms) for part, terms in zip(parts, weights.adapters, strict=True))


def _gemm(x: torch.Tensor | Fp8Rows, weights: LinearWeights) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, in FP8 where the projection has its e4m3 copy."""
    if _few_rows(x, weights):
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.omni_accel.few_rows_linear(flat, weights.weight, None, weights.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if weights.fp8 is None:
        return F.linear(x, weights.weight, weights.bias)
    if weights.weight_only:
        return weight_only_linear(x, weights.fp8, weights.bias)
    return fp8_linear(x, weights.fp8, weights.bias)


_FEW_ROWS = 2  # rows up to which our GEMV kernel beats cuBLAS's (``layers.gemv_kernels``)


def _few_rows(x: torch.Tensor | Fp8Rows, weights: LinearWeights) -> bool:
    """Whether ``x``'s product goes through our GEMV kernel: a bf16 weight and at most ``_FEW_ROWS`` rows
    (the per-sample AdaLN modulation)."""
    return (
        weights.fp8 is None
        and isinstance(x, torch.Tensor)
        and 0 < x.numel() <= _FEW_ROWS * x.shape[-1]
        and kernels_can_run(x, weights.weight)
        and gemv_kernels.serves(x, weights.weight)
    )


def _summed_over_ranks(x: torch.Tensor, weights: LinearWeights, rows: Rows | None) -> torch.Tensor:
    """An input-split projection: the partial products (base and low-rank alike, both linear in ``x``) are
    summed over the ranks by one all-reduce, or for this rank's ``rows`` only. (Summing row chunks, each
    chunk's all-reduce beside the next chunk's GEMM, measured slower: docs/PARALLELISM.md.)"""
    if rows is not None:
        return finish_projections([start_projection(x, weights, rows)])[0]
    return _with_adapter_biases(all_reduce_sum(_partial_products(x, weights), weights.reduce), weights)


def _partial_products(x: torch.Tensor, weights: LinearWeights) -> torch.Tensor:
    """This rank's share of an input-split projection. Only the first rank holds the bias (``read_linear``):
    its GEMM adds it in the epilogue, so the sum has it once without a broadcast add over the whole output
    after the collective."""
    (terms,) = weights.adapters
    return _add_adapters(x, _gemm(x, weights), terms, with_bias=False)


def _with_adapter_biases(y: torch.Tensor, weights: LinearWeights) -> torch.Tensor:
    for term in weights.adapters[0]:
        if term.up_bias is not None:
            y = y + term.up_bias * term.scale
    return y


@dataclass(frozen=True)
class ProjectionInFlight:
    """``apply_one`` started (``start_projection``): its output, or its partial sums on their way."""

    weights: LinearWeights
    out: torch.Tensor | None
    sums: SumInFlight | None


def start_projection(
    x: torch.Tensor, weights: LinearWeights, rows: Rows | None = None, beside: bool = False
) -> ProjectionInFlight:
    """``apply_one(x, weights, rows)`` up to its exchange: an input-split projection with the tokens split
    runs its GEMM and sends its partial sums (by the copy engine when ``beside``: work enqueued next runs
    while they travel); ``finish_projections`` ends several such behind one barrier. Any other is done."""
    if weights.reduce is None or rows is None:
        return ProjectionInFlight(weights, apply_one(x, weights, rows), None)
    return ProjectionInFlight(weights, None, start_sum(_partial_products(x, weights), rows, beside))


def finish_projections(started: Sequence[ProjectionInFlight]) -> list[torch.Tensor]:
    """The outputs of projections ``start_projection`` began (of independent streams, one TP group)."""
    sums = iter(sum_together([p.sums for p in started if p.sums is not None]))
    return [p.out if p.sums is None else _with_adapter_biases(next(sums), p.weights) for p in started]


def apply_together(items: Sequence[tuple[torch.Tensor, LinearWeights, Rows | None]]) -> list[torch.Tensor]:
    """``apply_one`` of each ``(x, weights, rows)`` (independent streams' projections): the partial sums of
    each but the last travel while the next GEMM runs, and one barrier ends them all."""
    last = len(items) - 1
    return finish_projections([start_projection(*item, beside=i < last) for i, item in enumerate(items)])


def _add_adapters(
    x: torch.Tensor, result: torch.Tensor, terms: tuple[LowRank, ...], with_bias: bool = True
) -> torch.Tensor:
    if not terms:
        return result
    dtype = result.dtype
    for term in terms:
        if term.cast_input and x.dtype != term.down.dtype:
            x = x.to(term.down.dtype)
        up_bias = term.up_bias if with_bias else None
        rows = _rows_to_accumulate_into(result, term, up_bias)
        if rows is not None:
            # ``result += scale * (x A^T) B^T`` in the GEMM's epilogue: one pass instead of a product, a
            # scaling and a sum over the full output, rounded once (peft rounds after each of the three).
            rows.addmm_(F.linear(x, term.down).flatten(0, -2), term.up.t(), alpha=term.scale.item())
        else:
            result = result + F.linear(F.linear(x, term.down), term.up, up_bias) * term.scale
    return result.to(dtype)


def _rows_to_accumulate_into(
    result: torch.Tensor, term: LowRank, up_bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``result`` as a 2-D view a GEMM can accumulate into, on CUDA outside compilation and autograd (the
    compiler fuses the reference itself; the CPU keeps peft's exact order), or None. ``result`` is always
    an output the caller just made, never a user's tensor."""
    if not result.is_cuda or up_bias is not None or result.dtype != term.up.dtype:
        return None
    if torch.compiler.is_dynamo_compiling() or torch.is_grad_enabled() or result.stride(-1) != 1:
        return None
    rows = result.flatten(0, -2)
    return rows if rows.data_ptr() == result.data_ptr() else None  # a view, not a copy


def apply_one(x: torch.Tensor, weights: LinearWeights, rows: Rows | None = None) -> torch.Tensor:
    """``apply_linear`` for a projection that is not packed."""
    (out,) = apply_linear(x, weights, rows)
    return out


def project_into(x: torch.Tensor, weights: LinearWeights, out: torch.Tensor) -> torch.Tensor:
    """``apply_one(x, weights)`` of a 2-D ``x`` (one projection without a collective), computed into ``out``
    (F.linear's own product, in place)."""
    if weights.fp8 is not None or _few_rows(x, weights):
        out.copy_(_gemm(x, weights))
    elif weights.bias is None:
        torch.mm(x, weights.weight.t(), out=out)
    else:
        torch.addmm(weights.bias, x, weights.weight.t(), out=out)
    (terms,) = weights.adapters
    result = _add_adapters(x, out, terms)
    return out if result is out else out.copy_(result)


if HAS_TRITON:
    from . import gemv_kernels  # registers the custom op
