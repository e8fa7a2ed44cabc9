"""What an accelerated pipeline keeps (``State``: its components and their undos) and who owns a module
several pipelines share (from_pipe siblings, deep or unpickled copies): one module runs one setup, made and
undone by one pipeline, which the others share.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diffusers import DiffusionPipeline, ModelMixin, ModularPipeline
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

import omni_accel.patches as patches

from .. import cuda_graphs
from ..attention.selection import AttentionSelector
from ..cache import ExactProjectionCache
from ..config import AccelConfig
from ..forward_hooks import installed
from ..models.base import NativeBlock, NativeRuntime
from ..models.generic import GenericRuntime
from ..models.registry import ModelSpec, registered_spec
from ..moves import DropsMoved
from ..parallel import vae as vae_split
from ..parallel.held_groups import refuse_pickle, share_groups
from ..parallel.mesh import ParallelState
from ..report import ComponentReport, shared_mode
from ..utils.copies import deepcopy_instance
from .vae import SPLIT_CODERS, split_detail, unsplit

STATE_ATTR = "_omni_accel_state"


# What accelerate takes: the pipelines of `diffusers.pipelines` and those built from blocks
# (`diffusers.modular_pipelines`); both hold their denoiser as an attribute (`pipe.transformer`).
Pipeline = DiffusionPipeline | ModularPipeline


@dataclass
class Component:
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

    def __deepcopy__(self, memo: dict) -> Component:
        # The report names the layout's process groups (``describe`` reads them): a copy shares them. Here,
        # not in ``State``: the module's ``_Owner`` reaches the component first when the module is copied.
        share_groups(vars(self.report).values(), memo)
        return deepcopy_instance(self, memo)


@dataclass
class _Owner:
    """The component that set a module up and the options it used, kept on the module (as its setup is):
    a deep or unpickled copy of a pipeline sharing the module (from_pipe) without its owner holds a copy of
    the module that no pipeline owns, and takes it over with this (``adopt_orphans``)."""

    component: Component
    config: AccelConfig


_OWNER = "_omni_accel_owner"


@dataclass
class State:
    config: AccelConfig
    components: list[Component]
    undo: list[Callable[[], None]]
    absent: list[ComponentReport] = field(default_factory=list)
    others: list[ComponentReport] = field(default_factory=list)  # components other than denoisers (the VAE)
    vae: nn.Module | None = None  # the VAE ``others`` describes (pipe.vae may be replaced since)
    # Components a modular pipeline let go of (``unload_components``, ``update_components``): name -> the
    # class it held, restored and no longer referenced (``_release_dropped``).
    released: dict[str, str] = field(default_factory=dict)
    # Accelerated by zero-code as the pipeline was built (``auto``): an explicit accelerate is told so.
    zero_code: bool = False

    def __deepcopy__(self, memo: dict) -> State:
        twin = deepcopy_instance(self, memo)
        twin.__setstate__(vars(twin))
        return twin

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        _hold_copied_patches(self.undo)
        for component in self.components:  # a copy owns its copied modules: its siblings share its options
            _hold_copied_patches(component.undo)
            if not component.shared:
                SET_UP_WITH[component.original] = self.config
        for report in self.others:
            if report.mode == "patch-parallel":
                SPLIT_CODERS.update(report.row_split.values())

    def __getstate__(self) -> dict[str, Any]:
        for component in self.components:  # before the reports, which hold the groups too
            if component.parallel is not None and component.parallel.mesh is not None:
                refuse_pickle(f"This pipeline, accelerated with {component.parallel.config},")
        return vars(self)


# The options each accelerated transformer was set up with, by module: another pipeline holding it (from_pipe)
# shares that setup, and options it asks that differ are refused (``check_shared_options``).
SET_UP_WITH: weakref.WeakKeyDictionary[nn.Module, AccelConfig] = weakref.WeakKeyDictionary()


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


def forget_setup(module: nn.Module, config: AccelConfig) -> None:
    """Restore's undo of ``SET_UP_WITH``: a function, so that a pipeline holding it pickles (the weak
    dictionary does not). Only ``config``: a pipeline that left the module untouched forgets not the setup
    another one (from_pipe) made on it since."""
    if SET_UP_WITH.get(module) is config:
        del SET_UP_WITH[module]


def keep_owner(component: Component, config: AccelConfig) -> None:
    """The module keeps who set it up (``_Owner``), so that a copy of it that no pipeline owns can be restored."""
    owner = _Owner(component, config)
    object.__setattr__(component.original, _OWNER, owner)
    component.undo.insert(0, functools.partial(_drop_owner, component.original, owner))


def _drop_owner(module: nn.Module, owner: _Owner) -> None:
    if module.__dict__.get(_OWNER) is owner:
        object.__delattr__(module, _OWNER)


def orphan_owner(module: nn.Module) -> _Owner | None:
    """The owner kept on a set-up ``module`` that no pipeline owns (a copy of a from_pipe sibling's, made
    without its owner's), else None."""
    owner = module.__dict__.get(_OWNER)
    if owner is None or module in SET_UP_WITH or setup_of(module) is None:
        return None
    return owner


def adopt_orphans(state: State) -> None:
    """A shared component whose module no pipeline owns becomes this pipeline's (restore undoes it, describe
    says so): a deep or unpickled copy of a from_pipe sibling owns the modules it copied, as its copy in
    Diffusers does; so does the VAE split a layout's sibling shared, which no pipeline split in the copy."""
    for i, component in enumerate(state.components):
        owner = orphan_owner(component.original) if component.shared else None
        if owner is not None:
            adopted = owner.component
            _hold_copied_patches(adopted.undo)
            adopted.name = component.name
            adopted.report = dataclasses.replace(adopted.report, name=component.name)
            state.components[i] = adopted
            SET_UP_WITH[component.original] = owner.config
    for i, report in enumerate(state.others):
        splits = {name: installed(coder, vae_split.RowSplit) for name, coder in report.row_split.items()}
        if report.mode != shared_mode("patch-parallel") or None in splits.values():
            continue
        if not any(coder in SPLIT_CODERS for coder in report.row_split.values()):
            state.others[i] = dataclasses.replace(
                report, mode="patch-parallel", detail=split_detail(list(splits))
            )
            for name, coder in report.row_split.items():
                SPLIT_CODERS.add(coder)
                state.undo.append(functools.partial(unsplit, coder, splits[name]))


def differing_options(module: nn.Module, config: AccelConfig) -> tuple[AccelConfig | None, list[str]]:
    """The options another pipeline holding ``module`` (from_pipe) accelerated it with (None: none did), and
    the module options ``config`` sets otherwise (zero-code reads them too)."""
    owner = SET_UP_WITH.get(module)
    if owner is None and (orphan := orphan_owner(module)) is not None:
        owner = orphan.config
    if owner is None:
        return None, []
    return owner, [o for o in _MODULE_OPTIONS if getattr(config, o) != getattr(owner, o)]


def check_shared_options(name: str, module: nn.Module, config: AccelConfig, asked: frozenset[str]) -> None:
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


def held_twice(name: str, first: Component) -> Component:
    """A module the pipeline holds under a second name as well (``pipe.transformer_2 = pipe.transformer``):
    accelerated once, as ``first``, which owns it; this name shares it."""
    module = first.original
    detail = f"the module pipe.{first.name} holds too: accelerated once, as pipe.{first.name}"
    report = ComponentReport(name, type(module).__name__, shared_mode(first.report.mode), detail)
    return Component(name, module, first.spec, report, shared=True)


def uncompiled(module: Any) -> Any:
    """The module a ``torch.compile(module)`` wrapper put in its place runs (as it was set up, or not)."""
    return module._orig_mod if isinstance(module, OptimizedModule) else module


def is_denoiser(module: Any) -> bool:
    """A Diffusers transformer or UNet (what ``components`` may name): a registered model, a class of
    ``diffusers.models.transformers`` / ``unets``, or a custom ModelMixin named as one."""
    module = uncompiled(module)  # a torch.compile'd one: plan_component says how to accelerate it
    if not isinstance(module, ModelMixin):
        return False
    cls = type(module)
    return (
        registered_spec(module) is not None
        or cls.__module__.startswith(("diffusers.models.transformers.", "diffusers.models.unets."))
        or "Transformer" in cls.__name__
        or "UNet" in cls.__name__
    )


# The generic tier's setup of a transformer, kept on the module itself (as native blocks keep their runtime).
GENERIC_SETUP = "_omni_accel_generic"


@dataclass
class GenericSetup:
    """What the generic tier set up on a transformer (routed attention, compiled blocks, step graphs), kept
    on the module, so that a deep or unpickled copy carries its own: another pipeline holding the module
    (from_pipe) finds it and shares that setup rather than stacking a second one on it."""

    tier: str  # "generic" or "routed"
    detail: str
    selector: AttentionSelector | None
    cache: ExactProjectionCache | None
    runtime: GenericRuntime | None  # its compiled blocks or FP8 linears (None: neither)


def setup_of(module: nn.Module) -> NativeRuntime | GenericSetup | None:
    """The runtime of the native blocks inside ``module``, or the generic tier's setup of it (None: neither
    now)."""
    native = next((m.omni_runtime for m in module.modules() if isinstance(m, NativeBlock)), None)
    return native if native is not None else module.__dict__.get(GENERIC_SETUP)


def state_of(pipe: Pipeline) -> State:
    state = getattr(pipe, STATE_ATTR, None)
    if state is None:
        raise ValueError("This pipeline is not accelerated; call omni_accel.accelerate(pipe) first.")
    adopt_orphans(state)
    return state


class HeldPatch:
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
        return HeldPatch, (self.name, self.target, True)


def _hold_copied_patches(undo: list[Callable[[], None]]) -> None:
    """Takes up the patch references a copied pipeline's undo steps hold (see ``HeldPatch``)."""
    for step in undo:
        if isinstance(step, HeldPatch):
            step.hold()
