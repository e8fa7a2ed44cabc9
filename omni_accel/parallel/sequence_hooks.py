"""Sequence parallelism as hooks on the Diffusers module: split where the sequence appears, gather the
output.

A model's ``SequencePlan`` says where tokens of each stream enter the model: forward arguments (FLUX: the
image tokens and their ids, the text tokens and their ids), arguments of a submodule (Wan: the first
block's tokens, made inside the model by its patch embedding) or outputs of a submodule (Wan: the RoPE
tables, the per-token timestep embeddings). Each stream is split evenly over the Ulysses x ring ranks on
its own the first time it is met in a forward, so every rank holds a slice of each stream; attention joins
the streams rank by rank, which is exact because attention does not depend on the order of its keys and
every query returns to the rank it came from. Conditioning that is not a stream (the text a video model
cross-attends to) stays whole on every rank. Between the splits and the gather only self-attention
communicates.

Under tensor parallelism the same hooks split each rank's tokens once more over the TP group: the blocks
gather them before their column-split projections and sum their slice after the row-split ones
(``token_rows.py``). What locates tokens for attention (position ids, RoPE tables: ``Split.positions``) is
applied after the gather, so the TP level leaves it whole.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import LayoutTuning
from .held_groups import HoldsGroups
from .hooks import LayoutHook, SubmoduleHooks, bound_arguments
from .sequence import SequenceParallel, gather, shard, split_sizes
from .shares import SequenceShares, signature
from .token_rows import Rows

RANK_AWARE_HOOKS: set[type] = set()
"""Classes of Diffusers hooks on blocks that decide over every rank's tokens (``token_groups``), so they may
run while the tokens are split; ``patches/first_block_cache_over_ranks.py`` adds its own."""


_STEP_CACHES = (
    "first_block_cache",
    "mag_cache",
    "taylorseer_cache",
    "faster_cache",
    "pyramid_attention_broadcast",
)


def decides_alike_on_every_rank(hook: Any) -> bool:
    """Whether a Diffusers hook on a block takes the same decisions on every rank of a token split. Only
    Diffusers' step caches decide (skip blocks, reuse outputs) from what they see; other hooks (a user's,
    offloading's, casting's) see this rank's tokens and decide nothing. A cache decides alike when it
    decides over every rank's tokens (``RANK_AWARE_HOOKS``), or is MagCache's, which decides from its
    configured magnitude ratios and the step count, never from the tensors (not while calibrating: the
    ratios it prints would be measured on one rank's tokens)."""
    module = type(hook).__module__
    if not module.startswith("diffusers.hooks.") or module.rsplit(".", 1)[1] not in _STEP_CACHES:
        return True
    if type(hook) in RANK_AWARE_HOOKS:
        return True
    from diffusers.hooks import mag_cache

    magcache = isinstance(hook, mag_cache.MagCacheHeadHook | mag_cache.MagCacheBlockHook)
    return magcache and hook.config is not None and not hook.config.calibrate


_FORWARD = threading.local()  # the SequenceState of the forward in flight on this thread


def forward_state() -> SequenceState | None:
    """The sequence layout of the split forward in flight on this thread, or None."""
    return getattr(_FORWARD, "state", None)


def token_groups() -> list[dist.ProcessGroup] | None:
    """The groups whose ranks split the tokens of the forward in flight (sequence groups and, where it
    splits them, the TP group), or None outside such a forward: a hook that must decide on the whole
    sequence sums what it measured on its slice over them."""
    state = getattr(_FORWARD, "state", None)
    if state is None:
        return None
    return [group for group in (*state.groups.values(), state.tp_group) if group is not None]


def foreign_block_hooks(module: nn.Module, block_lists: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Block path -> {name: hook} of the Diffusers hooks on ``module``'s blocks that are not a layout's (a
    step cache's, offloading's, a user's)."""
    found = {}
    for list_name in block_lists:
        for index, block in enumerate(module.get_submodule(list_name)):
            registry = block.__dict__.get("_diffusers_hook")
            hooks = {} if registry is None else registry.hooks
            foreign = {name: hook for name, hook in hooks.items() if not isinstance(hook, LayoutHook)}
            if foreign:
                found[f"{list_name}.{index}"] = foreign
    return found


@dataclass(frozen=True)
class Split:
    """Split along ``dim`` as part of ``stream``; with ``ndim``, only tensors of that rank (a model may pass
    a per-sample or a per-token tensor in the same place). ``positions``: it says where tokens are (ids,
    RoPE tables), which the blocks use on the tokens they gathered over the TP group: split by sequence
    parallelism only."""

    stream: str
    dim: int
    ndim: int | None = None
    positions: bool = False


@dataclass(frozen=True)
class SequencePlan:
    """``inputs``: forward argument -> Split (a list argument has its dim on each item).
    ``submodule_inputs``: submodule path -> {argument -> Split}. ``submodule_outputs``: submodule path ->
    {output index -> Split}. ``output``: (path of the submodule whose output is the model's output, Split).
    ``gathers``: further submodule path -> Split whose output is gathered (a plan that splits only inside
    the blocks). A Split whose ``stream`` no split names (a plan taken from Diffusers', which names none) is
    gathered by its length (``SequenceState.layout_of``). ``ring_first``: on two ranks whose K/V travel
    by peer writes, ring is measured faster than Ulysses for this model (``parallel="auto"`` follows it).
    ``empty_shares``: the model's code runs on a rank that holds none of a stream's tokens (our blocks do);
    a plan taken from Diffusers' runs Diffusers' code, whose RoPE and reshapes do not take an empty
    sequence, so there a stream shorter than the ranks that split it is refused (``SequenceState.stream``)."""

    output: tuple[str, Split]
    inputs: Mapping[str, Split] = field(default_factory=dict)
    submodule_inputs: Mapping[str, Mapping[str, Split]] = field(default_factory=dict)
    submodule_outputs: Mapping[str, Mapping[int, Split]] = field(default_factory=dict)
    gathers: Mapping[str, Split] = field(default_factory=dict)
    ring_first: bool = False
    empty_shares: bool = True


class SequenceState(HoldsGroups):
    """The sequence layout of the forward in flight: one plan per stream, and ``joint``, every stream
    joined as attention joins them (read by the blocks' attention); with a TP group, each stream's split of
    this rank's tokens over it (``tokens``). ``tuning``: how the exchanges run. ``empty_shares``: as the
    plan's (``SequencePlan.empty_shares``)."""

    def __init__(
        self,
        ulysses_group,
        ring_group,
        tp_group=None,
        tuning: LayoutTuning | None = None,
        empty_shares: bool = True,
    ) -> None:
        self.groups = dict(ulysses_group=ulysses_group, ring_group=ring_group)
        self.tp_group = tp_group
        self.tuning = LayoutTuning() if tuning is None else tuning
        self.empty_shares = empty_shares
        self.shares = SequenceShares()
        self.reset()

    def reset(self, signature: tuple = ()) -> None:
        """A new forward, whose inputs have ``signature`` (their shapes: the same on every rank)."""
        self.streams: dict[str, SequenceParallel] = {}
        self.shares.begin(signature)
        self.tokens: dict[str, tuple[int, ...]] = {}  # stream -> this rank's tokens split over the TP group
        self.joint: SequenceParallel | None = None

    def stream(self, name: str, length: int) -> SequenceParallel:
        plan = self.streams.get(name)
        if plan is None:
            self._refuse_empty_shares(name, length)
            plan = self.streams[name] = SequenceParallel.plan(length, **self.groups, tuning=self.tuning)
            sizes = zip(*(p.sizes for p in self.streams.values()), strict=True)
            self.joint = SequenceParallel(tuple(map(sum, sizes)), **self.groups, tuning=self.tuning)
            if self.tp_group is not None:
                local = plan.sizes[plan.index]
                self.tokens[name] = tuple(split_sizes(local, dist.get_world_size(self.tp_group)))
        elif sum(plan.sizes) != length:
            raise ValueError(
                f"sequence parallelism: stream {name!r} has {length} tokens here but {sum(plan.sizes)} where "
                "it was first split; the model's sequence plan is inconsistent"
            )
        return plan

    def _refuse_empty_shares(self, name: str, length: int) -> None:
        """Raises where a rank would hold none of ``length`` tokens and the model cannot run on none. Every
        rank sees the same length, so every rank raises alike, at the same point: none is left waiting."""
        degree = self.degree
        if self.empty_shares or not 0 < length < degree:
            return
        raise ValueError(
            f"sequence parallelism: the model's _cp_plan splits {length} token(s) at {name!r} over {degree} "
            "ulysses x ring ranks, so a rank would hold none of them, and this model's own (Diffusers') code "
            f"does not run on an empty sequence. Use at most {length} ulysses x ring ranks for such inputs, or a "
            "longer input (e.g. a longer prompt)."
        )

    def split(self, value: Any, split: Split) -> Any:
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            if split.ndim is not None and value.ndim != split.ndim:
                return value
            local = self.stream(split.stream, value.shape[split.dim]).shard(value, split.dim)
            if self.tp_group is not None and not split.positions:
                local = shard(local, split.dim, self.tp_group, self.tokens[split.stream])
            # contiguous, as a step graph's copy of it is: the kernels then see the same strides eagerly and
            # replayed (a slice of a batch of several is strided, and may round differently)
            return local.contiguous()
        if isinstance(value, Mapping):  # e.g. ControlNet residuals keyed by block index
            return {key: self.split(item, split) for key, item in value.items()}
        return type(value)(self.split(item, split) for item in value)

    def gather(self, value: torch.Tensor, split: Split) -> torch.Tensor:
        """The whole stream from every rank's slice (over the TP group first)."""
        if split.ndim is not None and value.ndim != split.ndim:
            return value
        if not self.streams:  # nothing was split (no input the plan names was met): nothing to gather
            return value
        if split.stream not in self.streams:
            return self.layout_of(value.shape[split.dim]).gather(value, split.dim)
        if self.tp_group is not None:
            value = gather(value, split.dim, self.tp_group, self.tokens[split.stream])
        return self.streams[split.stream].gather(value, split.dim)

    @property
    def degree(self) -> int:
        return math.prod(dist.get_world_size(g) for g in self.groups.values() if g is not None)

    def layout_of(self, length: int, kv_length: int | None = None) -> SequenceParallel:
        """The layout of a sequence this rank holds ``length`` tokens of (and ``kv_length`` of its K/V),
        whichever tensors it was made of: split streams joined (a joint attention's text and image),
        tensors every rank holds whole (attention over their copies is attention over them), or both. A
        plan taken from Diffusers' says which tensors it splits, not which of them a call joins, so where
        the streams split unevenly the ranks tell each other their lengths (``SequenceShares``)."""
        plans = [p.sizes for p in self.streams.values()]
        lengths = (length, length if kv_length is None else kv_length)
        if all(len(set(sizes)) == 1 for sizes in plans):  # every rank holds as many tokens as this one
            per_rank = [lengths] * self.degree
        else:
            per_rank = self.shares.exchange(lengths, self.groups)
        sizes, kv = (tuple(row[i] for row in per_rank) for i in (0, 1))
        kv_sizes = None if kv_length is None else kv
        return SequenceParallel(sizes, kv_sizes, **self.groups, tuning=self.tuning)

    def whole(self, length: int, sizes: tuple[int, ...]) -> bool:
        """Whether a tensor every rank holds ``length`` tokens of (``sizes``) is whole on every rank
        rather than split, as far as the streams tell: no stream gives any rank that many tokens."""
        return len(set(sizes)) == 1 and all(length not in p.sizes for p in self.streams.values())

    def rows(self, *streams: str) -> Rows | None:
        """How this rank's tokens of ``streams`` (joined in this order) sit in the TP group, or None where the
        tokens are not split over one."""
        if self.tp_group is None:
            return None
        group = self.tp_group.group_name
        return Rows("+".join(streams), group, tuple(self.tokens[name] for name in streams))


class SplitSequence(LayoutHook):
    """On the model: starts a forward's layout, keeps the submodules' hooks where their paths lead now, and
    splits the forward arguments the plan names. ``block_lists``: the model's lists of repeated blocks,
    whose own hooks it checks (see ``_refuse_block_hooks``)."""

    def __init__(
        self,
        plan: SequencePlan,
        state: SequenceState,
        submodules: SubmoduleHooks,
        block_lists: tuple[str, ...],
    ) -> None:
        super().__init__()
        self.plan, self.state, self.submodules = plan, state, submodules
        self.block_lists = block_lists

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        self._refuse_block_hooks(module)
        self.submodules.follow()
        arguments = bound_arguments(module, args, kwargs)
        self.state.reset(signature(arguments))
        for name, split in self.plan.inputs.items():
            arguments[name] = self.state.split(arguments.get(name), split)
        return (), arguments

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The forward (its arguments split already), with its layout in flight for ``token_groups``
        until it returns or raises."""
        _FORWARD.state = self.state
        try:
            return self.fn_ref.original_forward(*args, **kwargs)
        finally:
            _FORWARD.state = None
            self.state.joint = None

    def _refuse_block_hooks(self, module: nn.Module) -> None:
        """A Diffusers hook on a block sees this rank's slice of the tokens: a step cache's, unless it
        decides alike on every rank (``decides_alike_on_every_rank``), would take decisions that differ
        between the ranks, which then wait for each other forever. Every rank refuses the same call, before
        any exchange."""
        for path, hooks in foreign_block_hooks(module, self.block_lists).items():
            foreign = [name for name, hook in hooks.items() if not decides_alike_on_every_rank(hook)]
            if foreign:
                raise RuntimeError(
                    f"{path} has Diffusers step-cache hooks {foreign} (from enable_cache()), which "
                    "cannot run while the tokens are split over the ranks: each rank would decide on its "
                    "own slice. Turn them off (transformer.disable_cache()), or use the first-block cache "
                    "or MagCache (not calibrating), which decide alike on every rank, or cfg=2 or one "
                    "GPU, where every step cache works as in Diffusers."
                )

    def replay_key(self) -> tuple:
        # Split before the forward: the sizes of every rank's slice, not just this rank's local shape.
        # (The TP level's split follows from these.)
        return tuple((name, plan.sizes) for name, plan in self.state.streams.items())


class SplitInputs(LayoutHook):
    """On a submodule: splits the arguments the plan names."""

    def __init__(self, splits: Mapping[str, Split], state: SequenceState) -> None:
        super().__init__()
        self.splits, self.state = splits, state

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        arguments = bound_arguments(module, args, kwargs)
        for name, split in self.splits.items():
            arguments[name] = self.state.split(arguments.get(name), split)
        return (), arguments


class SplitOutputs(LayoutHook):
    """On a submodule: splits the outputs the plan names (by index; a lone tensor is output 0)."""

    def __init__(self, splits: Mapping[int, Split], state: SequenceState) -> None:
        super().__init__()
        self.splits, self.state = splits, state

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self.state.split(output, self.splits[0]) if 0 in self.splits else output
        items = list(output)
        for index, split in self.splits.items():
            items[index] = self.state.split(items[index], split)
        return type(output)(items)


class GatherSequence(LayoutHook):
    """On the submodule whose output is the model's output: every rank gets the whole sequence back."""

    def __init__(self, split: Split, state: SequenceState) -> None:
        super().__init__()
        self.split, self.state = split, state

    def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        return self.state.gather(output, self.split)
