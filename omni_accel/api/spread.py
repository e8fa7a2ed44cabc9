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
from ..models.registry import ModelSpec, cp_plan, output_class, registered_natives, spec_for
from ..parallel import Parallelized, check_parallel, parallelize
from ..parallel.auto import AutoLayout, choose_generic_layout, choose_layout
from ..parallel.config import LayoutTuning, ParallelConfig
from ..parallel.mesh import ParallelState, init_parallel
from ..parallel.peer_memory import ranks_write_each_other
from ..parallel.routed_attention import LiveSplit
from ..parallel.tensor import FusedSplit, sum_row_splits
from ..report import ComponentReport
from ..utils.logging import get_logger
from ..utils.tensor_kinds import quantized_or_absent, tensor_kind
from .state import Component, HeldPatch, Pipeline, state_of
from .vae import plan_vae, split_vae

logger = get_logger(__name__)


AT_FIRST_CALL = object()  # parallel="auto": the layout waits for the first call's arguments


def parallel_config(
    pipe: Pipeline, names: list[str], config: AccelConfig
) -> tuple[ParallelConfig | object | None, str | None]:
    """The layout to apply now, or ``AT_FIRST_CALL`` when ``parallel="auto"`` waits for the first pipeline
    call's arguments (whether it runs both guidance branches); and a note for the report. A transformer
    that no first call could lay out is refused here."""
    if config.parallel != "auto":
        return config.parallel, None
    world = _world_size()
    if world == 1:
        return None, "one rank: nothing to spread"
    modules = [getattr(pipe, name) for name in names]
    if not native_auto(modules, config):
        for name, module in zip(names, modules, strict=True):
            _check_generic_auto(name, module, world)
    return AT_FIRST_CALL, "decided at the first pipeline call"


def native_auto(modules: list[nn.Module], config: AccelConfig) -> bool:
    """Whether ``parallel="auto"`` lays out native blocks (the pipeline has some, and ``native`` is on; a
    transformer without them beside those runs whole on every rank), rather than the generic tier's
    transformers by what they declare to Diffusers."""
    return config.native and any((spec := spec_for(m)) is not None and spec.native for m in modules)


def _check_generic_auto(name: str, module: nn.Module, world: int) -> None:
    """Raises where ``parallel="auto"`` could choose no layout for ``module`` (a transformer without native
    blocks, or with ``native=False``) over ``world`` ranks, whatever the first call's arguments."""
    spec, cls_name = spec_for(module), type(module).__name__
    if _splits_sequence(module, spec):
        return
    if guidance_rule(spec) is not None:  # cfg=2 alone, for a guided call: raises unless the ranks are two
        choose_generic_layout(world, 1, f"pipe.{name} ({cls_name})", guidance=True, sequence_plan=False)
        return
    no_split = (
        "a Diffusers _cp_plan none of whose attention call sites can be routed"
        if cp_plan(module) is not None
        else "no Diffusers _cp_plan"
    )
    raise ValueError(
        f"parallel='auto' over {world} ranks cannot choose a layout for pipe.{name} ({cls_name}): it has no "
        f"native blocks, {no_split} to split its sequence, and no rule telling whether its pipeline's calls "
        "run both guidance branches. Run it on one rank, or pass parallel=ParallelConfig(cfg=2) if each "
        f"transformer call holds both guidance branches in its batch (native blocks exist for "
        f"{', '.join(registered_natives())})."
    )


def _splits_sequence(module: nn.Module, spec: ModelSpec | None) -> bool:
    """Whether ulysses and ring apply to a transformer without native blocks: its ``_cp_plan`` splits the
    sequence, and its attention runs through our providers (``generic_parallel_plan``)."""
    return cp_plan(module) is not None and spec is not None and bool(spec.attention_routes)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def auto_components(config: AccelConfig, components: list[Component]) -> list[Component]:
    """The components ``parallel="auto"`` lays out at the first call: the native ones (``native_auto``), else
    every transformer of the generic tier this pipeline set up itself."""
    if native_auto([c.original for c in components], config):
        return [c for c in components if c.runtime is not None and c.report.mode == "native"]
    return [c for c in components if not c.shared and c.runtime is None and c.report.mode != "untouched"]


def apply_auto_layout_at_call(arguments: dict[str, Any]) -> None:
    """The first-call action: the pipeline called (``self``), not the one ``accelerate`` was given, which a
    deep copy made before the call is not."""
    _apply_auto_layout(arguments["self"], arguments)


def _apply_auto_layout(pipe: DiffusionPipeline, arguments: dict[str, Any]) -> None:
    """``parallel="auto"`` at the first pipeline call: the layout for these arguments, checked on every
    component it spreads, then spread as ``accelerate`` spreads a layout it was given."""
    state = state_of(pipe)
    spread = auto_components(state.config, state.components)
    if not spread:  # the transformers belong to another accelerated pipeline (from_pipe)
        return
    chosen = (
        _native_choice(spread[0], arguments)
        if spread[0].runtime is not None
        else _generic_choice(spread, arguments)
    )
    parallel = init_parallel(chosen.config)
    try:
        for component in spread:
            if component.runtime is not None:
                check_layout(
                    component.original, component.spec.native_model(), parallel, component.graphs is not None
                )
            else:
                check_generic_layout(component.original, component.spec, parallel)
        vae_coders, others = plan_vae(pipe, state.config, distributed=True)
        for component in spread:
            component.parallel = parallel
        state.undo += [parallel.close, *spread_layout(pipe, spread, vae_coders, parallel)]
    except BaseException:
        for component in spread:
            component.parallel = None
        parallel.close()
        raise
    state.others, state.vae = others, getattr(pipe, "vae", None)
    for component in spread:
        where = f"{chosen.config} on {dist.get_world_size()} ranks"
        if component.runtime is None:  # as the generic tier's report says of a layout it was given
            where = generic_layout_note(chosen.config)
            report_layout(component.report, parallel)
        component.report.layout = f"parallel='auto': {where}, chosen at the first call: {chosen.reason}"
    logger.info("parallel='auto' chose %s: %s", chosen.config, chosen.reason)


