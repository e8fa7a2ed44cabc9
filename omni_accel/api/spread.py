"""Phase 3 of ``accelerate``, under a parallel layout: the layout chosen (``parallel="auto"`` at the first
call) and checked before anything changes, then applied: the transformers over the ranks with the patches
their layout needs, the cond/uncond calls paired, the VAE split, each rank's shards on its device.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from diffusers import DiffusionPipeline
from torch import nn

import omni_accel.patches as patches
from omni_accel.patches import pair_cfg_calls

from ..config import AccelConfig
from ..layers.split_modulation import SplitModulation
from ..models.base import modulation_sites, native_blocks
from ..models.generic import generic_parallel_plan
from ..models.registry import ModelSpec, output_class, registered_natives, spec_for
from ..parallel import Parallelized, check_parallel, parallelize
from ..parallel.auto import choose_layout
from ..parallel.config import LayoutTuning, ParallelConfig
from ..parallel.mesh import ParallelState, init_parallel
from ..parallel.peer_memory import ranks_write_each_other
from ..parallel.routed_attention import LiveSplit
from ..parallel.tensor import FusedSplit, sum_row_splits
from ..utils.logging import get_logger
from .state import Component, HeldPatch, Pipeline, state_of
from .vae import plan_vae, split_vae

logger = get_logger(__name__)


AT_FIRST_CALL = object()  # parallel="auto": the layout waits for the first call's arguments


def parallel_config(
    pipe: Pipeline, names: list[str], config: AccelConfig
) -> tuple[ParallelConfig | object | None, str | None]:
    """The layout to apply now, or ``AT_FIRST_CALL`` when ``parallel="auto"`` waits for the first pipeline
    call's arguments (whether it runs both guidance branches); and a note for the report."""
    if config.parallel != "auto":
        return config.parallel, None
    world = _world_size()
    natives = [n for n in names if (spec := spec_for(getattr(pipe, n))) is not None and spec.native]
    if world == 1:
        return None, "one rank: nothing to spread"
    if natives and not config.native:
        raise ValueError(
            f"parallel='auto' over {world} ranks chooses a layout for native blocks, and native=False turns "
            "them off; drop native=False, or pass parallel=ParallelConfig(...) with the layout to use."
        )
    if not natives:
        raise ValueError(
            f"parallel='auto' over {world} ranks needs a native transformer, and {type(pipe).__name__} has "
            "none: run it on one rank, or pass parallel=ParallelConfig(...) with a layout its generic tier "
            "takes (cfg=2 for guidance; ulysses or ring where the model has a Diffusers _cp_plan). Natives "
            f"exist for {', '.join(registered_natives())}."
        )
    return AT_FIRST_CALL, "decided at the first pipeline call"


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def apply_auto_layout_at_call(arguments: dict[str, Any]) -> None:
    """The first-call action: the pipeline called (``self``), not the one ``accelerate`` was given, which a
    deep copy made before the call is not."""
    _apply_auto_layout(arguments["self"], arguments)


def _apply_auto_layout(pipe: DiffusionPipeline, arguments: dict[str, Any]) -> None:
    """``parallel="auto"`` at the first pipeline call: the layout for these arguments, checked on every
    native component, then spread as ``accelerate`` spreads a layout it was given."""
    state = state_of(pipe)
    natives = [c for c in state.components if c.runtime is not None and c.report.mode == "native"]
    if not natives:  # the transformers belong to another accelerated pipeline (from_pipe)
        return
    model, module = natives[0].spec.native_model(), natives[0].original
    sequence = model.parallel.sequence
    chosen = choose_layout(
        _world_size(),
        module.config[model.parallel.attention_heads],
        cfg_by_default=model.cfg_pairing is not None and model.cfg_pairing(arguments),
        sequence_plan=sequence is not None,
        ring_first=(
            sequence is not None
            and sequence.ring_first
            and LayoutTuning().peer_writes
            and ranks_write_each_other()
        ),
    )
    parallel = init_parallel(chosen.config)
    try:
        for component in natives:
            check_layout(
                component.original, component.spec.native_model(), parallel, component.graphs is not None
            )
        vae_coders, others = plan_vae(pipe, state.config, distributed=True)
        for component in natives:
            component.parallel = parallel
        state.undo += [parallel.close, *spread_layout(pipe, natives, vae_coders, parallel)]
    except BaseException:
        for component in natives:
            component.parallel = None
        parallel.close()
        raise
    state.others, state.vae = others, getattr(pipe, "vae", None)
    where = f"{chosen.config} on {dist.get_world_size()} ranks"
    for component in natives:
        component.report.layout = f"parallel='auto': {where}, chosen at the first call: {chosen.reason}"
    logger.info("parallel='auto' chose %s: %s", chosen.config, chosen.reason)


