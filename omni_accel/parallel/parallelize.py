"""``parallelize``: spreads a Diffusers transformer whose blocks are native over the mesh, in ordered steps.

1. tensor parallelism: shard the planned linears of every repeated block in place (``tensor.py``);
2. transports: each group's exchanges are peer writes into symmetric memory or its backend's collectives
   (``peer_memory.py``, as ``LayoutTuning.peer_writes`` allows), decided once for every rank;
3. sequence parallelism: split the sequence inputs and gather the output (hooks, ``sequence_hooks.py``);
   under tensor parallelism the same hooks split the tokens over the TP group too (``token_rows.py``);
4. CFG: split the guidance batch or pair the cond/uncond calls over a ``cfg`` group, or else stack the
   paired calls in one batch (a hook, ``cfg.py``), outermost.

A model declares what these steps need as data (``ParallelPlan``); parallel/ never imports models/.
``check_parallel`` runs every check first, so a layout that cannot apply fails before anything changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .cfg import GuidanceBranches, SplitGuidance
from .hooks import LayoutHook, SubmoduleHooks, register
from .mesh import ParallelState
from .peer_memory import choose_transports
from .sequence_hooks import (
    GatherSequence,
    SequencePlan,
    SequenceState,
    SplitInputs,
    SplitOutputs,
    SplitSequence,
)
from .tensor import TensorPlan, apply_tensor_parallel, plan_shards
from .token_rows import Rows, split_pays
from .turns import turns

_HOOK_PREFIX = "omni_accel."


@dataclass(frozen=True)
class ParallelPlan:
    """What a native model declares so that ``parallelize`` can spread it.

    ``name``: the model family, for messages. ``attention_heads``: the config key of the head count (TP
    splits whole heads). ``tensor``: block list -> its TP plan (a native model fills it in from its block
    classes' ``tp_plan``). ``sequence``: the SP plan.
    ``batched_inputs``: forward arguments with a batch dimension (CFG splits exactly these), or a function
    that names them from a call's arguments (a model that declares none; None where it cannot tell).
    ``output_like(module, arguments)``: an empty tensor shaped like the output of that call (None where
    that is not known yet: see ``SplitGuidance``). ``tokens_over_tp``: under tp, the blocks may take their
    tokens split over the TP ranks as well (native blocks gather them before the column-split projections,
    ``token_rows.py``); False where Diffusers' own forward runs the blocks (every TP rank holds all of its
    sequence share's tokens, and the row-split linears' all-reduce sums over them).
    ``per_sample_inputs``: batched inputs given as a list of one tensor per sample (Z-Image's latents and
    captions, of per-sample lengths): halved and stacked by entries; the output is such a list too.
    """

    name: str
    attention_heads: str
    sequence: SequencePlan | None
    batched_inputs: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...] | None]
    output_like: Callable[[nn.Module, dict[str, Any]], torch.Tensor | None]
    tensor: Mapping[str, TensorPlan] = field(default_factory=dict)
    tokens_over_tp: bool = True
    per_sample_inputs: tuple[str, ...] = ()


@dataclass(eq=False)
class Parallelized:
    """One applied layout: the sequence state its forwards split by (read by attention through the runtime
    of the forward in flight), its CFG branches, and how to undo it."""

    description: str
    splits_blocks: bool  # tp or sp > 1: a block's own Diffusers forward would be wrong here
    sequence: SequenceState | None = None
    cfg: GuidanceBranches | None = None
    undo: list[Callable[[], None]] = field(default_factory=list)

    def rows(self, *streams: str) -> Rows | None:
        """How this rank's tokens of ``streams`` sit in its TP group (None: not split over one)."""
        return None if self.sequence is None else self.sequence.rows(*streams)

    def revert(self) -> None:
        for step in reversed(self.undo):
            step()
        self.undo.clear()


