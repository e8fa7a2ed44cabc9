"""What ``describe`` says of each component as things are now, not as planned: a shared transformer
its owner restored, a component or VAE coder replaced since, a user's own compile, a from_pipe sibling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from omni_accel.patches import attention_roles

from .. import cuda_graphs
from ..attention.routing import processor_backend_reason
from ..config import AccelConfig
from ..forward_hooks import installed
from ..models.base import NativeBlock, NativeRuntime
from ..models.generic import GenericRuntime
from ..models.registry import spec_for
from ..parallel import vae as vae_split
from ..report import FP8_CLAIM, ComponentReport, shared_mode
from ..utils.logging import get_logger
from .commit import binds, holders
from .state import (
    STATE_ATTR,
    Component,
    GenericSetup,
    Pipeline,
    State,
    is_denoiser,
    orphan_owner,
    setup_of,
    uncompiled,
)
from .vae import split_detail

logger = get_logger(__name__)


def log_summary(pipe: Pipeline, components: list[Component]) -> None:
    """One INFO line per accelerate; a WARNING for whatever was left to Diffusers."""
    summary = "; ".join(f"{c.name} ({c.report.diffusers_class}) {c.report.mode}" for c in components)
    logger.info("%s accelerated: %s (omni_accel.describe(pipe) for details)", type(pipe).__name__, summary)
    for component in components:
        report = component.report
        if report.mode not in ("native", shared_mode("native")):
            logger.warning(
                "pipe.%s (%s) is %s: %s", report.name, report.diffusers_class, report.mode, report.detail
            )


def holder_lines(pipe: Pipeline, state: State, runtime: NativeRuntime) -> list[str]:
    """How the components holding native blocks of ``runtime`` (``holders``) run them now."""
    lines = []
    for name, module, held, count in holders(pipe, [c.original for c in state.components]):
        if held is not runtime:
            continue
        line = f"pipe.{name} ({type(module).__name__}) holds {count} of these native blocks (Diffusers shares them)"
        if binds(module, runtime):
            lines.append(f"{line}: they run natively in its forward too")
        elif getattr(pipe, STATE_ATTR, None) is None:  # a from_pipe sibling of the accelerated pipeline
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


def users_compile(module: nn.Module, native: bool, compiles_blocks: bool) -> str | None:
    """What a user's own compile (``compile_repeated_blocks()``, ``Module.compile()``, or a ``torch.compile``
    wrapper put in the module's or a block's place), made before or after ``accelerate``, does to the native
    blocks it covers (``native``) or, for another tier, to the blocks it compiles itself (``compiles_blocks``;
    None: nothing to say)."""
    inner = uncompiled(module)
    if (
        not native
    ):  # the module's call enters its scopes, compiled in place or by a wrapper: providers serve it
        compiled_whole = inner is not module or module.__dict__.get("_compiled_call_impl") is not None
        return _whole_call_note(inner, module) if compiled_whole and compiles_blocks else None
    blocks = [m for m in inner.modules() if isinstance(m, NativeBlock)]
    if inner is not module:
        where = (
            f"torch.compile({type(inner).__name__}) put in the pipeline holds its {len(blocks)} native blocks"
        )
    elif module.__dict__.get("_compiled_call_impl") is not None:
        where = f"{type(module).__name__} itself (Module.compile()) holds its {len(blocks)} native blocks"
    else:
        wrapped = [m._orig_mod for m in module.modules() if isinstance(m, OptimizedModule)]
        compiled = sum(
            block.__dict__.get("_compiled_call_impl") is not None or any(block is m for m in wrapped)
            for block in blocks
        )
        if not compiled:
            return None
        where = (
            f"{compiled} of the {len(blocks)} native blocks (compile_repeated_blocks(), Module.compile() or "
            "torch.compile(block) put in its place)"
        )
    return (
        f"a torch.compile of the user's own: {where}; it traces Diffusers' forward of those blocks, so they "
        "run neither the native math nor our attention providers nor the projection cache (the lines above "
        "count native runs only). Drop that compile and pass compile=True to compile the native math instead"
    )


def _whole_call_note(inner: nn.Module, module: nn.Module) -> str:
    """The user compiles the whole call of a module whose repeated blocks we compile: their trace holds the
    blocks, so our compiled code (and its CUDA graphs) steps aside; our providers still serve the attention
    inside it (``patches/scoped_calls.py``)."""
    name = type(inner).__name__
    where = f"torch.compile({name}) put in the pipeline" if inner is not module else f"{name}.compile()"
    return (
        f"a torch.compile of the user's own: {where} compiles the module's whole call, our attention providers "
        "inside it; our compiled blocks and CUDA graphs step aside for it. Drop that compile to run them"
    )


def current_report(
    pipe: Pipeline, component: Component, components: list[Component]
) -> tuple[ComponentReport, Component | None]:
    """The component's report as things are now, and the accelerated component whose module it holds now
    (None: a module this ``accelerate`` did not set up)."""
    module = getattr(pipe, component.name, None)  # a torch.compile wrapper of it runs it as it was set up
    held = next((other for other in components if uncompiled(other.original) is uncompiled(module)), None)
    if held is None:
        return replaced_report(pipe, component.name, type(component.original).__name__), None
    # A module this pipeline left untouched may hold another pipeline's setup since (from_pipe).
    untouched_then_set_up = held.report.mode == "untouched" and setup_of(module) is not None
    report = shared_report(component.name, module) if held.shared or untouched_then_set_up else held.report
    if held is not component:  # accelerated components swapped between slots (Wan 2.2's two experts)
        detail = f"{report.detail} (set up as pipe.{held.name}, which pipe.{component.name} holds now)"
        report = dataclasses.replace(report, name=component.name, detail=detail)
    return report, held


def replaced_report(pipe: Pipeline, name: str, held_class: str) -> ComponentReport:
    """``pipe.<name>``, which held a ``held_class`` at ``accelerate``, as it runs now."""
    module = getattr(pipe, name, None)
    cls_name = type(module).__name__ if module is not None else "-"
    detail = f"pipe.{name} was replaced after accelerate (it held a {held_class}); what it holds now "
    if module is not None and setup_of(module) is not None:
        detail += "was accelerated by another pipeline, and runs as that one set it up"
    else:
        detail += "runs as in Diffusers: omni_accel.restore(pipe), then accelerate(pipe), accelerates it"
    return ComponentReport(name, cls_name, "replaced", detail)


def current_vae_report(pipe: Pipeline, report: ComponentReport, vae: nn.Module | None) -> ComponentReport:
    """The VAE's ``report`` as things are now: a VAE put in ``pipe.vae`` after ``accelerate`` is not the
    one ``vae`` it split (or left whole), so its line says so rather than the old VAE's split and counts."""
    module = getattr(pipe, "vae", None)
    if uncompiled(module) is vae:
        return _current_coders(report, vae)
    coders = [getattr(module, name, None) for name in ("decoder", "encoder")]
    detail = f"pipe.vae was replaced after accelerate (it held a {type(vae).__name__}); what it holds now "
    cls_name = type(module).__name__ if module is not None else "-"
    return ComponentReport("vae", cls_name, "replaced", detail + _how_coders_run(coders, "sets it up"))