def check_layout(module: nn.Module, model, parallel: ParallelState, graphs: bool) -> None:
    """Raises, before anything changes, when ``parallel``'s layout cannot apply to ``module`` (with CUDA
    graphs of its steps when ``graphs``)."""
    check_parallel(module, model.parallel, parallel)
    for patch in layout_patches(parallel.config, graphs, splits_sequence=False):
        patches.check_applicable(patch.name)
    if model.cfg_pairing is not None and (parallel.config.cfg > 1 or parallel.config.stacks_guidance):
        patches.check_applicable("pair_cfg_calls")


@dataclass(frozen=True)
class _Patch:
    """A patch of third-party code (``patches/``) and the module it patches. ``required=False``: applied
    where the installed version is a checked one; elsewhere the feature it enables stays refused."""

    name: str
    target: str
    required: bool = True


def layout_patches(config: ParallelConfig, graphs: bool, splits_sequence: bool) -> list[_Patch]:
    """The patches a layout needs: step graphs holding collectives released before the group is destroyed;
    under tp, LoRA loaded later (full shapes checked, this rank's slice of each delta merged); under a token
    split, Diffusers' first-block cache deciding over every rank's tokens."""
    needed = [_Patch("release_graphs_at_destroy", "torch.distributed")] if graphs else []
    if config.tp > 1:
        needed += [_Patch(*patch) for patch in _tp_lora_patches()]
    if splits_sequence:
        needed.append(_Patch(*_CACHE_OVER_RANKS, required=False))
    return needed


def _apply_layout_patches(component: Component, layout: Parallelized) -> None:
    """``layout_patches`` of ``component``'s layout, applied; their reverts join its undo."""
    needed = layout_patches(
        component.parallel.config, component.graphs is not None, layout.sequence is not None
    )
    for patch in needed:
        if patch.required or patches.applicable(patch.name):
            component.undo.append(HeldPatch(patch.name, patch.target))


def _parallelize_generic(component: Component) -> None:
    """Spreads a component without native blocks over ``component.parallel``'s ranks, by its own plan."""
    module, parallel = component.original, component.parallel
    plan = generic_parallel_plan(module, parallel.config, routed=True)
    pairs = generic_pairing(component.spec, parallel) is not None
    layout = parallelize(module, plan, parallel, output_class(component.spec), pairs_guidance=pairs)
    component.report.cfg = layout.cfg
    component.undo.append(layout.revert)
    _agree_on_cache_hits(component)
    if layout.sequence is not None:  # read by traces of calls our providers cannot split
        component.undo.append(LiveSplit())
    if parallel.config.tp > 1:  # Diffusers' forward of a row-split linear: its partial sums reduced
        component.undo.append(sum_row_splits(module))
    _apply_layout_patches(component, layout)


def _parallelize(component: Component) -> None:
    """Spreads a native component (its blocks already swapped) over ``component.parallel``'s ranks."""
    model = component.spec.native_model()
    layout = parallelize(
        component.original,
        model.parallel,
        component.parallel,
        output_class(component.spec),
        pairs_guidance=model.cfg_pairing is not None,
    )
    component.runtime.layout = layout
    component.report.cfg = layout.cfg
    component.undo.append(layout.revert)
    if component.parallel.config.tp > 1:  # Diffusers' fused Q/K/V of split linears: full state, restored
        component.undo.append(FusedSplit(component.original).undo)
    for block in native_blocks(component.original, model):  # the shards packed, as the whole weights were
        block.prepack()
    _agree_on_cache_hits(component)
    group = _modulation_group(component.parallel)
    sites = modulation_sites(component.original)
    if group is not None and sites:
        component.runtime.modulation = SplitModulation(sites, group, component.runtime.fp8)
        component.undo.append(functools.partial(setattr, component.runtime, "modulation", None))
    _apply_layout_patches(component, layout)


