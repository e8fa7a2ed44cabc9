"""The user-facing entry points: ``accelerate``, ``restore``, ``describe``.

``accelerate`` reads top to bottom as three phases:

1. plan: check every component and build what it will run with (its runtime, report, graphs, and the
   checks of a layout); any error leaves the pipeline untouched;
2. commit: each component's ordered steps (``_NATIVE_STEPS`` or ``_GENERIC_STEPS``: native blocks, the
   runtime bound to each forward, cache sites, compiled regions, graphs);
3. spread, under a layout (``_spread``): each component over the ranks with the patches its layout
   declares, the CFG calls paired, the VAE split, each rank's shards on its device. ``parallel="auto"``
   runs this phase at the first pipeline call, once the layout is chosen and checked.

Every step records its own undo (an error in phase 2 or 3 runs those done so far); ``restore`` runs them
in reverse order.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import itertools
import os
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline, ModelMixin, ModularPipeline
from diffusers.models.modeling_utils import get_parameter_dtype
from torch import nn

import omni_accel.patches as patches
from omni_accel.patches import attention_roles, pair_cfg_calls, scoped_calls

from . import cuda_graphs, pipeline_calls
from .attention import routing
from .attention.base import AttentionProviderError, AttentionRequest
from .attention.selection import AttentionConfig, AttentionSelector, resolve
from .cache import ExactProjectionCache, wrap_sites
from .config import DEFAULT_COMPONENTS, AccelConfig
from .forward_hooks import add_scope, installed
from .layers.attention import enter_forward, leave_forward
from .layers.fp8 import Fp8Weights
from .layers.fp8_linears import MIN_FP8_ROWS, install_fp8_linears
from .layers.split_modulation import SplitModulation
from .models.base import (
    NativeBlock,
    NativeModel,
    NativeRuntime,
    modulation_sites,
    native_blocks,
    swap_blocks,
)
from .models.generic import (
    GenericRuntime,
    generic_parallel_plan,
    install_regions,
    repeated_blocks,
)
from .models.registry import (
    ModelSpec,
    generic_adaptation,
    output_class,
    registered_natives,
    registered_spec,
    spec_for,
)
from .moves import AfterMoves, DropsMoved
from .parallel import Parallelized, check_parallel, parallelize
from .parallel import vae as vae_split
from .parallel.auto import choose_layout
from .parallel.config import LayoutTuning, ParallelConfig
from .parallel.held_groups import refuse_pickle, share_groups
from .parallel.mesh import ParallelState, init_parallel
from .parallel.peer_memory import ranks_write_each_other
from .parallel.routed_attention import LiveSplit
from .parallel.tensor import FusedSplit, sum_row_splits
from .report import FP8_CLAIM, AccelerationReport, ComponentReport, step_cache_note
from .utils import triton_builds, versions
from .utils.copies import deepcopy_instance
from .utils.logging import get_logger

logger = get_logger(__name__)

_STATE_ATTR = "_omni_accel_state"


def _shared(tier: str) -> str:
    """The mode of a transformer another pipeline (or another name of this one) set up: its tier, shared."""
    return f"{tier} (shared)"


# What accelerate takes: the pipelines of `diffusers.pipelines` and those built from blocks
# (`diffusers.modular_pipelines`); both hold their denoiser as an attribute (`pipe.transformer`).
Pipeline = DiffusionPipeline | ModularPipeline


@dataclass
class _Component:
    name: str
    original: nn.Module
    spec: ModelSpec | None
    report: ComponentReport
    cache: ExactProjectionCache | None = None
    runtime: NativeRuntime | None = None
    parallel: ParallelState | None = None  # a distributed layout to apply at commit
    graphs: cuda_graphs.StepGraphs | None = None
    generic: GenericRuntime | None = None  # the generic tier's compiled blocks
    undo: list[Callable[[], None]] = field(default_factory=list)
    shared: bool = False  # accelerated by another pipeline holding the same module (from_pipe), which owns it
    # what else holds tensors made of the module's weights, let go of at its moves (``_drop_at_moves``)
    stores: list[DropsMoved] = field(default_factory=list)

    def __deepcopy__(self, memo: dict) -> _Component:
        # The report names the layout's process groups (``describe`` reads them): a copy shares them. Here,
        # not in ``_State``: the module's ``_Owner`` reaches the component first when the module is copied.
        share_groups(vars(self.report).values(), memo)
        return deepcopy_instance(self, memo)


@dataclass
class _Owner:
    """The component that set a module up and the options it used, kept on the module (as its setup is):
    a deep or unpickled copy of a pipeline sharing the module (from_pipe) without its owner holds a copy of
    the module that no pipeline owns, and takes it over with this (``_adopt_orphans``)."""

    component: _Component
    config: AccelConfig


_OWNER = "_omni_accel_owner"


@dataclass
class _State:
    config: AccelConfig
    components: list[_Component]
    undo: list[Callable[[], None]]
    absent: list[ComponentReport] = field(default_factory=list)
    others: list[ComponentReport] = field(default_factory=list)  # components other than denoisers (the VAE)
    vae: nn.Module | None = None  # the VAE ``others`` describes (pipe.vae may be replaced since)
    # Components a modular pipeline let go of (``unload_components``, ``update_components``): name -> the
    # class it held, restored and no longer referenced (``_release_dropped``).
    released: dict[str, str] = field(default_factory=dict)
    # Accelerated by zero-code as the pipeline was built (``auto``): an explicit accelerate is told so.
    zero_code: bool = False

    def __deepcopy__(self, memo: dict) -> _State:
        twin = deepcopy_instance(self, memo)
        twin.__setstate__(vars(twin))
        return twin

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        _hold_copied_patches(self.undo)
        for component in self.components:  # a copy owns its copied modules: its siblings share its options
            _hold_copied_patches(component.undo)
            if not component.shared:
                _SET_UP_WITH[component.original] = self.config
        for report in self.others:
            if report.mode == "patch-parallel":
                _SPLIT_CODERS.update(report.row_split.values())

    def __getstate__(self) -> dict[str, Any]:
        for component in self.components:  # before the reports, which hold the groups too
            if component.parallel is not None and component.parallel.mesh is not None:
                refuse_pickle(f"This pipeline, accelerated with {component.parallel.config},")
        return vars(self)


class _Unset(enum.Enum):
    """An option of ``accelerate`` not given: ``config``'s value (or the default) stands."""

    UNSET = "unset"


_UNSET = _Unset.UNSET


def accelerate(
    pipe: Pipeline,
    config: AccelConfig | None = None,
    *,
    attention: AttentionConfig | str | Mapping[str, Any] | _Unset = _UNSET,
    native: bool | _Unset = _UNSET,
    projection_cache_bytes: int | None | _Unset = _UNSET,
    parallel: ParallelConfig | str | None | _Unset = _UNSET,
    compile: bool | Mapping[str, Any] | None | _Unset = _UNSET,
    compile_in_background: bool | _Unset = _UNSET,
    cuda_graphs: bool | None | _Unset = _UNSET,
    vae_parallel: bool | None | _Unset = _UNSET,
    components: tuple[str, ...] | _Unset = _UNSET,
    quantize: str | None | _Unset = _UNSET,
) -> Pipeline:
    """Accelerates ``pipe`` in place and returns it; its call signature and outputs stay Diffusers'.

    Every option is also a field of :class:`AccelConfig` (its docstring has the details); an option given
    here overrides ``config``'s.

    Args:
        pipe: a Diffusers ``DiffusionPipeline`` or ``ModularPipeline``; its transformer(s) are accelerated.
        config: all options at once, e.g. shared by several pipelines.
        attention: the provider for every attention site (``"auto"``, ``"sdpa"``, ``"flashinfer"``...), or an
            ``AttentionConfig`` / ``{"default": ..., "per_role": {...}}`` for per-role choices.
        native: swap in native blocks where the model has them (False: the generic tier only).
        projection_cache_bytes: the exact projection cache's budget (0: off; None: the model's default).
        parallel: a ``ParallelConfig`` (tp, ulysses, ring, cfg) for a torchrun launch, or ``"auto"``.
        compile: ``torch.compile`` the repeated blocks (True or ``torch.compile`` arguments; None: automatic).
        compile_in_background: compile in a thread while eager calls serve, so no call waits for it.
        cuda_graphs: replay each step from a CUDA graph (None: on wherever steps run on CUDA).
        vae_parallel: under a layout, split the VAE decode over the ranks (None: where its layers allow).
        components: the pipeline attributes treated as denoisers.
        quantize: ``"fp8"`` for lossy FP8 projections (opt-in); None keeps everything lossless.
    """
    given = dict(
        attention=attention,
        native=native,
        projection_cache_bytes=projection_cache_bytes,
        parallel=parallel,
        compile=compile,
        compile_in_background=compile_in_background,
        cuda_graphs=cuda_graphs,
        vae_parallel=vae_parallel,
        components=components,
        quantize=quantize,
    )
    overrides = {name: value for name, value in given.items() if value is not _UNSET}
    if not isinstance(pipe, Pipeline):
        raise TypeError(
            f"accelerate() takes a Diffusers pipeline, got {type(pipe).__name__} (pass a DiffusionPipeline or a "
            "ModularPipeline; its transformer is accelerated in place)."
        )
    state = getattr(pipe, _STATE_ATTR, None)
    if state is not None and not _holds_nothing(state):
        if state.zero_code:
            raise RuntimeError(
                "This pipeline is already accelerated by zero-code acceleration as it was built (omni_accel.enable(), "
                "omni-accel run or %load_ext omni_accel), with the options given there; call omni_accel.restore(pipe) "
                "first to accelerate it with others."
            )
        raise RuntimeError("This pipeline is already accelerated; call omni_accel.restore(pipe) first.")
    if config is not None and not isinstance(config, AccelConfig):
        raise TypeError(f"config must be an omni_accel.AccelConfig, got {type(config).__name__}.")
    # What the shared components of a state that holds nothing still hold: the scopes a module holding their
    # blocks got (``_scope_holders``), bound to a transformer that its owner has since restored.
    if state is not None:
        for component in state.components:
            _undo_component(component)
    config = (config or AccelConfig()).with_overrides(**overrides)
    asked = _asked(config, overrides)

    names = _denoiser_names(pipe, config)
    if not names:
        detail = (
            f"{type(pipe).__name__} has no transformer component; nothing was accelerated and the pipeline "
            "runs exactly as in Diffusers"
        )
        others = sorted(name for name, module in pipe.components.items() if _is_denoiser(module))
        if others:  # a UNet: not taken by default (no native blocks), taken when named
            detail += f"; components={tuple(others)!r} accelerates its denoiser"
        note = ComponentReport(", ".join(config.components), "-", "absent", detail)
        setattr(pipe, _STATE_ATTR, _State(config, [], [], absent=[note]))
        logger.warning("%s: %s", type(pipe).__name__, note.detail)
        return pipe
    layout, auto_reason = _parallel_config(pipe, names, config)
    if layout is not None and isinstance(pipe, ModularPipeline):
        raise ValueError(
            f"parallel={config.parallel!r} spreads the standard pipelines' calls over the ranks, and "
            f"{type(pipe).__name__} is a modular pipeline (its calls are blocks); run it on one device "
            "(without `parallel`), or use the standard pipeline of the model."
        )
    deferred = layout is _AT_FIRST_CALL
    parallel = init_parallel(layout) if layout is not None and not deferred else None
    try:
        components, others, undo = _plan_and_commit(pipe, names, config, parallel, auto_reason, asked)
    except BaseException:
        if parallel is not None:
            parallel.close()  # a refused layout leaves no process groups behind either
        raise
    if deferred:
        undo.append(pipeline_calls.on_first_call(pipe, _apply_auto_layout_at_call))
    if isinstance(pipe, ModularPipeline):
        undo.append(_follow_registrations(pipe))
    state = _State(config, components, undo, others=others, vae=getattr(pipe, "vae", None))
    _adopt_orphans(state)
    setattr(pipe, _STATE_ATTR, state)
    triton_builds.set_up_in_background()  # while the first call encodes its prompt
    _log_summary(pipe, components)
    return pipe