def check_parallel(transformer: nn.Module, plan: ParallelPlan, state: ParallelState) -> None:
    """Raises with the reason and the fix when ``state``'s layout cannot apply to ``transformer``."""
    config = state.config
    if config.sequence_parallel > 1 and plan.sequence is None:
        raise ValueError(f"{plan.name} declares no sequence plan, so ulysses and ring cannot apply to it.")
    if config.cfg > 1 and not plan.batched_inputs:
        raise ValueError(
            f"cfg={config.cfg} splits a call's batch or pairs its guidance calls, and {plan.name} names no "
            "batched inputs (its outputs are not one batch of samples); use tp, ulysses or ring for it."
        )
    tp = config.tp
    if tp > 1:
        heads = transformer.config[plan.attention_heads]
        if heads % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(
                f"tp={tp} does not divide {plan.name}'s {heads} attention heads; use a tp in {fits}."
            )
        group = state.group("tp")
        for list_name, block_plan in plan.tensor.items():
            for block in transformer.get_submodule(list_name):
                plan_shards(block, block_plan, group)


def parallelize(
    transformer: nn.Module,
    plan: ParallelPlan,
    state: ParallelState,
    output_class: type,
    pairs_guidance: bool = False,
) -> Parallelized:
    """Applies ``state``'s layout to ``transformer`` (its blocks already native); undo with ``revert``.
    ``pairs_guidance``: some pipelines call it once per guidance branch (their calls can pair)."""
    check_parallel(transformer, plan, state)
    config = state.config
    layout = Parallelized(str(config), splits_blocks=config.tp > 1 or config.sequence_parallel > 1)
    if config.tp > 1:
        blocks = [
            (block, block_plan)
            for list_name, block_plan in plan.tensor.items()
            for block in transformer.get_submodule(list_name)
        ]
        layout.undo.append(apply_tensor_parallel(blocks, state.group("tp")))
    tp, tuning = state.group("tp"), config.tuning
    splits_tokens = (
        tp is not None and plan.tokens_over_tp and plan.sequence is not None and tuning.split_tokens
    )
    with torch.cuda.device(state.device) if state.device.type == "cuda" else contextlib.nullcontext():
        if tuning.peer_writes:  # each group's transport, decided here by every rank at the same point
            choose_transports([state.group(dim) for dim in ("ulysses", "ring", "tp")])
        splits_tokens = splits_tokens and split_pays(tp, tuning.peer_writes)
    if config.sequence_parallel > 1 or splits_tokens:
        tp = tp if splits_tokens else None
        groups = (state.group("ulysses"), state.group("ring"), tp)
        seq, submodules = plan.sequence, SubmoduleHooks(transformer)
        layout.sequence = sequence = SequenceState(*groups, tuning, empty_shares=seq.empty_shares)
        for path, splits in seq.submodule_inputs.items():
            submodules.add(path, SplitInputs(splits, sequence), _HOOK_PREFIX + "sp_split", outermost=True)
        for path, splits in seq.submodule_outputs.items():
            submodules.add(path, SplitOutputs(splits, sequence), _HOOK_PREFIX + "sp_split")
        for path, split in (seq.output, *seq.gathers.items()):
            submodules.add(path, GatherSequence(split, sequence), _HOOK_PREFIX + "sp_gather")
        layout.undo.append(submodules.remove)
        hook = SplitSequence(seq, sequence, submodules, tuple(plan.tensor))
        layout.undo.append(register(transformer, hook, _HOOK_PREFIX + "sp_split"))
    if config.cfg > 1 or (pairs_guidance and config.stacks_guidance):
        layout.cfg = GuidanceBranches(state.group("cfg"), plan.batched_inputs, plan.per_sample_inputs)
        hook = SplitGuidance(layout.cfg, plan.output_like, output_class, tuple(plan.tensor))
        layout.undo.append(register(transformer, hook, _HOOK_PREFIX + "cfg_split"))
    if layout.splits_blocks or layout.cfg is not None:
        turns().timeout_s = config.timeout_s
    if layout.splits_blocks:  # every forward communicates: in turn with other threads' (outermost)
        layout.undo.append(register(transformer, InTurn(layout.cfg), _HOOK_PREFIX + "turn"))
    return layout


class InTurn(LayoutHook):
    """Runs each forward in its turn among the process's calls that communicate (``turns``), by a
    fingerprint of its arguments and, where the call pairs with this thread's waiting conditional call,
    of that call's. It decides nothing a step graph computes (a layout hook: graphs stay on)."""

    def __init__(self, cfg: GuidanceBranches | None) -> None:
        super().__init__()
        self.cfg = cfg

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        waiting = None if self.cfg is None else self.cfg.waiting()
        with turns().turn((args, kwargs, waiting)):
            return self.fn_ref.original_forward(*args, **kwargs)