def _agree_on_cache_hits(component: Component) -> None:
    """Under a layout a cached projection may be a collective: the ranks that hold the same batch decide
    every hit together (``ExactProjectionCache.agree_over``), so one rank's miss cannot leave another
    waiting in a collective it skipped."""
    cache = component.cache
    if cache is None:
        return
    cache.agree_over(component.parallel.host_group())  # the layout's closing destroys the group
    component.undo.append(functools.partial(cache.agree_over, None))


def _modulation_group(parallel: ParallelState) -> dist.ProcessGroup | None:
    """The ranks that hold the same batch and share the blocks' modulation work: the tensor-parallel group
    (its weights are split there), else the Ulysses group, else the ring's (None: no such ranks)."""
    return parallel.group("tp") or parallel.group("ulysses") or parallel.group("ring")


# Diffusers' first-block cache under a token split. Where this diffusers is not the checked one, the cache
# stays refused there (the layout's forward says so), and the layout still applies.
_CACHE_OVER_RANKS = ("first_block_cache_over_ranks", "diffusers.hooks.first_block_cache")


def _tp_lora_patches() -> list[tuple[str, str]]:
    """Under TP, Diffusers' LoRA loaders must see full shapes, and peft (when installed: Diffusers' LoRA
    backend) must merge (fuse) this rank's slice of each delta."""
    needed = [("lora_full_shapes", "diffusers.loaders.lora_pipeline")]
    if importlib.util.find_spec("peft") is not None:
        needed.append(("lora_tp_merge", "peft.tuners.lora.layer"))
    return needed


def generic_pairing(spec: ModelSpec | None, parallel: ParallelState) -> Callable | None:
    """The rule by which a model without native blocks pairs its cond/uncond calls: only over cfg=2's ranks
    (stacking them in one batch would need to know which arguments carry the batch; ``batch_dim_arguments``
    guesses that well enough to halve a batch, not to stack two calls whose other arguments may differ)."""
    if spec is None or parallel.config.cfg == 1:
        return None
    native = spec.native_model()  # native=False: how the pipeline calls the model is the same
    return spec.cfg_pairing or (native.cfg_pairing if native is not None else None)


def _pair_cfg_calls(pipe: DiffusionPipeline, components: list[Component]) -> list[Callable[[], None]]:
    """Pipelines that call their transformers twice per step get those calls paired: over cfg=2's ranks,
    or stacked in one call (``ParallelConfig.batch_guidance``)."""
    paired = []
    for component in components:
        if component.report.cfg is None or component.parallel is None:
            continue
        if component.runtime is not None:
            rule = component.spec.native_model().cfg_pairing
        else:
            rule = generic_pairing(component.spec, component.parallel)
        if rule is not None:
            paired.append((rule, component.report.cfg))
    if not paired:
        return []
    pair_cfg_calls.apply(pipe, paired[0][0], [cfg for _, cfg in paired])
    return [functools.partial(pair_cfg_calls.revert, pipe)]  # a deep copy's undo reverts the copy


def spread_layout(
    pipe: DiffusionPipeline,
    components: list[Component],
    vae_coders: list[nn.Module],
    parallel: ParallelState,
) -> list[Callable[[], None]]:
    """A checked layout applied, in order: each committed component spread over the ranks (its undo joins
    the component's), the cond/uncond calls paired, the VAE split by rows, and each rank's shards moved to
    its device (after sharding: each rank moves only its own). An error on the way undoes what this did.
    Returns the pipeline-level undos."""
    spread, undo = [], []
    try:
        for component in components:
            if component.shared or component.parallel is None:
                continue
            before = len(component.undo)
            spread.append((component, before))
            (_parallelize if component.runtime is not None else _parallelize_generic)(component)
        undo += _pair_cfg_calls(pipe, components)
        undo += split_vae(pipe, vae_coders)
        pipe.to(parallel.device)
    except BaseException:
        for revert in reversed(undo):
            revert()
        for component, before in reversed(spread):
            for revert in reversed(component.undo[before:]):
                revert()
            del component.undo[before:]
        raise
    return undo