def _plan_and_commit(
    pipe: Pipeline,
    names: list[str],
    config: AccelConfig,
    parallel: ParallelState | None,
    auto_reason: str | None,
    asked: frozenset[str],
) -> tuple[list[_Component], list[ComponentReport], list[Callable[[], None]]]:
    """``accelerate``'s plan and commit under ``parallel`` (None: one device, or a layout chosen at the first
    call): the components, the other reports (the VAE's split) and the pipeline-level undos (the mesh's
    groups destroyed last)."""
    components: list[_Component] = []
    for name in names:
        module = getattr(pipe, name)
        first = next((c for c in components if c.original is module), None)
        components.append(
            _plan(name, module, config, parallel, asked) if first is None else _held_twice(name, first)
        )
    distributed = parallel is not None and parallel.mesh is not None
    vae_coders, others = _plan_vae(pipe, config, distributed)
    if auto_reason is not None:
        for component in components:
            if component.runtime is not None:
                component.report.layout = f"parallel='auto': {auto_reason}"
    undo = _commit_all(pipe, components, vae_coders, parallel if distributed else None)
    for component in components:
        if not component.shared:  # what a pipeline sharing the module (from_pipe) is compared with
            _SET_UP_WITH[component.original] = config
            component.undo.insert(0, functools.partial(_forget_setup, component.original, config))
            if _setup_of(component.original) is not None:
                _keep_owner(component, config)
    if distributed:
        undo.insert(0, parallel.close)  # restore runs it last, once the components are undone
    return components, others, undo


# The options each accelerated transformer was set up with, by module: another pipeline holding it (from_pipe)
# shares that setup, and options it asks that differ are refused (``_check_shared_options``).
_SET_UP_WITH: weakref.WeakKeyDictionary[nn.Module, AccelConfig] = weakref.WeakKeyDictionary()
# The options that set up a transformer (the others are the pipeline's own: which components, its VAE).
_MODULE_OPTIONS = (
    "attention",
    "native",
    "projection_cache_bytes",
    "parallel",
    "compile",
    "compile_in_background",
    "cuda_graphs",
    "quantize",
)


def _forget_setup(module: nn.Module, config: AccelConfig) -> None:
    """Restore's undo of ``_SET_UP_WITH``: a function, so that a pipeline holding it pickles (the weak
    dictionary does not). Only ``config``: a pipeline that left the module untouched forgets not the setup
    another one (from_pipe) made on it since."""
    if _SET_UP_WITH.get(module) is config:
        del _SET_UP_WITH[module]


def _keep_owner(component: _Component, config: AccelConfig) -> None:
    """The module keeps who set it up (``_Owner``), so that a copy of it that no pipeline owns can be restored."""
    owner = _Owner(component, config)
    object.__setattr__(component.original, _OWNER, owner)
    component.undo.insert(0, functools.partial(_drop_owner, component.original, owner))


def _drop_owner(module: nn.Module, owner: _Owner) -> None:
    if module.__dict__.get(_OWNER) is owner:
        object.__delattr__(module, _OWNER)


def _orphan_owner(module: nn.Module) -> _Owner | None:
    """The owner kept on a set-up ``module`` that no pipeline owns (a copy of a from_pipe sibling's, made
    without its owner's), else None."""
    owner = module.__dict__.get(_OWNER)
    if owner is None or module in _SET_UP_WITH or _setup_of(module) is None:
        return None
    return owner


def _adopt_orphans(state: _State) -> None:
    """A shared component whose module no pipeline owns becomes this pipeline's (restore undoes it, describe
    says so): a deep or unpickled copy of a from_pipe sibling owns the modules it copied, as its copy in
    Diffusers does; so does the VAE split a layout's sibling shared, which no pipeline split in the copy."""
    for i, component in enumerate(state.components):
        owner = _orphan_owner(component.original) if component.shared else None
        if owner is not None:
            adopted = owner.component
            _hold_copied_patches(adopted.undo)
            adopted.name = component.name
            adopted.report = dataclasses.replace(adopted.report, name=component.name)
            state.components[i] = adopted
            _SET_UP_WITH[component.original] = owner.config
    for i, report in enumerate(state.others):
        splits = {name: installed(coder, vae_split.RowSplit) for name, coder in report.row_split.items()}
        if report.mode != _shared("patch-parallel") or None in splits.values():
            continue
        if not any(coder in _SPLIT_CODERS for coder in report.row_split.values()):
            state.others[i] = dataclasses.replace(
                report, mode="patch-parallel", detail=_split_detail(list(splits))
            )
            for name, coder in report.row_split.items():
                _SPLIT_CODERS.add(coder)
                state.undo.append(functools.partial(_unsplit, coder, splits[name]))


def _asked(config: AccelConfig, overrides: Mapping[str, Any]) -> frozenset[str]:
    """The options the caller set: given as keywords, or in ``config`` at other than their defaults."""
    default = AccelConfig()
    differ = {
        f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)
    }
    return frozenset(overrides) | differ


def differing_options(module: nn.Module, config: AccelConfig) -> tuple[AccelConfig | None, list[str]]:
    """The options another pipeline holding ``module`` (from_pipe) accelerated it with (None: none did), and
    the module options ``config`` sets otherwise (zero-code reads them too)."""
    owner = _SET_UP_WITH.get(module)
    if owner is None and (orphan := _orphan_owner(module)) is not None:
        owner = orphan.config
    if owner is None:
        return None, []
    return owner, [o for o in _MODULE_OPTIONS if getattr(config, o) != getattr(owner, o)]


def _check_shared_options(name: str, module: nn.Module, config: AccelConfig, asked: frozenset[str]) -> None:
    """Raises where this call asks options for ``module`` other than those another pipeline that holds it
    (from_pipe) accelerated it with: one module runs one setup, and the asked ones would be ignored."""
    owner, differ = differing_options(module, config)
    differ = [o for o in differ if o in asked]
    if owner is not None and differ:
        theirs = ", ".join(f"{o}={getattr(owner, o)!r}" for o in differ)
        ours = ", ".join(f"{o}={getattr(config, o)!r}" for o in differ)
        raise ValueError(
            f"pipe.{name} ({type(module).__name__}) is shared with another pipeline (from_pipe) that "
            f"accelerated it with {theirs}, and this call asks {ours}: one module runs one setup. Call "
            "accelerate without these options to share that setup, or omni_accel.restore() the other "
            "pipeline first."
        )


def _held_twice(name: str, first: _Component) -> _Component:
    """A module the pipeline holds under a second name as well (``pipe.transformer_2 = pipe.transformer``):
    accelerated once, as ``first``, which owns it; this name shares it."""
    module = first.original
    detail = f"the module pipe.{first.name} holds too: accelerated once, as pipe.{first.name}"
    report = ComponentReport(name, type(module).__name__, _shared(first.report.mode), detail)
    return _Component(name, module, first.spec, report, shared=True)


def _commit_all(
    pipe: Pipeline,
    components: list[_Component],
    vae_coders: list[nn.Module],
    parallel: ParallelState | None,
) -> list[Callable[[], None]]:
    """Commits every planned component, then under a layout spreads the pipeline over the ranks; an error
    on the way undoes what was done, so that a refused ``accelerate`` leaves the pipeline as Diffusers made
    it. Returns the pipeline-level undos."""
    try:
        for component in components:
            _commit(component)
        _scope_holders(pipe, components)
        return _spread(pipe, components, vae_coders, parallel) if parallel is not None else []
    except BaseException:
        for component in reversed(components):
            for undo in reversed(component.undo):
                undo()
            component.undo.clear()
        raise