def _current_coders(report: ComponentReport, vae: nn.Module) -> ComponentReport:
    """The VAE's ``report`` with the coders split at ``accelerate`` and replaced since (``pipe.vae.decoder =
    ...``) said as they run now, rather than as the split ones they replaced (and those splits' counts)."""
    replaced = [
        name for name, coder in report.row_split.items() if uncompiled(getattr(vae, name, None)) is not coder
    ]
    split = {name: coder for name, coder in report.row_split.items() if name not in replaced}
    if report.mode == shared_mode("patch-parallel") and not any(
        installed(coder, vae_split.RowSplit) is not None for coder in split.values()
    ):
        detail = (
            "shared with another pipeline (from_pipe) that split it by rows and has since restored it: it runs "
            "whole on every rank, as in Diffusers"
        )
        return dataclasses.replace(report, mode="untouched", detail=detail, row_split={})
    if not replaced:
        return report
    notes = [split_detail(list(split))] if split else []
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


def shared_report(name: str, module: nn.Module) -> ComponentReport:
    """A transformer that another pipeline accelerated (``from_pipe`` shares it): its state now."""
    module = uncompiled(module)  # a torch.compile wrapper put in its place runs it
    setup = setup_of(module)
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
    if orphan_owner(module) is not None:  # a copy held by a pipeline not accelerated itself
        detail = (
            "a copy of a module another pipeline accelerated (a deep or unpickled copy), which no pipeline owns: "
            "it runs that setup; omni_accel.accelerate(pipe) takes it over (omni_accel.restore(pipe) then undoes it)"
        )
    if isinstance(setup, GenericSetup):  # the other pipeline's detail says its tier, lossy options too
        detail += f"; as that pipeline set it up ({setup.tier}): {setup.detail}"
        return ComponentReport(
            name,
            type(module).__name__,
            shared_mode(setup.tier),
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
        shared_mode("native"),
        detail,
        setup.selector,
        cache=setup.cache,
        cfg=setup.layout.cfg if setup.layout is not None else None,
        runtime=setup,
        graphs=graphs,
    )


