"""``accelerate``, ``restore`` and ``describe``: the orchestration of the phases (see the package docstring),
and what follows a modular pipeline's registrations.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping
from typing import Any

from diffusers import ModularPipeline
from torch import nn

from .. import pipeline_calls
from ..attention.selection import AttentionConfig
from ..config import DEFAULT_COMPONENTS, AccelConfig
from ..models.base import NativeRuntime
from ..parallel.config import ParallelConfig
from ..parallel.mesh import ParallelState, init_parallel
from ..report import AccelerationReport, ComponentReport, step_cache_note
from ..utils import triton_builds
from ..utils.logging import get_logger
from .commit import commit_component, scope_holders
from .placement import check_roles, native_sites, placement_of, resolve_rows
from .plan import plan_component
from .reports import (
    borrowed_state,
    compiled_in_diffusers,
    current_report,
    current_vae_report,
    holder_lines,
    log_summary,
    replaced_report,
    set_up_elsewhere,
    users_compile,
)
from .spread import (
    AT_FIRST_CALL,
    apply_auto_layout_at_call,
    auto_components,
    native_auto,
    parallel_config,
    spread_layout,
)
from .state import (
    SET_UP_WITH,
    STATE_ATTR,
    Component,
    Pipeline,
    State,
    adopt_orphans,
    forget_setup,
    held_twice,
    is_denoiser,
    keep_owner,
    orphan_owner,
    setup_of,
    state_of,
    uncompiled,
)
from .vae import plan_vae

logger = get_logger(__name__)


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
    _check_pipeline(pipe, "accelerate", "its transformer is accelerated in place")
    state = getattr(pipe, STATE_ATTR, None)
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
    # blocks got (``scope_holders``), bound to a transformer that its owner has since restored.
    if state is not None:
        for component in state.components:
            _undo_component(component)
    config = (config or AccelConfig()).with_overrides(**overrides)
    asked = _asked(config, overrides)

    names = denoiser_names(pipe, config)
    if not names:
        detail = (
            f"{type(pipe).__name__} has no transformer component; nothing was accelerated and the pipeline "
            "runs exactly as in Diffusers"
        )
        others = sorted(name for name, module in pipe.components.items() if is_denoiser(module))
        if others:  # a UNet: not taken by default (no native blocks), taken when named
            detail += f"; components={tuple(others)!r} accelerates its denoiser"
        note = ComponentReport(", ".join(config.components), "-", "absent", detail)
        setattr(pipe, STATE_ATTR, State(config, [], [], absent=[note]))
        logger.warning("%s: %s", type(pipe).__name__, note.detail)
        return pipe
    layout, auto_reason = parallel_config(pipe, names, config)
    if layout is not None and isinstance(pipe, ModularPipeline):
        raise ValueError(
            f"parallel={config.parallel!r} spreads the standard pipelines' calls over the ranks, and "
            f"{type(pipe).__name__} is a modular pipeline (its calls are blocks); run it on one device "
            "(without `parallel`), or use the standard pipeline of the model."
        )
    deferred = layout is AT_FIRST_CALL
    parallel = init_parallel(layout) if layout is not None and not deferred else None
    try:
        components, others, undo = _plan_and_commit(
            pipe, names, config, parallel, auto_reason, asked, spread_later=deferred
        )
    except BaseException:
        if parallel is not None:
            parallel.close()  # a refused layout leaves no process groups behind either
        raise
    if deferred:
        undo.append(pipeline_calls.on_first_call(pipe, apply_auto_layout_at_call))
    if isinstance(pipe, ModularPipeline):
        undo.append(_follow_registrations(pipe))
    state = State(config, components, undo, others=others, vae=getattr(pipe, "vae", None))
    adopt_orphans(state)
    setattr(pipe, STATE_ATTR, state)
    triton_builds.set_up_in_background()  # while the first call encodes its prompt
    log_summary(pipe, components)
    return pipe


def _check_pipeline(pipe: object, function: str, then: str) -> None:
    """``accelerate``, ``restore`` and ``describe`` take the pipeline, not a module of it (or anything else):
    a TypeError that says so, rather than an AttributeError from deep inside."""
    if not isinstance(pipe, Pipeline):
        raise TypeError(
            f"{function}() takes a Diffusers pipeline, got {type(pipe).__name__} (pass a DiffusionPipeline or a "
            f"ModularPipeline; {then})."
        )


def _plan_and_commit(
    pipe: Pipeline,
    names: list[str],
    config: AccelConfig,
    parallel: ParallelState | None,
    auto_reason: str | None,
    asked: frozenset[str],
    spread_later: bool = False,
) -> tuple[list[Component], list[ComponentReport], list[Callable[[], None]]]:
    """``accelerate``'s plan and commit under ``parallel`` (None: one device, or a layout chosen at the first
    call, ``spread_later``): the components, the other reports (the VAE's split) and the pipeline-level
    undos (the mesh's groups destroyed last)."""
    generic_later = spread_later and not native_auto([getattr(pipe, name) for name in names], config)
    components: list[Component] = []
    for name in names:
        module = getattr(pipe, name)
        first = next((c for c in components if c.original is module), None)
        components.append(
            plan_component(name, module, config, parallel, asked, spread_later=generic_later)
            if first is None
            else held_twice(name, first)
        )
    selectors = [c.report.selector for c in components if c.report.selector is not None]
    check_roles(pipe, config.attention, selectors)
    distributed = parallel is not None and parallel.mesh is not None
    vae_coders, others = plan_vae(pipe, config, distributed)
    if auto_reason is not None:
        for component in auto_components(config, components):
            component.report.layout = f"parallel='auto': {auto_reason}"
    undo = _commit_all(pipe, components, vae_coders, parallel if distributed else None)
    for component in components:
        if not component.shared:  # what a pipeline sharing the module (from_pipe) is compared with
            SET_UP_WITH[component.original] = config
            component.undo.insert(0, functools.partial(forget_setup, component.original, config))
            if setup_of(component.original) is not None:
                keep_owner(component, config)
    if distributed:
        undo.insert(0, parallel.close)  # restore runs it last, once the components are undone
    return components, others, undo


def _asked(config: AccelConfig, overrides: Mapping[str, Any]) -> frozenset[str]:
    """The options the caller set: given as keywords, or in ``config`` at other than their defaults."""
    default = AccelConfig()
    differ = {
        f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)
    }
    return frozenset(overrides) | differ


def _commit_all(
    pipe: Pipeline,
    components: list[Component],
    vae_coders: list[nn.Module],
    parallel: ParallelState | None,
) -> list[Callable[[], None]]:
    """Commits every planned component, then under a layout spreads the pipeline over the ranks; an error
    on the way undoes what was done, so that a refused ``accelerate`` leaves the pipeline as Diffusers made
    it. Returns the pipeline-level undos."""
    try:
        for component in components:
            commit_component(component)
        scope_holders(pipe, components)
        return spread_layout(pipe, components, vae_coders, parallel) if parallel is not None else []
    except BaseException:
        for component in reversed(components):
            for undo in reversed(component.undo):
                undo()
            component.undo.clear()
        raise


def denoiser_names(pipe: Pipeline, config: AccelConfig) -> list[str]:
    """The components to accelerate. The default names skip an absent one (a pipeline with one
    transformer); a name given explicitly must be a denoiser of this pipeline."""
    present = [name for name in config.components if isinstance(getattr(pipe, name, None), nn.Module)]
    if config.components == DEFAULT_COMPONENTS:
        return present
    denoisers = sorted(name for name, module in pipe.components.items() if is_denoiser(module))
    missing = [name for name in config.components if name not in present]
    if missing:
        raise ValueError(
            f"components names {missing}, which {type(pipe).__name__} does not hold (absent or None); its "
            f"denoisers are {denoisers}. Name only those (the default {list(DEFAULT_COMPONENTS)} skips absent ones)."
        )
    wrong = [name for name in present if not is_denoiser(getattr(pipe, name))]
    if wrong:
        listed = ", ".join(f"pipe.{name} ({type(getattr(pipe, name)).__name__})" for name in wrong)
        raise ValueError(
            f"components names {listed}, not a denoiser: accelerate speeds up a pipeline's Diffusers "
            f"transformers and UNets, and this pipeline's are {denoisers}."
        )
    return present


def _holds_nothing(state: State) -> bool:
    """Whether an accelerated state holds nothing any more (it found no transformer, or only shared ones
    that their owner has since restored), so that ``accelerate`` may start again (its own following of a
    modular pipeline's registrations, which the new state replaces, holds nothing)."""
    following = [
        u for u in state.undo if isinstance(u, functools.partial) and u.func is _unfollow_registrations
    ]
    return len(following) == len(state.undo) and all(
        c.shared and setup_of(c.original) is None for c in state.components
    )


def in_sync(pipe: Pipeline) -> bool:
    """Whether the accelerated state still describes ``pipe``: each component accelerate saw is still the
    pipeline's, and no denoiser was added since (a modular pipeline loads its components later)."""
    state = state_of(pipe)
    seen = {component.name: component.original for component in state.components}
    names = [name for name in state.config.components if isinstance(getattr(pipe, name, None), nn.Module)]
    return set(names) == set(seen) and all(getattr(pipe, name) is module for name, module in seen.items())


def _undo_component(component: Component) -> None:
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
    state = getattr(pipe, STATE_ATTR, None)
    if state is not None:
        _release_dropped(pipe, state)


def _release_dropped(pipe: ModularPipeline, state: State) -> None:
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
    _check_pipeline(pipe, "restore", "the pipeline omni_accel.accelerate() was given gets its modules back")
    if getattr(pipe, STATE_ATTR, None) is None and (shared := set_up_elsewhere(pipe)):
        # Restoring a module another pipeline set up would undo that pipeline too (one module, one setup).
        name, module = shared[0]
        where = (
            "a copy of a module another pipeline accelerated (a deep or unpickled copy), which no pipeline owns; "
            "omni_accel.accelerate(pipe) takes it over, after which omni_accel.restore(pipe) gives it back its "
            "Diffusers modules"
            if orphan_owner(module) is not None
            else "shared with another pipeline (from_pipe) that accelerated it, and restoring it here would "
            "undo that pipeline too; omni_accel.restore() that pipeline (this one then runs as plain Diffusers "
            "as well)"
        )
        raise ValueError(
            f"This pipeline was not accelerated itself: pipe.{name} ({type(module).__name__}) is {where}."
        )
    state = state_of(pipe)
    for component in state.components:
        _undo_component(component)
    for undo in reversed(state.undo):
        undo()
    setattr(pipe, STATE_ATTR, None)
    return pipe


def describe(pipe: Pipeline) -> AccelerationReport:
    """What was swapped, which provider serves each attention role and why, cache use, and what was left:
    as things are now (a shared transformer its owner restored, a component replaced since), not as planned.
    A pipeline not accelerated itself whose transformer another pipeline set up (a from_pipe sibling) runs
    that setup: its report says so."""
    _check_pipeline(pipe, "describe", "the pipeline omni_accel.accelerate() was given is described")
    state = getattr(pipe, STATE_ATTR, None)
    state = borrowed_state(pipe) if state is None and set_up_elsewhere(pipe) else state_of(pipe)
    reports = []
    for component in state.components:
        report, held = current_report(pipe, component, state.components)
        if held is not None and held.runtime is not None and report.runtime is not None:
            ring = held.parallel is not None and held.parallel.config.ring > 1
            sites = native_sites(held.original, held.spec.native_model(), ring)
            report.planned_attention = resolve_rows(
                sites, placement_of(held.original), report.selector, strict=False
            )
        set_up = held is not None and setup_of(uncompiled(held.original)) is not None
        native = isinstance(report.runtime, NativeRuntime)
        compiles_blocks = getattr(report.runtime, "compiler", None) is not None
        compiled = users_compile(getattr(pipe, component.name), native, compiles_blocks) if set_up else None
        if compiled is not None:
            report = dataclasses.replace(report, not_accelerated=[*report.not_accelerated, compiled])
        if held is not None:  # read now: enable_cache() and disable_cache() come before or after accelerate
            report = dataclasses.replace(report, step_cache=step_cache_note(held.original))
            left = compiled_in_diffusers(held.original, report)
            report = dataclasses.replace(report, not_accelerated=[*report.not_accelerated, *left])
        if isinstance(report.runtime, NativeRuntime):
            report = dataclasses.replace(report, holders=holder_lines(pipe, state, report.runtime))
        reports.append(report)
    for name, held_class in state.released.items():
        reports.append(replaced_report(pipe, name, held_class))
    others = [
        current_vae_report(pipe, other, state.vae) if other.name == "vae" else other for other in state.others
    ]
    return AccelerationReport(type(pipe).__name__, reports + others + state.absent)