def _is_denoiser(module: Any) -> bool:
    """A Diffusers transformer or UNet (what ``components`` may name): a registered model, a class of
    ``diffusers.models.transformers`` / ``unets``, or a custom ModelMixin named as one."""
    module = getattr(module, "_orig_mod", module)  # a torch.compile'd one: _plan says how to accelerate it
    if not isinstance(module, ModelMixin):
        return False
    cls = type(module)
    return (
        registered_spec(module) is not None
        or cls.__module__.startswith(("diffusers.models.transformers.", "diffusers.models.unets."))
        or "Transformer" in cls.__name__
        or "UNet" in cls.__name__
    )


def _denoiser_names(pipe: Pipeline, config: AccelConfig) -> list[str]:
    """The components to accelerate. The default names skip an absent one (a pipeline with one
    transformer); a name given explicitly must be a denoiser of this pipeline."""
    present = [name for name in config.components if isinstance(getattr(pipe, name, None), nn.Module)]
    if config.components == DEFAULT_COMPONENTS:
        return present
    denoisers = sorted(name for name, module in pipe.components.items() if _is_denoiser(module))
    missing = [name for name in config.components if name not in present]
    if missing:
        raise ValueError(
            f"components names {missing}, which {type(pipe).__name__} does not hold (absent or None); its "
            f"denoisers are {denoisers}. Name only those (the default {list(DEFAULT_COMPONENTS)} skips absent ones)."
        )
    wrong = [name for name in present if not _is_denoiser(getattr(pipe, name))]
    if wrong:
        listed = ", ".join(f"pipe.{name} ({type(getattr(pipe, name)).__name__})" for name in wrong)
        raise ValueError(
            f"components names {listed}, not a denoiser: accelerate speeds up a pipeline's Diffusers "
            f"transformers and UNets, and this pipeline's are {denoisers}."
        )
    return present


def _holds_nothing(state: _State) -> bool:
    """Whether an accelerated state holds nothing any more (it found no transformer, or only shared ones
    that their owner has since restored), so that ``accelerate`` may start again (its own following of a
    modular pipeline's registrations, which the new state replaces, holds nothing)."""
    following = [
        u for u in state.undo if isinstance(u, functools.partial) and u.func is _unfollow_registrations
    ]
    return len(following) == len(state.undo) and all(
        c.shared and _setup_of(c.original) is None for c in state.components
    )


def _in_sync(pipe: Pipeline) -> bool:
    """Whether the accelerated state still describes ``pipe``: each component accelerate saw is still the
    pipeline's, and no denoiser was added since (a modular pipeline loads its components later)."""
    state = _state(pipe)
    seen = {component.name: component.original for component in state.components}
    names = [name for name in state.config.components if isinstance(getattr(pipe, name, None), nn.Module)]
    return set(names) == set(seen) and all(getattr(pipe, name) is module for name, module in seen.items())


def _log_summary(pipe: Pipeline, components: list[_Component]) -> None:
    """One INFO line per accelerate; a WARNING for whatever was left to Diffusers."""
    summary = "; ".join(f"{c.name} ({c.report.diffusers_class}) {c.report.mode}" for c in components)
    logger.info("%s accelerated: %s (omni_accel.describe(pipe) for details)", type(pipe).__name__, summary)
    for component in components:
        report = component.report
        if report.mode not in ("native", _shared("native")):
            logger.warning(
                "pipe.%s (%s) is %s: %s", report.name, report.diffusers_class, report.mode, report.detail
            )


def _undo_component(component: _Component) -> None:
    for undo in reversed(component.undo):
        undo()
    component.undo.clear()
    if component.cache is not None:
        component.cache.clear()
    if component.runtime is not None and component.runtime.fp8 is not None:
        component.runtime.fp8.release()


_REGISTER = "register_components"


def _follow_registrations(pipe: ModularPipeline) -> Callable[[], None]:
    """Has ``pipe``'s own ``register_components`` (where ``update_components``, ``load_components`` and
    ``unload_components`` end) let go of the transformers it drops; returns the undo. On the instance, so
    nothing outside this pipeline changes; a partial, so that a copy of the pipeline follows its own."""
    hook = functools.partial(_register_and_release, pipe)
    object.__setattr__(pipe, _REGISTER, hook)
    return functools.partial(_unfollow_registrations, pipe, hook)


def _unfollow_registrations(pipe: ModularPipeline, hook: functools.partial) -> None:
    if pipe.__dict__.get(_REGISTER) is hook:
        object.__delattr__(pipe, _REGISTER)


def _register_and_release(pipe: ModularPipeline, **kwargs: Any) -> None:
    type(pipe).register_components(pipe, **kwargs)  # the class's (zero-code's wrapper, where enabled)
    state = getattr(pipe, _STATE_ATTR, None)
    if state is not None:
        _release_dropped(pipe, state)


def _release_dropped(pipe: ModularPipeline, state: _State) -> None:
    """A transformer the modular pipeline no longer holds (unloaded or replaced) is restored and dropped
    from the state: ``unload_components`` frees its memory as in Diffusers (the state kept it alive), and
    the module is left as Diffusers made it, as zero-code leaves it. ``describe`` says it was replaced."""
    held = [module for module in pipe.components.values() if isinstance(module, nn.Module)]
    for component in list(state.components):
        if any(module is component.original for module in held):
            continue
        _undo_component(component)
        state.components.remove(component)
        state.released[component.name] = type(component.original).__name__


def restore(pipe: Pipeline) -> Pipeline:
    """Puts the original Diffusers modules back (with the current weights, device and dtype)."""
    if getattr(pipe, _STATE_ATTR, None) is None and (shared := _set_up_elsewhere(pipe)):
        # Restoring a module another pipeline set up would undo that pipeline too (one module, one setup).
        name, module = shared[0]
        where = (
            "a copy of a module another pipeline accelerated (a deep or unpickled copy), which no pipeline owns; "
            "omni_accel.accelerate(pipe) takes it over, after which omni_accel.restore(pipe) gives it back its "
            "Diffusers modules"
            if _orphan_owner(module) is not None
            else "shared with another pipeline (from_pipe) that accelerated it, and restoring it here would "
            "undo that pipeline too; omni_accel.restore() that pipeline (this one then runs as plain Diffusers "
            "as well)"
        )
        raise ValueError(
            f"This pipeline was not accelerated itself: pipe.{name} ({type(module).__name__}) is {where}."
        )
    state = _state(pipe)
    for component in state.components:
        _undo_component(component)
    for undo in reversed(state.undo):
        undo()
    setattr(pipe, _STATE_ATTR, None)
    return pipe


def describe(pipe: Pipeline) -> AccelerationReport:
    """What was swapped, which provider serves each attention role and why, cache use, and what was left:
    as things are now (a shared transformer its owner restored, a component replaced since), not as planned.
    A pipeline not accelerated itself whose transformer another pipeline set up (a from_pipe sibling) runs
    that setup: its report says so."""
    state = getattr(pipe, _STATE_ATTR, None)
    state = _borrowed_state(pipe) if state is None and _set_up_elsewhere(pipe) else _state(pipe)
    reports = []
    for component in state.components:
        report, held = _current_report(pipe, component, state.components)
        if held is not None and held.runtime is not None and report.runtime is not None:
            sites = _native_sites(held.original, held.spec.native_model())
            report.planned_attention = _resolve_rows(
                sites, _placement(held.original), report.selector, strict=False
            )
        compiled = _users_compile(held.original) if isinstance(report.runtime, NativeRuntime) else None
        if compiled is not None:
            report = dataclasses.replace(report, not_accelerated=[*report.not_accelerated, compiled])
        if held is not None:  # read now: enable_cache() and disable_cache() come before or after accelerate
            report = dataclasses.replace(report, step_cache=step_cache_note(held.original))
        if isinstance(report.runtime, NativeRuntime):
            report = dataclasses.replace(report, holders=_holder_lines(pipe, state, report.runtime))
        reports.append(report)
    for name, held_class in state.released.items():
        reports.append(_replaced_report(pipe, name, held_class))
    others = [
        _current_vae_report(pipe, other, state.vae) if other.name == "vae" else other
        for other in state.others
    ]
    return AccelerationReport(type(pipe).__name__, reports + others + state.absent)


def _holder_lines(pipe: Pipeline, state: _State, runtime: NativeRuntime) -> list[str]:
    """How the components holding native blocks of ``runtime`` (``_holders``) run them now."""
    lines = []
    for name, module, held, count in _holders(pipe, [c.original for c in state.components]):
        if held is not runtime:
            continue
        line = f"pipe.{name} ({type(module).__name__}) holds {count} of these native blocks (Diffusers shares them)"
        if _binds(module, runtime):
            lines.append(f"{line}: they run natively in its forward too")
        elif getattr(pipe, _STATE_ATTR, None) is None:  # a from_pipe sibling of the accelerated pipeline
            lines.append(
                f"{line}: they run Diffusers' forward in its forward (counted above), this pipeline not being "
                "accelerated itself; omni_accel.accelerate(pipe) runs them natively there"
            )
        else:
            lines.append(
                f"{line}, put in the pipeline after accelerate: they run Diffusers' forward in its forward (counted "
                "above); omni_accel.restore(pipe), then accelerate(pipe), runs them natively there"
            )
    return lines


def _users_compile(module: nn.Module) -> str | None:
    """What a user's own compile (``compile_repeated_blocks()``, ``Module.compile()`` of the transformer or
    of blocks), made before or after ``accelerate``, does to the native blocks it covers (None: none)."""
    blocks = [m for m in module.modules() if isinstance(m, NativeBlock)]
    if module.__dict__.get("_compiled_call_impl") is not None:
        where = f"{type(module).__name__} itself (Module.compile()) holds its {len(blocks)} native blocks"
    else:
        compiled = sum(block.__dict__.get("_compiled_call_impl") is not None for block in blocks)
        if not compiled:
            return None
        where = (
            f"{compiled} of the {len(blocks)} native blocks (compile_repeated_blocks() or Module.compile())"
        )
    return (
        f"a torch.compile of the user's own: {where}; it traces Diffusers' forward of those blocks, so they "
        "run neither the native math nor our attention providers nor the projection cache (the lines above "
        "count native runs only). Drop that compile and pass compile=True to compile the native math instead"
    )


