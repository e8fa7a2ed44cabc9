"""Tensor parallelism applied in place to a Diffusers module's own linears (Megatron-style).

A model's plan names, per repeated block, which linears split their outputs (``Colwise``: Q/K/V, MLP up)
and which split their inputs (``Rowwise``: attention out, MLP down; their partial outputs are summed over
the ranks). ``apply_tensor_parallel`` replaces each such weight by this rank's slice and records the split
on the linear (``omni_tp``), where the native math finds it. The linear keeps its Diffusers name, class and
``in_features``/``out_features`` (so peft builds full-size adapters, which the native math slices the same
way). ``state_dict()`` gives the full tensors (a collective: every rank calls it, as every rank of an SPMD
script does) and ``load_state_dict`` takes full tensors and keeps this rank's slice, so Diffusers names and
shapes hold under TP; ``undo`` gathers the full weights back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..forward_hooks import TRACED
from ..utils.tensor_kinds import plain_class, tensor_kind
from .comm import all_gather_dim
from .held_groups import HoldsGroups
from .hooks import LayoutHook, register, run_all


@dataclass(frozen=True)
class Colwise:
    """Output features split over the TP ranks: each rank computes its slice of the outputs. ``optional``:
    the linear exists only in some variants of the model (skipped where it is None). A block's AdaLN
    modulation linears (a large weight, a small output every rank needs whole) split this way too: the
    native model computes them for every block at once and gathers them in one collective
    (``layers/split_modulation.py``). ``ratios``: the outputs are several projections packed in one
    linear, in these proportions (or in those the linear's attribute ``ratios_attr`` holds), each split on
    its own (Diffusers' ``PackedColwiseParallel``)."""

    optional: bool = False
    ratios: tuple[int, ...] = ()
    ratios_attr: str = ""


@dataclass(frozen=True)
class Rowwise:
    """Input features split over the TP ranks; the partial outputs are summed. ``input_parts``: the linears
    whose outputs, concatenated, form this input (each part was split on its own), empty for one part; or
    ``ratios`` / ``ratios_attr`` as for ``Colwise`` (Diffusers' ``PackedRowwiseParallel``)."""

    input_parts: tuple[str, ...] = ()
    optional: bool = False
    ratios: tuple[int, ...] = ()
    ratios_attr: str = ""


TensorPlan = Mapping[str, Colwise | Rowwise]
"""Path of a linear inside a block -> how it splits."""


@dataclass(frozen=True, eq=False)
class LinearShard(HoldsGroups):
    """How one linear is split: along weight dim ``dim`` (0: outputs, 1: inputs), each of ``parts`` (full
    sizes of the blocks along that dim) split evenly over the ``size`` ranks of ``group``."""

    dim: int
    parts: tuple[int, ...]
    group: dist.ProcessGroup
    rank: int
    size: int

    @property
    def reduces(self) -> bool:
        """The outputs are partial sums (input split): they are all-reduced, the bias added after."""
        return self.dim == 1

    def take(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``full`` along ``dim`` (a view for one part)."""
        pieces, start = [], 0
        for part in self.parts:
            local = part // self.size
            pieces.append(full.narrow(dim, start + self.rank * local, local))
            start += part
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The full tensor from every rank's slice (a collective)."""
        per_rank = all_gather_dim(local.contiguous(), dim, self.group).split(local.shape[dim], dim=dim)
        pieces, start = [], 0
        for part in self.parts:
            size = part // self.size
            pieces.extend(chunk.narrow(dim, start, size) for chunk in per_rank)
            start += size
        return torch.cat(pieces, dim=dim)

    def full_shape(self, local: torch.Tensor, dim: int) -> tuple[int, ...]:
        shape = list(local.shape)
        shape[dim] = sum(self.parts)
        return tuple(shape)


def _base(module: nn.Module) -> nn.Linear:
    """The linear itself, or the base layer of a peft adapter wrapped around it."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def _sharded_params(linear: nn.Linear, shard: LinearShard) -> dict[str, int]:
    """Parameter name -> the dim it is split along (a row-split linear keeps its bias whole)."""
    dims = {"weight": shard.dim}
    if linear.bias is not None and shard.dim == 0:
        dims["bias"] = 0
    return dims


def plan_shards(
    block: nn.Module, plan: TensorPlan, group: dist.ProcessGroup
) -> list[tuple[str, nn.Linear, LinearShard]]:
    """The split of every planned linear of ``block``; raises (touching nothing) when a size does not divide."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    shards = []
    for path, style in plan.items():
        if style.optional and not _has_linear(block, path):
            continue
        linear = _base(block.get_submodule(path))
        _refuse_unsliceable(linear, path, size)
        if isinstance(style, Colwise):
            dim, parts = 0, _packed(linear, style, linear.out_features, path)
        else:
            dim = 1
            parts = tuple(_base(block.get_submodule(p)).out_features for p in style.input_parts) or _packed(
                linear, style, linear.in_features, path
            )
            if sum(parts) != linear.in_features:
                raise ValueError(f"{path}: input parts {parts} do not add up to {linear.in_features} inputs")
        bad = [part for part in parts if part % size]
        if bad:
            raise ValueError(
                f"tp={size} does not divide the {bad} {'output' if dim == 0 else 'input'} features of {path}; "
                "use a tp that divides them."
            )
        shards.append((path, linear, LinearShard(dim, parts, group, rank, size)))
    return shards


def _refuse_unsliceable(linear: nn.Module, path: str, size: int) -> None:
    """A weight that computes its own way (torchao's, GGUF's quantized tensors) has no rows or columns to
    slice as plain data: sharding it would fail halfway through the model or slice its packed bytes."""
    for name in ("weight", "bias"):
        param = linear._parameters.get(name)
        if param is not None and not plain_class(type(param)):
            raise ValueError(
                f"tp={size} cannot split {path}.{name}: it is {tensor_kind(param)}, and tensor parallelism "
                "slices plain weights only. Load the transformer unquantized for tp, or use a layout that "
                "keeps every weight whole (cfg; ulysses or ring with native=False)."
            )


def _has_linear(block: nn.Module, path: str) -> bool:
    """Whether ``block`` has a module at ``path`` (a variant of the model, or a block of a list, may not)."""
    try:
        return block.get_submodule(path) is not None
    except AttributeError:
        return False


def _packed(linear: nn.Linear, style: Colwise | Rowwise, total: int, path: str) -> tuple[int, ...]:
    """The sizes of the projections packed along the split dim of ``linear`` (one part when not packed)."""
    ratios = style.ratios
    if not ratios and style.ratios_attr:
        ratios = tuple(getattr(linear, style.ratios_attr, None) or ())
    if not ratios:
        if style.ratios_attr:
            raise ValueError(
                f"{path}: the linear has no {style.ratios_attr!r} saying how its projections pack"
            )
        return (total,)
    if total % sum(ratios):
        raise ValueError(f"{path}: its {total} features do not split in the proportions {list(ratios)}")
    unit = total // sum(ratios)
    return tuple(ratio * unit for ratio in ratios)


def apply_tensor_parallel(
    blocks: list[tuple[nn.Module, TensorPlan]], group: dist.ProcessGroup
) -> Callable[[], None]:
    """Shards every planned linear of ``blocks`` in place; returns the undo (a collective)."""
    shards = [entry for block, plan in blocks for entry in plan_shards(block, plan, group)]
    return functools.partial(run_all, [shard_linear(linear, shard) for _, linear, shard in shards])


def shard_linear(linear: nn.Linear, shard: LinearShard, sliced: bool = False) -> Callable[[], None]:
    """Shards ``linear`` in place as ``shard`` says (full tensors in its state_dict, full ones loaded into
    it are sliced); returns the undo (a collective). ``sliced``: it already holds this rank's slice (built
    from split linears), so only its full sizes are recorded."""
    for name, dim in _sharded_params(linear, shard).items():
        param = getattr(linear, name)
        if not sliced:
            param.data = shard.take(param.data, dim).contiguous().clone()
    if sliced:  # a split linear keeps its full sizes: peft sizes its adapters by them
        linear.out_features = sum(shard.parts)
    linear.omni_tp = shard
    handles = [
        linear.register_state_dict_post_hook(_full_state),
        linear.register_load_state_dict_pre_hook(_local_state),
    ]
    # A partial, not a closure: the undo a deep copy of the model holds gathers that copy's linear.
    return functools.partial(_unshard, linear, shard, handles)


def _unshard(linear: nn.Linear, shard: LinearShard, handles: list) -> None:
    for handle in handles:
        handle.remove()
    for name, dim in _sharded_params(linear, shard).items():
        param = getattr(linear, name)
        param.data = shard.gather(param.data, dim)
    del linear.omni_tp


class SumRowSplit(LayoutHook):
    """On a row-split linear that Diffusers' own forward runs (a model without native blocks): this rank's
    partial product, summed over the TP ranks, the bias added once. Compiled blocks trace it in (Dynamo
    takes the in-place all-reduce as its functional collective)."""

    def new_forward(self, module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (input.requires_grad or module.weight.requires_grad):
            raise NotImplementedError(
                "tensor parallelism of a model without native blocks is for inference: its partial sums are "
                "reduced outside autograd; train on one GPU."
            )
        out = torch.nn.functional.linear(input, module.weight)
        dist.all_reduce(out, group=module.omni_tp.group)
        return out if module.bias is None else out + module.bias


setattr(SumRowSplit, TRACED, True)


class AdaptersSplit(LayoutHook):
    """On a model without native blocks under tp: before each forward, splits the LoRA adapters peft has
    wrapped around a split linear (loaded before or after ``accelerate``) the way that linear is split, so that
    they meet this rank's slice of the activations: a column-split linear's ``lora_B`` keeps its slice of
    the outputs; a row-split one's ``lora_A`` its slice of the inputs, its rank-r partial products summed
    over the TP ranks before ``lora_B`` (a sum of r values per token; ``B(sum A_i x_i)`` is ``B A x``).
    Merging (``fuse_lora``) then adds this rank's slice of the delta by itself. A check of each split
    linear's place per call, not a walk of the model. ``fused``: the fused linears Diffusers adds, split
    (before the adapters' check) as they come and go."""

    def __init__(self, module: nn.Module, fused: FusedSplit) -> None:
        super().__init__()
        self.fused = fused
        self.places = []  # (parent, name, split linear): where the linear, or a wrapper of it, sits
        for parent in module.modules():
            if hasattr(parent, "get_base_layer"):
                continue  # a peft wrapper (adapters loaded before accelerate): its own parent holds it
            for name, child in parent._modules.items():
                linear = None if child is None else _base(child)
                if isinstance(getattr(linear, "omni_tp", None), LinearShard) and not fused.holds(linear):
                    self.places.append((parent, name, linear))
        # (parent, name, adapter, its split linear, undo): where each split adapter sits
        self.split: list[tuple[nn.Module, str, str, nn.Linear, Callable[[], None]]] = []

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        # Adapters deleted or unloaded since are dropped, not gathered back (the same on every rank).
        self.split = [entry for entry in self.split if _still_holds(*entry[:4])]
        for parent, name, linear in (*self.places, *self.fused.places()):
            wrapper = parent._modules.get(name)
            if wrapper is not linear:
                self._split_adapters(parent, wrapper, name, linear.omni_tp)
        return args, kwargs

    def _split_adapters(self, parent: nn.Module, wrapper: nn.Module, name: str, shard: LinearShard) -> None:
        lora_a, lora_b = getattr(wrapper, "lora_A", None), getattr(wrapper, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
            raise NotImplementedError(
                f"{type(wrapper).__name__} wraps a linear that tp splits ({name}), and only peft's LoRA adapters "
                "are split with it. Remove it, or use ulysses, ring or cfg for this model."
            )
        for adapter, down in lora_a.items():
            up = lora_b[adapter]
            target = up if shard.dim == 0 else down  # the adapter's linear on the split side
            if getattr(target, "omni_tp", None) is not None:
                continue
            if getattr(wrapper, "use_dora", {}).get(adapter):
                raise NotImplementedError(
                    f"the DoRA adapter {adapter!r} on {name}, a linear tp splits, cannot be split with it (its "
                    "magnitude normalises the whole weight). Unload it, or use ulysses, ring or cfg."
                )
            if target.weight.shape[shard.dim] != sum(shard.parts):  # sized by a fused linear's slices
                raise NotImplementedError(
                    f"the adapter {adapter!r} on {name} was added to a linear fuse_qkv_projections() built from "
                    "this rank's slices before it was split: run a call (or state_dict()) after fusing, then "
                    "add the adapter."
                )
            undo = shard_linear(target, shard)
            if shard.reduces:  # its rank-r partial products, summed before lora_B
                undo = _then(register(target, SumRowSplit(), "omni_accel.tp_sum"), undo)
            self.split.append((parent, name, adapter, target, undo))

    def undo(self) -> None:
        """Gives every adapter split here and still in place its full weights back (a collective)."""
        for *where, undo in reversed(self.split):
            if _still_holds(*where):
                undo()
        self.split.clear()


# Diffusers' fuse_projections(): the linear it adds to an attention module -> the linears it concatenates.
_FUSIONS = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "to_added_kv": ("add_k_proj", "add_v_proj"),
}


class FusedSplit:
    """Under tp: Diffusers' ``fuse_qkv_projections()`` concatenates an attention's column-split Q/K/V
    linears into one new linear. Fused after ``accelerate`` it holds this rank's slices (Diffusers' forward
    computes right with them) but is no split linear of ours: its state_dict would give slices and
    ``restore`` would leave them; fused before, it holds the full weights, which the split attention cannot
    take. So each such linear is made a split one, packed as its parts are (sliced when whole, recorded when
    built from slices): at ``accelerate``, before each forward of a model without native blocks (through
    ``AdaptersSplit``), before its attention's ``state_dict`` and ``load_state_dict``, and at ``restore``,
    which gathers it back. ``unfuse_qkv_projections()`` deletes it, as in Diffusers. (Native blocks refuse
    to run fused under tp.)"""

    def __init__(self, module: nn.Module) -> None:
        self.attentions = [
            parent
            for parent in module.modules()
            if any(shard_of(child) for name, child in parent._modules.items() if _fused_from(name))
        ]
        self.handles = [
            handle
            for parent in self.attentions
            for handle in (
                parent.register_state_dict_pre_hook(functools.partial(_settle_fused, self)),
                parent.register_load_state_dict_pre_hook(functools.partial(_settle_fused, self)),
            )
        ]
        self.split: list[tuple[nn.Module, str, nn.Linear, Callable[[], None]]] = []
        try:
            self.settle()  # fused before accelerate: split now
        except Exception:
            self._gather()
            raise

    def places(self) -> list[tuple[nn.Module, str, nn.Linear]]:
        """Where each fused linear in place sits, split (those fused since, split now)."""
        self.settle()
        return [(parent, name, linear) for parent, name, linear, _ in self.split]

    def holds(self, linear: nn.Linear) -> bool:
        return any(linear is split for _, _, split, _ in self.split)

    def settle(self) -> None:
        """Lets go of the fused linears unfused since (deleted: nothing to gather) and splits new ones."""
        self.split = [entry for entry in self.split if _base(entry[0]._modules.get(entry[1])) is entry[2]]
        for parent in self.attentions:
            self.settle_one(parent)

    def settle_one(self, parent: nn.Module) -> None:
        """Splits the fused linears of ``parent`` that are not split yet."""
        for fused_name, sources in _FUSIONS.items():
            fused = parent._modules.get(fused_name)
            if fused is None or shard_of(fused) is not None:
                continue
            shards = [shard_of(parent._modules[s]) if s in parent._modules else None for s in sources]
            if not any(shards):
                continue
            if not all(shard is not None and shard.dim == 0 for shard in shards):
                raise NotImplementedError(
                    f"{fused_name} fuses {', '.join(sources)}, which tp splits only in part; "
                    "unfuse_qkv_projections() before accelerate, or use ulysses, ring or cfg."
                )
            first, linear = shards[0], _base(fused)
            parts = tuple(part for shard in shards for part in shard.parts)
            shard = LinearShard(0, parts, first.group, first.rank, first.size)
            sliced = linear.weight.shape[0] * first.size == sum(parts)
            undo = shard_linear(linear, shard, sliced=sliced)
            self.split.append((parent, fused_name, linear, undo))

    def undo(self) -> None:
        """Gives every fused linear in place its full weights back (a collective), those fused since the
        last forward included."""
        self.settle()
        self._gather()

    def _gather(self) -> None:
        for handle in self.handles:
            handle.remove()
        for *_, undo in reversed(self.split):
            undo()
        self.split.clear()


def _fused_from(name: str) -> bool:
    """Whether ``name`` is a linear Diffusers' fuse_projections() concatenates."""
    return any(name in sources for sources in _FUSIONS.values())


def _settle_fused(split: FusedSplit, module: nn.Module, *args: Any) -> None:
    split.settle_one(module)


def _still_holds(parent: nn.Module, name: str, adapter: str, linear: nn.Linear) -> bool:
    """The wrapper at ``parent.name`` still holds ``linear`` as adapter ``adapter``'s A or B."""
    wrapper = parent._modules.get(name)
    return any(
        isinstance(layers, nn.ModuleDict) and adapter in layers and layers[adapter] is linear
        for layers in (getattr(wrapper, "lora_A", None), getattr(wrapper, "lora_B", None))
    )


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    return functools.partial(run_all, [first, second])


def sum_row_splits(module: nn.Module) -> Callable[[], None]:
    """``SumRowSplit`` on every row-split linear below ``module``, and ``AdaptersSplit`` and ``FusedSplit``
    on it; returns the undo (which gives split adapters and fused linears their full weights back)."""
    adapters = AdaptersSplit(module, FusedSplit(module))
    undo = [adapters.fused.undo]
    undo += [
        register(linear, SumRowSplit(), "omni_accel.tp_sum")
        for linear in module.modules()
        if isinstance(getattr(linear, "omni_tp", None), LinearShard) and linear.omni_tp.reduces
    ]
    undo.append(register(module, adapters, "omni_accel.tp_adapters"))
    undo.append(adapters.undo)
    return functools.partial(run_all, undo[::-1])


def shard_of(module: nn.Module) -> LinearShard | None:
    """How ``module`` (a linear, maybe peft-wrapped) is split, or None."""
    return getattr(_base(module), "omni_tp", None)


@contextlib.contextmanager
def full_shapes(module: nn.Module) -> Iterator[None]:
    """Inside, every split linear of ``module`` holds meta tensors of its full shapes instead of its slices:
    for third-party code that checks shapes only (see ``patches/lora_full_shapes.py``)."""
    swapped = []
    for linear in module.modules():
        shard = getattr(linear, "omni_tp", None)
        for name, dim in _sharded_params(linear, shard).items() if shard is not None else ():
            real = linear._parameters[name]
            shape = shard.full_shape(real, dim)
            linear._parameters[name] = nn.Parameter(
                torch.empty(shape, dtype=real.dtype, device="meta"), requires_grad=False
            )
            swapped.append((linear, name, real))
    try:
        yield
    finally:
        for linear, name, real in swapped:
            linear._parameters[name] = real


def _full_state(module: nn.Linear, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    shard: LinearShard = module.omni_tp
    for name, dim in _sharded_params(module, shard).items():
        key = prefix + name
        if key in state_dict and not state_dict[key].is_meta:  # meta: a full_shapes placeholder
            state_dict[key] = shard.gather(state_dict[key], dim)


def _local_state(module: nn.Linear, state_dict: dict, prefix: str, *args) -> None:
    shard: LinearShard = module.omni_tp
    for name, dim in _sharded_params(module, shard).items():
        key = prefix + name
        value = state_dict.get(key)
        if value is not None and tuple(value.shape) == shard.full_shape(getattr(module, name), dim):
            state_dict[key] = shard.take(value, dim)