def set_up_elsewhere(pipe: Pipeline) -> list[tuple[str, nn.Module]]:
    """The denoisers of ``pipe`` (name, module) that another pipeline accelerated: what a pipeline not
    accelerated itself runs of ours (a from_pipe sibling of an accelerated pipeline, or a copy of one)."""
    return [
        (name, module)
        for name, module in pipe.components.items()
        if is_denoiser(module) and setup_of(module) is not None
    ]


def borrowed_state(pipe: Pipeline) -> State:
    """For ``describe`` of a pipeline not accelerated itself that runs modules another pipeline set up
    (``set_up_elsewhere``): its denoisers as they run, in a state that owns and undoes nothing."""
    components = []
    for name, module in pipe.components.items():
        if not is_denoiser(module):
            continue
        shared = setup_of(module) is not None
        report = (
            shared_report(name, module)
            if shared
            else ComponentReport(
                name,
                type(module).__name__,
                "untouched",
                "this pipeline was not accelerated itself: it runs as in Diffusers (omni_accel.accelerate(pipe) "
                "accelerates its transformers and shares the modules set up above)",
            )
        )
        components.append(Component(name, module, spec_for(module), report, shared=shared))
    return State(AccelConfig(), components, [])


def compiled_in_diffusers(module: nn.Module, report: ComponentReport) -> list[str]:
    """The routed attention modules of ``module`` whose processor carries a Diffusers backend or
    context-parallel config (``set_attention_backend``), where compiled blocks trace Diffusers' function for
    them: the eager path counts such calls ("attention left to Diffusers"), compiled code cannot, so the
    report says it from the processors as they are now."""
    runtime = report.runtime
    if not isinstance(runtime, GenericRuntime) or runtime.compiler is None or report.selector is None:
        return []
    found: dict[tuple[str, str], int] = {}
    for child in module.modules():
        route = vars(child).get(attention_roles.ROUTE)
        processor = getattr(child, "processor", None)
        if route is None or processor is None:
            continue
        backend = getattr(processor, "_attention_backend", None)
        reason = processor_backend_reason(backend, getattr(processor, "_parallel_config", None))
        if reason is not None and (route[0], reason) not in report.selector.unrouted:
            found[(route[0], reason)] = found.get((route[0], reason), 0) + 1
    return [
        f"attention left to Diffusers: {role}: {reason} ({count} attention modules; their calls inside compiled "
        "blocks run Diffusers' function and are not counted)"
        for (role, reason), count in sorted(found.items())
    ]