def _current_report(
    pipe: Pipeline, component: _Component, components: list[_Component]
) -> tuple[ComponentReport, _Component | None]:
    """The component's report as things are now, and the accelerated component whose module it holds now
    (None: a module this ``accelerate`` did not set up)."""
    module = getattr(pipe, component.name, None)
    held = next((other for other in components if other.original is module), None)
    if held is None:
        return _replaced_report(pipe, component.name, type(component.original).__name__), None
    # A module this pipeline left untouched may hold another pipeline's setup since (from_pipe).
    untouched_then_set_up = held.report.mode == "untouched" and _setup_of(module) is not None
    report = _shared_report(component.name, module) if held.shared or untouched_then_set_up else held.report
    if held is not component:  # accelerated components swapped between slots (Wan 2.2's two experts)
        detail = f"{report.detail} (set up as pipe.{held.name}, which pipe.{component.name} holds now)"
        report = dataclasses.replace(report, name=component.name, detail=detail)
    return report, held


def _replaced_report(pipe: Pipeline, name: str, held_class: str) -> ComponentReport:
    """``pipe.<name>``, which held a ``held_class`` at ``accelerate``, as it runs now."""
    module = getattr(pipe, name, None)
    cls_name = type(module).__name__ if module is not None else "-"
    detail = f"pipe.{name} was replaced after accelerate (it held a {held_class}); what it holds now "
    if module is not None and _setup_of(module) is not None:
        detail += "was accelerated by another pipeline, and runs as that one set it up"
    else:
        detail += "runs as in Diffusers: omni_accel.restore(pipe), then accelerate(pipe), accelerates it"
    return ComponentReport(name, cls_name, "replaced", detail)


def _current_vae_report(pipe: Pipeline, report: ComponentReport, vae: nn.Module | None) -> ComponentReport:
    """The VAE's ``report`` as things are now: a VAE put in ``pipe.vae`` after ``accelerate`` is not the
    one ``vae`` it split (or left whole), so its line says so rather than the old VAE's split and counts."""
    module = getattr(pipe, "vae", None)
    if module is vae:
        return _current_coders(report, vae)
    coders = [getattr(module, name, None) for name in ("decoder", "encoder")]
    detail = f"pipe.vae was replaced after accelerate (it held a {type(vae).__name__}); what it holds now "
    cls_name = type(module).__name__ if module is not None else "-"
    return ComponentReport("vae", cls_name, "replaced", detail + _how_coders_run(coders, "sets it up"))


def _current_coders(report: ComponentReport, vae: nn.Module) -> ComponentReport:
    """The VAE's ``report`` with the coders split at ``accelerate`` and replaced since (``pipe.vae.decoder =
    ...``) said as they run now, rather than as the split ones they replaced (and those splits' counts)."""
    replaced = [name for name, coder in report.row_split.items() if getattr(vae, name, None) is not coder]
    split = {name: coder for name, coder in report.row_split.items() if name not in replaced}
    if report.mode == _shared("patch-parallel") and not any(
        installed(coder, vae_split.RowSplit) is not None for coder in split.values()
    ):
        detail = (
            "shared with another pipeline (from_pipe) that split it by rows and has since restored it: it runs "
            "whole on every rank, as in Diffusers"
        )
        return dataclasses.replace(report, mode="untouched", detail=detail, row_split={})
    if not replaced:
        return report
    notes = [_split_detail(list(split))] if split else []
    for name in replaced:
        coder = getattr(vae, name, None)
        notes.append(
            f"pipe.vae.{name} was replaced after accelerate (it held a split {type(report.row_split[name]).__name__}); "
            f"what it holds now {_how_coders_run([coder], 'splits it')}"
        )
    mode = report.mode if split else "replaced"
    return dataclasses.replace(report, mode=mode, detail="; ".join(notes), row_split=split)


def _how_coders_run(coders: list[Any], remedy: str) -> str:
    """How a VAE's encoder and decoder put in after ``accelerate`` run: split (copies of split ones, or
    another pipeline's) or as in Diffusers."""
    if any(
        isinstance(coder, nn.Module) and installed(coder, vae_split.RowSplit) is not None for coder in coders
    ):
        return "was split by another pipeline's layout, and runs as that one set it up"
    return f"runs as in Diffusers: omni_accel.restore(pipe), then accelerate(pipe), {remedy}"


# The generic tier's setup of a transformer, kept on the module itself (as native blocks keep their runtime).
_GENERIC_SETUP = "_omni_accel_generic"


@dataclass
class _GenericSetup:
    """What the generic tier set up on a transformer (routed attention, compiled blocks, step graphs), kept
    on the module, so that a deep or unpickled copy carries its own: another pipeline holding the module
    (from_pipe) finds it and shares that setup rather than stacking a second one on it."""

    tier: str  # "generic" or "routed"
    detail: str
    selector: AttentionSelector | None
    cache: ExactProjectionCache | None
    runtime: GenericRuntime | None  # its compiled blocks or FP8 linears (None: neither)


def _setup_of(module: nn.Module) -> NativeRuntime | _GenericSetup | None:
    """The runtime of the native blocks inside ``module``, or the generic tier's setup of it (None: neither
    now)."""
    native = next((m.omni_runtime for m in module.modules() if isinstance(m, NativeBlock)), None)
    return native if native is not None else module.__dict__.get(_GENERIC_SETUP)


def _shared_report(name: str, module: nn.Module) -> ComponentReport:
    """A transformer that another pipeline accelerated (``from_pipe`` shares it): its state now."""
    setup = _setup_of(module)
    if setup is None:
        return ComponentReport(
            name,
            type(module).__name__,
            "untouched",
            "shared with another pipeline (from_pipe) that accelerated it and has since restored it: it runs "
            "exactly as in Diffusers",
        )
    graphs = installed(module, cuda_graphs.StepGraphs)  # under the hooks registered on the module since
    detail = "already accelerated by another pipeline that shares this module; restore that pipeline to undo"
    if _orphan_owner(module) is not None:  # a copy held by a pipeline not accelerated itself
        detail = (
            "a copy of a module another pipeline accelerated (a deep or unpickled copy), which no pipeline owns: "
            "it runs that setup; omni_accel.accelerate(pipe) takes it over (omni_accel.restore(pipe) then undoes it)"
        )
    if isinstance(setup, _GenericSetup):  # the other pipeline's detail says its tier, lossy options too
        detail += f"; as that pipeline set it up ({setup.tier}): {setup.detail}"
        return ComponentReport(
            name,
            type(module).__name__,
            _shared(setup.tier),
            detail,
            setup.selector,
            cache=setup.cache,
            runtime=setup.runtime,
            graphs=graphs,
        )
    if setup.fp8 is not None:  # its options are the other pipeline's, lossy ones too
        detail += f"; {FP8_CLAIM} (asked by that pipeline)"
    return ComponentReport(
        name,
        type(module).__name__,
        _shared("native"),
        detail,
        setup.selector,
        cache=setup.cache,
        cfg=setup.layout.cfg if setup.layout is not None else None,
        runtime=setup,
        graphs=graphs,
    )


def _set_up_elsewhere(pipe: Pipeline) -> list[tuple[str, nn.Module]]:
    """The denoisers of ``pipe`` (name, module) that another pipeline accelerated: what a pipeline not
    accelerated itself runs of ours (a from_pipe sibling of an accelerated pipeline, or a copy of one)."""
    return [
        (name, module)
        for name, module in pipe.components.items()
        if _is_denoiser(module) and _setup_of(module) is not None
    ]


def _borrowed_state(pipe: Pipeline) -> _State:
    """For ``describe`` of a pipeline not accelerated itself that runs modules another pipeline set up
    (``_set_up_elsewhere``): its denoisers as they run, in a state that owns and undoes nothing."""
    components = []
    for name, module in pipe.components.items():
        if not _is_denoiser(module):
            continue
        shared = _setup_of(module) is not None
        report = (
            _shared_report(name, module)
            if shared
            else ComponentReport(
                name,
                type(module).__name__,
                "untouched",
                "this pipeline was not accelerated itself: it runs as in Diffusers (omni_accel.accelerate(pipe) "
                "accelerates its transformers and shares the modules set up above)",
            )
        )
        components.append(_Component(name, module, spec_for(module), report, shared=shared))
    return _State(AccelConfig(), components, [])


def _state(pipe: Pipeline) -> _State:
    state = getattr(pipe, _STATE_ATTR, None)
    if state is None:
        raise ValueError("This pipeline is not accelerated; call omni_accel.accelerate(pipe) first.")
    _adopt_orphans(state)
    return state