def _native_choice(component: Component, arguments: dict[str, Any]) -> AutoLayout:
    """The layout for a native component, by its plan and the call's arguments (``choose_layout``). Blocks
    holding a weight the native math cannot read (quantized, offloaded) run Diffusers' forward, which
    ``tp``, ``ulysses`` and ``ring`` cannot split: only ``cfg=2`` over two ranks serves them."""
    model, module = component.spec.native_model(), component.original
    sequence = model.parallel.sequence
    guided = model.cfg_pairing is not None and bool(model.cfg_pairing(arguments))
    unsplittable = _unsplittable_weight(module, model)
    if unsplittable is not None:
        if guided and _world_size() == 2:
            return AutoLayout(
                ParallelConfig(cfg=2),
                f"cfg=2: the call runs both guidance branches, and {unsplittable}, so the blocks run "
                "Diffusers' forward, which tp, ulysses and ring cannot split",
            )
        raise ValueError(
            f"parallel='auto' found no layout for pipe.{component.name} ({type(module).__name__}) on "
            f"{_world_size()} ranks: {unsplittable}, so its blocks run Diffusers' forward, which tp, ulysses "
            "and ring of native blocks cannot split (only cfg=2 over two ranks, for a call with guidance). Pass "
            "native=False (the model's Diffusers _cp_plan then splits its sequence), or load it unquantized."
        )
    return choose_layout(
        _world_size(),
        module.config[model.parallel.attention_heads],
        cfg_by_default=guided,
        sequence_plan=sequence is not None,
        ring_first=(
            sequence is not None
            and sequence.ring_first
            and LayoutTuning().peer_writes
            and ranks_write_each_other()
        ),
    )


def _unsplittable_weight(module: nn.Module, model) -> str | None:
    """``<name> is <kind>`` for the first parameter of a native block the native math cannot read, or None."""
    for block in native_blocks(module, model):
        for name, param in block.named_parameters():
            if quantized_or_absent(param):
                return f"{block.omni_name}.{name} is {tensor_kind(param)}"
    return None


def _generic_choice(components: list[Component], arguments: dict[str, Any]) -> AutoLayout:
    """The layout for the generic tier's transformers (``choose_generic_layout``), by what the first
    declares to Diffusers and its pipelines' guidance rule read on the call's arguments; the sequence split
    only where every one has a ``_cp_plan``."""
    module, spec = components[0].original, components[0].spec
    rule = guidance_rule(spec)
    return choose_generic_layout(
        _world_size(),
        module.config.get("num_attention_heads") or 1,  # unknown: no head split, the ring
        f"pipe.{components[0].name} ({type(module).__name__})",
        guidance=rule is not None and bool(rule(arguments)),
        sequence_plan=all(_splits_sequence(c.original, c.spec) for c in components),
    )


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
    if parallel.config.cfg == 1:
        return None
    return _pairing_rule(spec)


def _pairing_rule(spec: ModelSpec | None) -> Callable | None:
    if spec is None:
        return None
    native = spec.native_model()  # native=False: how the pipeline calls the model is the same
    return spec.cfg_pairing or (native.cfg_pairing if native is not None else None)


def guidance_rule(spec: ModelSpec | None) -> Callable[[dict[str, Any]], Any] | None:
    """How a pipeline call's arguments tell whether it runs both guidance branches of a model without native
    blocks: its pipelines' pairing rule (two calls a step), else their batched one (one call holding both);
    None where neither is known."""
    return _pairing_rule(spec) or (spec.batched_guidance if spec is not None else None)


def check_generic_layout(module: nn.Module, spec: ModelSpec | None, parallel: ParallelState) -> None:
    """Raises, before anything changes, when ``parallel``'s layout cannot apply to ``module``, a transformer
    of the generic tier (by its Diffusers plans, and the patches the layout needs)."""
    routes = spec.attention_routes if spec is not None else ()
    check_parallel(module, generic_parallel_plan(module, parallel.config, routed=bool(routes)), parallel)
    if generic_pairing(spec, parallel) is not None:
        patches.check_applicable("pair_cfg_calls")
    for patch in layout_patches(parallel.config, graphs=False, splits_sequence=False):
        patches.check_applicable(patch.name)


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


def generic_layout_note(config: ParallelConfig) -> str:
    """How a layout spreads a model without native blocks: by the plans Diffusers declares for it."""
    note = f"{config} on {dist.get_world_size()} ranks"
    if config.sequence_parallel > 1:
        note += ", the sequence split as its _cp_plan declares"
    if config.cfg > 1:
        note += ", the guidance branches over the cfg ranks"
    if config.tp > 1:
        note += ", its linears split as its _tp_plan declares"
    return note


def report_layout(report: ComponentReport, parallel: ParallelState | None, tp_tokens: bool = False) -> None:
    """The layout a component's report describes: its tuning and the groups whose exchanges it lists
    (``tp_tokens``: the TP group's, where the model's tokens may be split over it)."""
    if parallel is None:
        return
    report.tuning = parallel.config.tuning
    if parallel.config.ulysses > 1:
        report.ulysses_group = parallel.group("ulysses")
    if parallel.config.ring > 1:
        report.ring_group = parallel.group("ring")
    if tp_tokens and parallel.config.tp > 1:
        report.tp_group = parallel.group("tp")