def _plan(
    name: str, module: nn.Module, config: AccelConfig, parallel: ParallelState | None, asked: frozenset[str]
) -> _Component:
    """Decides what to do with one component and builds it, touching nothing in the pipeline."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            f"pipe.{name} is a torch.compile'd module; accelerate the module itself "
            f"(pipe.{name} = pipe.{name}._orig_mod) and pass compile=True to compile the native blocks."
        )
    spec = spec_for(module)
    if _setup_of(module) is not None:  # e.g. a sibling made by from_pipe shares an accelerated transformer
        _check_shared_options(name, module, config, asked)
        return _Component(name, module, spec, _shared_report(name, module), shared=True)
    native_ok = spec is not None and spec.native is not None and config.native
    distributed = parallel is not None and parallel.mesh is not None
    selector = AttentionSelector(config.attention)
    if native_ok:
        return _plan_swap(name, module, spec, config, selector, parallel if distributed else None)
    return _plan_generic(name, module, spec, config, selector, parallel if distributed else None)


def _plan_swap(
    name: str,
    module: nn.Module,
    spec: ModelSpec,
    config: AccelConfig,
    selector: AttentionSelector,
    parallel: ParallelState | None,
) -> _Component:
    """The Diffusers module stays; its repeated blocks will become native and, with ``parallel``, spread over
    the ranks (everything checked here, applied at commit)."""
    model = spec.native_model()
    patches.check_applicable("hook_chains")
    _check_attention(name, module, _native_sites(module, model), selector)
    graphs_on = config.cuda_graphs
    if graphs_on is None:  # auto: on wherever the steps run on CUDA
        graphs_on = torch.cuda.is_available() and (parallel is None or parallel.device.type == "cuda")
    if parallel is not None:
        _check_layout(module, model, parallel, graphs_on)
    # A model whose math leaves its elementwise steps to the compiler compiles on CUDA unless compile=False.
    compiled = config.compile_asked or (
        config.compile is None and model.compiled_by_default and torch.cuda.is_available()
    )
    options = None if not compiled else (dict(config.compile) if isinstance(config.compile, Mapping) else {})
    limitations = list(model.limitations)
    cache = _native_cache(model, config, limitations)
    fp8 = _fp8_weights(name, module) if config.quantize == "fp8" else None
    runtime = NativeRuntime(selector, options, cache, config.compile_in_background, fp8=fp8)
    detail = f"repeated blocks made native ({', '.join(model.blocks)}); the Diffusers module is kept"
    if fp8 is not None:
        detail += f"; {FP8_CLAIM}, the blocks' projections run as float8 e4m3 GEMMs"
    if options is not None:
        detail += "; repeated blocks compiled"
        if config.compile_in_background:
            detail += " (in the background on one device: eager steps until the code is ready)"
    elif config.compile_in_background:
        detail += (
            "; compile_in_background: nothing to compile here ("
            + _why_native_eager(compiled_by_default=model.compiled_by_default)
            + ")"
        )
    if graphs_on:
        detail += f"; {_graphs_note(torch.cuda.is_available())}"
    report = ComponentReport(
        name,
        type(module).__name__,
        "native",
        detail,
        selector,
        cache=cache,
        runtime=runtime,
        not_accelerated=limitations,
        falls_back_on=model.falls_back_on,
    )
    graphs = cuda_graphs.StepGraphs(module, hooks=runtime) if graphs_on else None
    report.graphs = graphs
    _report_layout(report, parallel, tp_tokens=model.parallel.sequence is not None)
    if parallel is not None:
        report.layout = f"{parallel.config} on {dist.get_world_size()} ranks"
    return _Component(name, module, spec, report, cache, runtime=runtime, parallel=parallel, graphs=graphs)


def _native_cache(
    model: NativeModel, config: AccelConfig, limitations: list[str]
) -> ExactProjectionCache | None:
    """The native blocks' projection cache (they consult it in their eager preparation, outside the compiled
    math: compiled or not), or None: no sites, a budget of 0, or a default budget on a model where it was
    measured not to pay (said in ``limitations``)."""
    if not model.projection_cache:
        return None
    if config.projection_cache_bytes is None and model.projection_cache_unpaid:
        limitations.append(
            f"exact projection cache: off by default ({model.projection_cache_unpaid}); "
            "projection_cache_bytes=<bytes> turns it on"
        )
        return None
    budget = config.projection_cache_budget
    return ExactProjectionCache(budget) if budget else None


def _fp8_weights(name: str, module: nn.Module) -> Fp8Weights:
    """The store of e4m3 weight copies for ``quantize="fp8"``, once the module's device is known to run FP8
    GEMMs (CUDA: compute capability 8.9 or higher, bf16 activations; the CPU computes them slowly, exactly as
    specified, which the tests use)."""
    param = next(module.parameters(), None)
    if param is not None and param.is_cuda:
        capability = torch.cuda.get_device_capability(param.device)
        if capability < (8, 9):
            raise ValueError(
                f"quantize='fp8': pipe.{name} is on a GPU of compute capability {capability[0]}.{capability[1]}, "
                "and FP8 GEMMs need 8.9 or higher (Ada, Hopper, Blackwell); run without quantize."
            )
        dtype = _compute_dtype(module)
        if dtype != torch.bfloat16:
            raise ValueError(
                f"quantize='fp8': pipe.{name} computes in {dtype}, and the FP8 GEMM with row scales writes "
                "bfloat16 only; load the model in torch.bfloat16 or run without quantize."
            )
    return Fp8Weights()


def _unless_compiled(
    cache: ExactProjectionCache | None, compiled: bool, limitations: list[str]
) -> ExactProjectionCache | None:
    """The cache, or None when the generic tier compiles the blocks its sites sit in: compiled code cannot
    consult it, so its per-step comparison would be pure overhead (and the report says so). Graph-replayed
    steps skip it; eager calls use it."""
    if compiled and cache is not None:
        limitations.append("exact projection cache: off, because compiled blocks cannot consult it")
        return None
    return cache


def _plan_generic(
    name: str,
    module: nn.Module,
    spec: ModelSpec | None,
    config: AccelConfig,
    selector: AttentionSelector,
    parallel: ParallelState | None,
) -> _Component:
    """A transformer with no native blocks (or ``native=False``): the Diffusers module stays, its attention
    routed through our providers where its module's call sites can be, its repeated blocks compiled and its
    steps replayed from CUDA graphs (``models.generic``; on CUDA unless ``compile`` / ``cuda_graphs`` say).
    With ``parallel``, its sequence split as the model's ``_cp_plan`` declares (``models.generic``)."""
    cls_name = type(module).__name__
    routes = spec.attention_routes if spec is not None else ()
    blocks = repeated_blocks(module)
    _check_generic(name, module, spec, config, parallel, blocks)
    fp8 = _fp8_weights(name, module) if config.quantize == "fp8" else None
    on_cuda = torch.cuda.is_available()
    compile_on = bool(blocks) and (on_cuda if config.compile is None else config.compile_asked)
    graphs_on = on_cuda if config.cuda_graphs is None else config.cuda_graphs
    if not (routes or compile_on or graphs_on or parallel is not None):
        report = ComponentReport(
            name,
            cls_name,
            "untouched",
            "no native implementation, no attention call site we can route, and no repeated blocks to compile",
            not_accelerated=[f"{cls_name} runs exactly as in Diffusers"],
        )
        return _Component(name, module, spec, report)
    if routes:
        _check_attention(name, module, _routed_sites(module, spec), selector)
    why = (
        "native acceleration disabled (native=False)"
        if spec is not None and spec.native
        else "no native blocks"
    )
    parts = [f"{why}; the Diffusers module kept"]
    if routes:
        parts.append("its attention routed through our providers")
    not_accelerated = [] if routes else ["attention: Diffusers' own (no call site of this module we route)"]
    options = None
    background = config.compile_in_background and parallel is None  # the ranks run the same code each step
    if compile_on:
        options = {} if not isinstance(config.compile, Mapping) else dict(config.compile)
    compiled, not_compiled = _generic_compile_notes(config, blocks, compile_on, background, parallel)
    parts += [compiled] if compiled else []
    not_accelerated += [not_compiled] if not_compiled else []
    if graphs_on:
        parts.append(_graphs_note(on_cuda))
    else:
        not_accelerated.append(
            "CUDA graphs: off" + (" (cuda_graphs=False)" if config.cuda_graphs is False else "")
        )
    not_accelerated.append(
        "projections, norms and MLPs: Diffusers' own" + (" (compiled)" if compile_on else "")
    )
    cache = None
    if spec is not None and spec.cache_sites and config.projection_cache_budget:
        cache = ExactProjectionCache(config.projection_cache_budget)
        cache = _unless_compiled(cache, compile_on, not_accelerated)
    elif spec is None or not spec.cache_sites:
        not_accelerated.append("exact projection cache: no sites are registered for this model")
    runtime = GenericRuntime(
        selector,
        options,
        background,
        devices=("cuda",) if config.compile is None else None,
        raise_failures=config.compile is not None,
    )
    runtime.fp8 = fp8
    if fp8 is not None:
        parts.append(
            f"{FP8_CLAIM}, the repeated blocks' linears run as float8 e4m3 GEMMs (calls of fewer than "
            f"{MIN_FP8_ROWS} rows, such as per-sample modulation, with the weight alone in e4m3)"
        )
    graphs = cuda_graphs.StepGraphs(module, hooks=runtime) if graphs_on else None
    tier = "generic" if compile_on or graphs_on or fp8 is not None else "routed"
    if parallel is not None:
        parts.append(_generic_layout_note(parallel.config))
    report = ComponentReport(
        name,
        cls_name,
        tier,
        "; ".join(parts),
        selector if routes else None,
        cache=cache,
        runtime=runtime if compile_on or fp8 is not None else None,
        graphs=graphs,
        not_accelerated=not_accelerated,
    )
    _report_layout(report, parallel)
    generic = runtime if compile_on or fp8 is not None else None
    return _Component(name, module, spec, report, cache, parallel=parallel, graphs=graphs, generic=generic)


def _graphs_note(on_cuda: bool) -> str:
    """What CUDA graphs of the steps do here, where they are on."""
    if on_cuda:
        return "steps replayed from CUDA graphs where they run on one CUDA device (counts below)"
    return (
        "cuda_graphs=True, but no step can run on CUDA here (this machine has no CUDA device): every step "
        "runs eagerly, none is captured"
    )


def _generic_layout_note(config: ParallelConfig) -> str:
    """How a layout spreads a model without native blocks: by the plans Diffusers declares for it."""
    note = f"{config} on {dist.get_world_size()} ranks"
    if config.sequence_parallel > 1:
        note += ", the sequence split as its _cp_plan declares"
    if config.cfg > 1:
        note += ", the guidance branches over the cfg ranks"
    if config.tp > 1:
        note += ", its linears split as its _tp_plan declares"
    return note


def _check_generic(
    name: str,
    module: nn.Module,
    spec: ModelSpec | None,
    config: AccelConfig,
    parallel: ParallelState | None,
    blocks: list,
) -> None:
    """Raises, before anything changes, where the generic tier cannot take ``module`` as configured: a
    patch its attention routes or layout need that this Diffusers does not allow, a layout its plans do not
    fit, ``quantize`` or ``compile=True`` for a model with no repeated blocks."""
    cls_name = type(module).__name__
    routes = spec.attention_routes if spec is not None else ()
    for patch_name in {name for name, _ in routes} | ({"attention_roles"} if routes else set()):
        patches.check_applicable(patch_name)
    if parallel is not None:
        check_parallel(module, generic_parallel_plan(module, parallel.config, routed=bool(routes)), parallel)
        if _generic_pairing(spec, parallel) is not None:
            patches.check_applicable("pair_cfg_calls")
        for patch in _layout_patches(parallel.config, graphs=False, splits_sequence=False):
            patches.check_applicable(patch.name)
    if config.quantize is not None and not blocks:
        raise ValueError(
            f"quantize={config.quantize!r} quantizes a transformer's repeated blocks, and pipe.{name} ({cls_name}) "
            "declares none (no `_repeated_blocks`, no ModuleList of blocks of one class); run it without quantize."
        )
    if config.compile_asked and not blocks:
        raise ValueError(
            f"compile=True compiles a transformer's repeated blocks, and pipe.{name} ({cls_name}) declares none "
            "(no `_repeated_blocks`, no ModuleList of blocks of one class); leave compile unset for it."
        )


def _generic_compile_notes(
    config: AccelConfig, blocks: list, compile_on: bool, background: bool, parallel: ParallelState | None
) -> tuple[str | None, str | None]:
    """What the report says of the repeated blocks' compilation: what was done, or why not."""
    if compile_on:
        listed = sorted({type(block).__name__ for _, block in blocks})
        when = (
            " in the background (eager blocks serve until the code is ready)"
            if background
            else " at the first call per input shape"
            + (" (every rank alike: never in the background under a layout)" if parallel else "")
        )
        on_cuda = ", on CUDA" if config.compile is None else ""
        return f"{len(blocks)} repeated blocks ({', '.join(listed)}) compiled{when}{on_cuda}", None
    if blocks:
        why = (
            "compile=False"
            if config.compile is False
            else "no CUDA device here; compile=True compiles on CPU"
        )
        idle = "; compile_in_background has nothing to compile" if config.compile_in_background else ""
        return None, f"repeated blocks: not compiled ({why}){idle}"
    return None, "repeated blocks: none declared, nothing to compile"


def _why_native_eager(compiled_by_default: bool) -> str:
    """Why native blocks run eager under ``compile=None``: the sentence ``describe`` gives."""
    if compiled_by_default:
        return "no CUDA device here; compile=True compiles on CPU"
    return "native blocks run eager, their fused kernels being the fast path; compile=True compiles them"


def _report_layout(report: ComponentReport, parallel: ParallelState | None, tp_tokens: bool = False) -> None:
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


def _native_sites(module: nn.Module, model) -> list[tuple[str, str, int]]:
    """(role, category, head size) of every attention site of the native blocks, once per role."""
    rows = {}
    for list_name, native_cls in model.blocks.items():
        for block in module.get_submodule(list_name):
            for site in native_cls.sites:
                rows.setdefault(site.role, (site.role, site.category, native_cls.head_dim(block)))
    return list(rows.values())


def _routed_sites(module: nn.Module, spec: ModelSpec) -> list[tuple[str, str, int | None]]:
    """(role, category, head size if the module says) of every routed attention module, once per role."""
    rows = {}
    for name, child in module.named_modules():
        if hasattr(child, "processor"):
            role, category = _role_of(spec, name, child)
            head_dim = getattr(child, "head_dim", None)
            if head_dim is None and hasattr(child, "inner_dim") and getattr(child, "heads", 0):
                head_dim = child.inner_dim // child.heads
            rows.setdefault(role, (role, category, head_dim))
    return list(rows.values())


def _check_attention(name: str, module: nn.Module, sites, selector: AttentionSelector) -> None:
    """Every ``per_role`` key names a role or category of this model, and every explicit choice can serve
    the model's compute dtype, device and head size: both fail at accelerate, not at the first call (the
    second waits for the first call where the dtype or device is not known before it)."""
    # The generic categories are valid everywhere: one config may serve pipelines with and without them.
    known = {role for role, _, _ in sites} | {category for _, category, _ in sites} | {"self", "cross"}
    unknown = sorted(set(selector.config.per_role) - known)
    if unknown:
        raise ValueError(
            f"AttentionConfig.per_role names {unknown}, which pipe.{name} ({type(module).__name__}) does not "
            f"have; its roles are {sorted({r for r, _, _ in sites})} and categories "
            f"{sorted({c for _, c, _ in sites})}."
        )
    placement = _placement(module)
    _resolve_rows([site for site in sites if site[2] is not None], placement, selector, strict=True)
    if placement.unknown is not None:
        logger.info("pipe.%s: attention providers are checked at the first call: %s", name, placement.unknown)


@dataclass(frozen=True)
class _Placement:
    """The dtype and device a transformer computes its attention in, found as Diffusers finds them; None
    where they cannot be known before the first call (``unknown`` says why)."""

    dtype: torch.dtype | None
    device: torch.device | None
    unknown: str | None = None


_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _placement(module: nn.Module) -> _Placement:
    """Not the first parameter's dtype and device: under layerwise casting, GGUF or other quantization the
    weights are stored in another dtype than the one the model computes in, and under offload (sequential,
    group, ``device_map``) they sit on the CPU or on ``meta`` while the model runs on its execution device."""
    dtype = _compute_dtype(module)
    device = _execution_device(module)
    reasons = []
    if dtype is None:
        stored = str(get_parameter_dtype(module)).removeprefix("torch.")
        reasons.append(
            f"its weights are stored in {stored} and neither layerwise casting nor a quantization config says "
            "which dtype it computes in"
        )
    if device is None:
        reasons.append(
            "its weights are on the meta device and no offload hook names the device it runs on (not an "
            "attention matter: load the weights, e.g. load_state_dict(..., assign=True), or enable an offload "
            "before the first call)"
        )
    return _Placement(dtype, device, "; ".join(reasons) or None)


def _compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The quantizer's compute dtype (GGUF and the like dequantize to it), else Diffusers' ``model.dtype``:
    layerwise casting's compute dtype, else the first floating-point weight's outside the fp32-kept modules."""
    quantizer = getattr(module, "hf_quantizer", None)
    dtype = getattr(quantizer, "compute_dtype", None) or get_parameter_dtype(module)
    return dtype if dtype in _COMPUTE_DTYPES else None


def _execution_device(module: nn.Module) -> torch.device | None:
    """Where ``module`` runs, as a Diffusers pipeline's ``_execution_device`` finds it: a group-offload hook's
    onload device, an accelerate hook's execution device (model or sequential CPU offload, ``device_map``),
    else where its weights are; None when they are all on ``meta`` with nothing to load them."""
    for submodule in module.modules():
        registry = submodule.__dict__.get("_diffusers_hook")
        group = registry.get_hook("group_offloading") if registry is not None else None
        if group is not None:
            return torch.device(group.group.onload_device)
        hook = submodule.__dict__.get("_hf_hook")
        for part in getattr(hook, "hooks", (hook,)) if hook is not None else ():
            device = getattr(part, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return None


def _resolve_rows(
    sites, placement: _Placement, selector: AttentionSelector, strict: bool
) -> list[tuple[str, str, str, str]]:
    """(role, request, provider, reason) per site; an error row (or, ``strict``, the error) where a choice
    cannot serve, and a deferred row where the placement is not known before the first call."""
    if placement.unknown is not None:
        return [(role, "known at the first call", "deferred", placement.unknown) for role, _, _ in sites]
    device = placement.device
    on_gpu = device.type == "cuda" and torch.cuda.is_available()  # a hook may name CUDA before it exists here
    capability = torch.cuda.get_device_capability(device) if on_gpu else None
    rows = []
    for role, category, head_dim in sites:
        request = AttentionRequest(placement.dtype, device.type, head_dim, compute_capability=capability)
        try:
            found = resolve(selector.config, role, category, request)
            rows.append((role, request.describe(), found.name, found.reason))
        except AttentionProviderError as exc:
            if strict:
                raise
            rows.append((role, request.describe(), "error", str(exc)))
    return rows


@dataclass(frozen=True)
class _Step:
    """One step of committing a planned component, in the order of its table: it runs where
    ``applies(component)``, and ``apply`` adds the undo of everything it changes to ``component.undo``
    (a refused ``accelerate`` runs those undos, newest first)."""

    name: str
    applies: Callable[[_Component], bool]
    apply: Callable[[_Component], None]


def _always(component: _Component) -> bool:
    return True


def _swap_native_blocks(component: _Component) -> None:
    model = component.spec.native_model()
    component.undo.append(swap_blocks(component.original, model, component.runtime).undo)


def _add_scope(component: _Component, enter: Callable[[], Any], leave: Callable[[Any], None]) -> None:
    """Runs the module's calls in a scope (``forward_hooks.add_scope``), the class patch that enters it held
    once per component."""
    _scope_calls(component.original, enter, leave, component.undo)


def _scope_calls(
    module: nn.Module, enter: Callable[[], Any], leave: Callable[[Any], None], undo: list[Callable[[], None]]
) -> None:
    """Runs ``module``'s calls in a scope; its undo, and the class patch that enters it (held once per
    module), join ``undo``."""
    if scoped_calls.SCOPES not in vars(module):
        undo.append(_HeldPatch("scoped_calls", type(module)))
    undo.append(add_scope(module, enter, leave))


def _bind_forward_runtime(component: _Component) -> None:
    """The blocks' attention reads its selector and layout from the forward in flight."""
    enter = functools.partial(enter_forward, component.runtime)
    _add_scope(component, enter, leave_forward)


def _scope_native_forwards(module: nn.Module, runtime: NativeRuntime, undo: list[Callable[[], None]]) -> None:
    """``module``'s calls are forwards of ``runtime``'s native blocks: the runtime bound to them, each marked
    as a new forward (``_mark_forwards``)."""
    _scope_calls(module, functools.partial(enter_forward, runtime), leave_forward, undo)
    _scope_calls(
        module, functools.partial(_forward_begins, runtime.cache, runtime.fp8), _nothing_to_leave, undo
    )


def _holders(
    pipe: Pipeline, transformers: list[nn.Module]
) -> list[tuple[str, nn.Module, NativeRuntime, int]]:
    """The pipeline's other components that hold native blocks of an accelerated transformer (Diffusers
    shares some of a transformer's blocks with a module built on it, which calls them from its own forward):
    (name, module, the blocks' runtime, how many it holds), for a module whose native blocks all share one
    runtime."""
    found, seen = [], [*transformers]
    for name, module in pipe.components.items():
        if not isinstance(module, nn.Module) or any(module is other for other in seen):
            continue
        seen.append(module)
        runtimes = [m.omni_runtime for m in module.modules() if isinstance(m, NativeBlock)]
        if runtimes and all(runtime is runtimes[0] for runtime in runtimes):
            found.append((name, module, runtimes[0], len(runtimes)))
    return found


def _binds(module: nn.Module, runtime: NativeRuntime) -> bool:
    """Whether ``module``'s calls run in ``runtime``'s forward scope (``_scope_native_forwards``)."""
    return any(
        isinstance(scope.enter, functools.partial)
        and scope.enter.func is enter_forward
        and scope.enter.args[0] is runtime
        for scope in vars(module).get(scoped_calls.SCOPES, ())
    )


def _scope_holders(pipe: Pipeline, components: list[_Component]) -> None:
    """A component that holds native blocks of an accelerated transformer (``_holders``) gets that
    transformer's forward scopes: the blocks run natively in its calls as in the transformer's (else they
    would run Diffusers' forward there, called outside their transformer's forward). Undone with the
    component whose module runs that runtime (its owner, or the pipeline sharing it: from_pipe)."""
    for _, module, runtime, _ in _holders(pipe, [c.original for c in components]):
        component = next((c for c in components if _setup_of(c.original) is runtime), None)
        if component is not None and not _binds(module, runtime):
            _scope_native_forwards(module, runtime, component.undo)


def _mark_forwards(component: _Component) -> None:
    """What is kept for one forward starts afresh at each: an inference tensor's memos
    (``utils.versions``), the conditioning tensors the projection cache compared, native blocks' FP8
    copies of weights written or moved since the last forward (the generic tier's linears bring theirs up
    to date in a hook of their own). The hook holds the stores themselves: a deep copy of the model then
    gets a hook on its own copies."""
    runtime = component.runtime
    fp8 = runtime.fp8 if isinstance(runtime, NativeRuntime) else None
    begin = functools.partial(_forward_begins, component.cache, fp8)
    _add_scope(component, begin, _nothing_to_leave)


def _forward_begins(cache: ExactProjectionCache | None, fp8: Fp8Weights | None) -> None:
    versions.new_forward()
    if cache is not None:
        cache.begin_forward()
    if fp8 is not None:
        fp8.refresh()


def _nothing_to_leave(_token: None) -> None:
    return None


def _wrap_cache_sites(component: _Component) -> None:
    """Model-level modules whose outputs repeat from call to call go through the projection cache."""
    spec = component.spec
    sites = spec.native_model().conditioning_sites if component.runtime is not None else spec.cache_sites
    component.undo += wrap_sites(component.original, sites, component.cache)


def _install_step_graphs(component: _Component) -> None:
    component.graphs.install()
    component.undo.append(component.graphs.uninstall)
    component.stores.append(component.graphs)


def _install_block_graphs(component: _Component) -> None:
    """Per-block graphs for steps a hook keeps from one graph (on one device: under a layout every rank
    would have to capture alike)."""
    blocks = native_blocks(component.original, component.spec.native_model())
    block_graphs = cuda_graphs.install_block_graphs(blocks, component.runtime)
    component.undo += [graphs.uninstall for graphs in block_graphs]
    component.report.block_graphs = block_graphs
    component.stores += block_graphs


def _adapt_model(component: _Component) -> None:
    """Where the model's own code is replaced for the generic tier (``models/``), and how."""
    adaptation = generic_adaptation(component.original)
    if adaptation is not None:
        note, undo = adaptation(component.original)
        component.undo += undo
        component.report.adapted.append(note)


def _install_compiled_regions(component: _Component) -> None:
    component.undo += install_regions(component.original, component.generic)


def _install_fp8(component: _Component) -> None:
    blocks = repeated_blocks(component.original)
    copies, undo = install_fp8_linears(component.original, blocks, component.generic.fp8)
    component.undo += undo
    component.stores += [copies] if copies is not None else []


def _drop_at_moves(component: _Component) -> None:
    """What the component's stores made of its weights is let go of when the module moves
    (``omni_accel.moves``)."""
    runtime = component.runtime or component.generic  # its compiler's queued calls
    fp8 = component.runtime.fp8 if component.runtime is not None else None  # native blocks' copies
    stores = [store for store in (component.cache, fp8, runtime) if store is not None] + component.stores
    if stores:
        after = AfterMoves(component.original, stores)
        after.install()
        component.undo.append(after.uninstall)


_NATIVE_STEPS = (
    _Step("native blocks", _always, _swap_native_blocks),
    _Step("runtime bound to each forward", _always, _bind_forward_runtime),
    _Step("forwards marked", _always, _mark_forwards),
    _Step("projection cache sites", lambda c: c.cache is not None, _wrap_cache_sites),
    _Step("step graphs", lambda c: c.graphs is not None, _install_step_graphs),
    _Step("block graphs", lambda c: c.graphs is not None and c.parallel is None, _install_block_graphs),
    _Step("stores let go at moves", _always, _drop_at_moves),
)


def _keep_generic_setup(component: _Component) -> None:
    """The module keeps what set it up (``_GenericSetup``), read by another pipeline that holds it."""
    report = component.report
    setup = _GenericSetup(report.mode, report.detail, report.selector, component.cache, component.generic)
    object.__setattr__(component.original, _GENERIC_SETUP, setup)
    component.undo.append(functools.partial(_drop_generic_setup, component.original, setup))


def _drop_generic_setup(module: nn.Module, setup: _GenericSetup) -> None:
    if module.__dict__.get(_GENERIC_SETUP) is setup:
        object.__delattr__(module, _GENERIC_SETUP)


_GENERIC_STEPS = (
    _Step("setup kept on the module", lambda c: c.report.mode != "untouched", _keep_generic_setup),
    _Step("attention routed", _always, lambda c: _route_attention(c)),
    _Step("forwards marked", _always, _mark_forwards),
    _Step("model adaptation", _always, _adapt_model),
    _Step("projection cache sites", lambda c: c.cache is not None, _wrap_cache_sites),
    _Step(
        "compiled regions",
        lambda c: c.generic is not None and c.generic.compiler is not None,
        _install_compiled_regions,
    ),
    _Step("fp8 linears", lambda c: c.generic is not None and c.generic.fp8 is not None, _install_fp8),
    _Step("step graphs", lambda c: c.graphs is not None, _install_step_graphs),
    _Step("stores let go at moves", _always, _drop_at_moves),
)


def _commit(component: _Component) -> None:
    """Runs the component's steps in order (a module another pipeline accelerated is that one's)."""
    if component.shared:
        return
    for step in _NATIVE_STEPS if component.runtime is not None else _GENERIC_STEPS:
        if step.applies(component):
            step.apply(component)


def _route_attention(component: _Component) -> None:
    if not component.spec or not component.spec.attention_routes:
        return
    selector = component.report.selector
    module = component.original
    _add_scope(component, functools.partial(routing.enter_selector, selector), routing.leave_selector)
    route_classes = set()
    for name, child in module.named_modules():
        if hasattr(child, "processor"):
            if attention_roles.ROUTE in vars(
                child
            ):  # another pipeline sharing the module (from_pipe) routes it
                continue
            role, category = _role_of(component.spec, name, child)
            # Strings: Dynamo guards on their value, so blocks of one role share compiled code (see patches/).
            route = (role, category)
            object.__setattr__(child, attention_roles.ROUTE, route)
            # A partial, not a closure: a deep copy of the pipeline unroutes its own copy of the module.
            component.undo.append(functools.partial(_unroute, child, route))
            route_classes.add(f"{type(child).__module__}:{type(child).__qualname__}")
    for target in sorted(route_classes):  # one at a time: a failed apply leaves the earlier ones undoable
        component.undo.append(_HeldPatch("attention_roles", target))
    for name, target in component.spec.attention_routes:
        component.undo.append(_HeldPatch(name, target))


class _HeldPatch:
    """One component's reference to a patch, applied when made; calling it reverts that reference. A deep
    or unpickled copy of it is pending until the copy of the pipeline holding it takes it up
    (``_hold_copied_patches``; in a new process too), so that restoring one copy leaves the patch in place
    for the other, while a copy of a module alone (an EMA copy of the transformer), which no pipeline
    restores, holds none."""

    def __init__(self, name: str, target: str | type, pending: bool = False) -> None:
        self.name, self.target, self.held = name, target, False
        if not pending:
            self.hold()

    def hold(self) -> None:
        if not self.held:
            patches.apply(self.name, self.target)
            self.held = True

    def __call__(self) -> None:
        if self.held:
            patches.revert(self.name, self.target)
            self.held = False

    def __reduce__(self):
        return _HeldPatch, (self.name, self.target, True)


def _hold_copied_patches(undo: list[Callable[[], None]]) -> None:
    """Takes up the patch references a copied pipeline's undo steps hold (see ``_HeldPatch``)."""
    for step in undo:
        if isinstance(step, _HeldPatch):
            step.hold()


def _unroute(module: nn.Module, route: tuple[str, str, str]) -> None:
    if vars(module).get(attention_roles.ROUTE) == route:
        object.__delattr__(module, attention_roles.ROUTE)


def _role_of(spec: ModelSpec, module_name: str, module: nn.Module) -> tuple[str, str]:
    for pattern, role in spec.attention_roles.items():
        if re.fullmatch(pattern, module_name):
            return role
    category = "cross" if getattr(module, "is_cross_attention", False) is True else "self"
    return f"{spec.family}.{module_name.rpartition('.')[2]}", category


# Parallel layouts: chosen (parallel="auto" waits for the first pipeline call), checked before anything
# changes, then applied: the transformers, CFG call pairing, the VAE, each rank's device.

_AT_FIRST_CALL = object()  # parallel="auto": the layout waits for the first call's arguments


def _parallel_config(
    pipe: Pipeline, names: list[str], config: AccelConfig
) -> tuple[ParallelConfig | object | None, str | None]:
    """The layout to apply now, or ``_AT_FIRST_CALL`` when ``parallel="auto"`` waits for the first pipeline
    call's arguments (whether it runs both guidance branches); and a note for the report."""
    if config.parallel != "auto":
        return config.parallel, None
    world = _world_size()
    natives = [n for n in names if (spec := spec_for(getattr(pipe, n))) is not None and spec.native]
    if world == 1:
        return None, "one rank: nothing to spread"
    if not natives or not config.native:
        raise ValueError(
            f"parallel='auto' over {world} ranks needs a native transformer, and {type(pipe).__name__} has "
            f"none; natives exist for {', '.join(registered_natives())}. Run it on one rank."
        )
    return _AT_FIRST_CALL, "decided at the first pipeline call"


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _apply_auto_layout_at_call(arguments: dict[str, Any]) -> None:
    """The first-call action: the pipeline called (``self``), not the one ``accelerate`` was given, which a
    deep copy made before the call is not."""
    _apply_auto_layout(arguments["self"], arguments)


def _apply_auto_layout(pipe: DiffusionPipeline, arguments: dict[str, Any]) -> None:
    """``parallel="auto"`` at the first pipeline call: the layout for these arguments, checked on every
    native component, then spread as ``accelerate`` spreads a layout it was given."""
    state = _state(pipe)
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
            _check_layout(
                component.original, component.spec.native_model(), parallel, component.graphs is not None
            )
        vae_coders, others = _plan_vae(pipe, state.config, distributed=True)
        for component in natives:
            component.parallel = parallel
        state.undo += [parallel.close, *_spread(pipe, natives, vae_coders, parallel)]
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


def _check_layout(module: nn.Module, model, parallel: ParallelState, graphs: bool) -> None:
    """Raises, before anything changes, when ``parallel``'s layout cannot apply to ``module`` (with CUDA
    graphs of its steps when ``graphs``)."""
    check_parallel(module, model.parallel, parallel)
    for patch in _layout_patches(parallel.config, graphs, splits_sequence=False):
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


def _layout_patches(config: ParallelConfig, graphs: bool, splits_sequence: bool) -> list[_Patch]:
    """The patches a layout needs: step graphs holding collectives released before the group is destroyed;
    under tp, LoRA loaded later (full shapes checked, this rank's slice of each delta merged); under a token
    split, Diffusers' first-block cache deciding over every rank's tokens."""
    needed = [_Patch("release_graphs_at_destroy", "torch.distributed")] if graphs else []
    if config.tp > 1:
        needed += [_Patch(*patch) for patch in _tp_lora_patches()]
    if splits_sequence:
        needed.append(_Patch(*_CACHE_OVER_RANKS, required=False))
    return needed


def _apply_layout_patches(component: _Component, layout: Parallelized) -> None:
    """``_layout_patches`` of ``component``'s layout, applied; their reverts join its undo."""
    needed = _layout_patches(
        component.parallel.config, component.graphs is not None, layout.sequence is not None
    )
    for patch in needed:
        if patch.required or patches.applicable(patch.name):
            component.undo.append(_HeldPatch(patch.name, patch.target))


def _parallelize_generic(component: _Component) -> None:
    """Spreads a component without native blocks over ``component.parallel``'s ranks, by its own plan."""
    module, parallel = component.original, component.parallel
    plan = generic_parallel_plan(module, parallel.config, routed=True)
    pairs = _generic_pairing(component.spec, parallel) is not None
    layout = parallelize(module, plan, parallel, output_class(component.spec), pairs_guidance=pairs)
    component.report.cfg = layout.cfg
    component.undo.append(layout.revert)
    _agree_on_cache_hits(component)
    if layout.sequence is not None:  # read by traces of calls our providers cannot split
        component.undo.append(LiveSplit())
    if parallel.config.tp > 1:  # Diffusers' forward of a row-split linear: its partial sums reduced
        component.undo.append(sum_row_splits(module))
    _apply_layout_patches(component, layout)


def _parallelize(component: _Component) -> None:
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


def _agree_on_cache_hits(component: _Component) -> None:
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


def _generic_pairing(spec: ModelSpec | None, parallel: ParallelState) -> Callable | None:
    """The rule by which a model without native blocks pairs its cond/uncond calls: only over cfg=2's ranks
    (stacking them in one batch would need to know which arguments carry the batch; ``batch_dim_arguments``
    guesses that well enough to halve a batch, not to stack two calls whose other arguments may differ)."""
    if spec is None or parallel.config.cfg == 1:
        return None
    native = spec.native_model()  # native=False: how the pipeline calls the model is the same
    return spec.cfg_pairing or (native.cfg_pairing if native is not None else None)


def _pair_cfg_calls(pipe: DiffusionPipeline, components: list[_Component]) -> list[Callable[[], None]]:
    """Pipelines that call their transformers twice per step get those calls paired: over cfg=2's ranks,
    or stacked in one call (``ParallelConfig.batch_guidance``)."""
    paired = []
    for component in components:
        if component.report.cfg is None or component.parallel is None:
            continue
        if component.runtime is not None:
            rule = component.spec.native_model().cfg_pairing
        else:
            rule = _generic_pairing(component.spec, component.parallel)
        if rule is not None:
            paired.append((rule, component.report.cfg))
    if not paired:
        return []
    pair_cfg_calls.apply(pipe, paired[0][0], [cfg for _, cfg in paired])
    return [functools.partial(pair_cfg_calls.revert, pipe)]  # a deep copy's undo reverts the copy


# The VAE coders a pipeline's layout split (``_split_vae``): a copy of a from_pipe sibling's VAE, split as
# the one it copied and by no pipeline, is the copy's to undo (``_adopt_orphans``), as its transformer is.
_SPLIT_CODERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _split_vae(pipe: DiffusionPipeline, vae_coders: list[nn.Module]) -> list[Callable[[], None]]:
    undo = []
    for coder in vae_coders:
        row_split = vae_split.RowSplit(coder, dist.group.WORLD)
        row_split.install()
        _SPLIT_CODERS.add(coder)
        undo.append(functools.partial(_unsplit, coder, row_split))
    return undo


def _unsplit(coder: nn.Module, row_split: vae_split.RowSplit) -> None:
    row_split.uninstall()
    _SPLIT_CODERS.discard(coder)


def _spread(
    pipe: DiffusionPipeline,
    components: list[_Component],
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
        undo += _split_vae(pipe, vae_coders)
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


def _split_detail(split: list[str]) -> str:
    """What the VAE report says of the coders ``split`` by rows."""
    return (
        f"{' and '.join(split)} split over {dist.get_world_size()} ranks by rows (halo rows exchanged, GroupNorm "
        "statistics reduced, the attention gathered); equal to one rank's up to float32 summation order"
    )


def _plan_vae(
    pipe: DiffusionPipeline, config: AccelConfig, distributed: bool
) -> tuple[list[nn.Module], list[ComponentReport]]:
    """Under a parallel layout (``distributed``): which of the VAE's encoder and decoder split over the ranks by
    rows (checked before anything is swapped); and the report line, also of a VAE another pipeline split."""
    vae = getattr(pipe, "vae", None)
    coders = {name: getattr(vae, name, None) for name in ("decoder", "encoder")}
    coders = {name: coder for name, coder in coders.items() if isinstance(coder, nn.Module)}
    shared = {
        name: coder for name, coder in coders.items() if installed(coder, vae_split.RowSplit) is not None
    }
    if shared:  # split by another pipeline holding this VAE (from_pipe): a second split would run whole
        if config.vae_parallel is False:
            raise ValueError(
                f"vae_parallel=False cannot keep pipe.vae ({type(vae).__name__}) whole: it is shared with another "
                f"pipeline (from_pipe) whose layout splits its {' and '.join(shared)} by rows. Accelerate without "
                "vae_parallel to share that split, or omni_accel.restore() the other pipeline first."
            )
        detail = (
            f"{' and '.join(shared)} split by rows by another pipeline that shares this VAE (from_pipe), as that "
            "one set it up; restore that pipeline to undo"
        )
        report = ComponentReport("vae", type(vae).__name__, _shared("patch-parallel"), detail)
        report.row_split = shared
        return [], [report]
    if not distributed:
        if config.vae_parallel and config.parallel != "auto" and vae is not None:
            why = "vae_parallel=True splits the VAE over a parallel layout's ranks, and none runs here: it runs whole"
            return [], [ComponentReport("vae", type(vae).__name__, "untouched", why)]
        return [], []
    if config.vae_parallel is False or not coders:
        return [], []
    reasons = {name: vae_split.supports(coder) for name, coder in coders.items()}
    if reasons.get("decoder") is not None:
        if config.vae_parallel:
            raise ValueError(
                f"vae_parallel=True cannot split pipe.vae ({type(vae).__name__})'s decoder: {reasons['decoder']}. "
                "Leave vae_parallel unset (the VAE then runs whole on every rank)."
            )
        why = f"runs whole on every rank: {reasons['decoder']}"
        return [], [ComponentReport("vae", type(vae).__name__, "untouched", why)]
    split = [name for name, reason in reasons.items() if reason is None]
    report = ComponentReport("vae", type(vae).__name__, "patch-parallel", _split_detail(split))
    report.row_split = {name: coders[name] for name in split}  # describe reads their splits' counts
    return list(report.row_split.values()), [report]
