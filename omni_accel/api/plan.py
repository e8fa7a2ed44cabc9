"""Phase 1 of ``accelerate``: what each component will run with, checked and built without touching the
pipeline (native blocks where the model has them, else the generic tier), with the report it starts from.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

import omni_accel.patches as patches

from .. import cuda_graphs
from ..attention.selection import AttentionSelector
from ..cache import ExactProjectionCache
from ..config import AccelConfig
from ..layers.fp8 import Fp8Weights
from ..layers.fp8_linears import MIN_FP8_ROWS
from ..models.base import NativeModel, NativeRuntime
from ..models.generic import GenericRuntime, repeated_blocks
from ..models.registry import ModelSpec, spec_for
from ..parallel.mesh import ParallelState
from ..report import FP8_CLAIM, ComponentReport
from .placement import check_attention, compute_dtype, native_sites, routed_sites
from .reports import shared_report
from .spread import check_generic_layout, check_layout, generic_layout_note, report_layout
from .state import Component, check_shared_options, setup_of


def plan_component(
    name: str,
    module: nn.Module,
    config: AccelConfig,
    parallel: ParallelState | None,
    asked: frozenset[str],
    spread_later: bool = False,
) -> Component:
    """Decides what to do with one component and builds it, touching nothing in the pipeline.
    ``spread_later``: ``parallel="auto"`` lays the generic tier's transformers out at the first call."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            f"pipe.{name} is a torch.compile'd module; accelerate the module itself "
            f"(pipe.{name} = pipe.{name}._orig_mod) and pass compile=True to compile the native blocks."
        )
    spec = spec_for(module)
    if setup_of(module) is not None:  # e.g. a sibling made by from_pipe shares an accelerated transformer
        check_shared_options(name, module, config, asked)
        return Component(name, module, spec, shared_report(name, module), shared=True)
    native_ok = spec is not None and spec.native is not None and config.native
    distributed = parallel is not None and parallel.mesh is not None
    selector = AttentionSelector(config.attention)
    if native_ok:
        return _plan_swap(name, module, spec, config, selector, parallel if distributed else None)
    return _plan_generic(
        name, module, spec, config, selector, parallel if distributed else None, spread_later
    )


def _plan_swap(
    name: str,
    module: nn.Module,
    spec: ModelSpec,
    config: AccelConfig,
    selector: AttentionSelector,
    parallel: ParallelState | None,
) -> Component:
    """The Diffusers module stays; its repeated blocks will become native and, with ``parallel``, spread over
    the ranks (everything checked here, applied at commit)."""
    model = spec.native_model()
    patches.check_applicable("hook_chains")
    ring = parallel is not None and parallel.config.ring > 1  # its merges take the log-sum-exp
    check_attention(name, module, native_sites(module, model, ring), selector)
    graphs_on = config.cuda_graphs
    if graphs_on is None:  # auto: on wherever the steps run on CUDA
        graphs_on = torch.cuda.is_available() and (parallel is None or parallel.device.type == "cuda")
    if parallel is not None:
        check_layout(module, model, parallel, graphs_on)
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
    report_layout(report, parallel, tp_tokens=model.parallel.sequence is not None)
    if parallel is not None:
        report.layout = f"{parallel.config} on {dist.get_world_size()} ranks"
    return Component(name, module, spec, report, cache, runtime=runtime, parallel=parallel, graphs=graphs)


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
        dtype = compute_dtype(module)
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
    spread_later: bool = False,
) -> Component:
    """A transformer with no native blocks (or ``native=False``): the Diffusers module stays, its attention
    routed through our providers where its module's call sites can be, its repeated blocks compiled and its
    steps replayed from CUDA graphs (``models.generic``; on CUDA unless ``compile`` / ``cuda_graphs`` say).
    With ``parallel``, its sequence split as the model's ``_cp_plan`` declares (``models.generic``); with
    ``spread_later``, by the layout ``parallel="auto"`` chooses at the first call."""
    cls_name = type(module).__name__
    routes = spec.attention_routes if spec is not None else ()
    blocks = repeated_blocks(module)
    _check_generic(name, module, spec, config, parallel, blocks)
    fp8 = _fp8_weights(name, module) if config.quantize == "fp8" else None
    on_cuda = torch.cuda.is_available()
    compile_on = bool(blocks) and (on_cuda if config.compile is None else config.compile_asked)
    graphs_on = on_cuda if config.cuda_graphs is None else config.cuda_graphs
    spread = parallel is not None or spread_later
    if not (routes or compile_on or graphs_on or spread):
        report = ComponentReport(
            name,
            cls_name,
            "untouched",
            "no native implementation, no attention call site we can route, and no repeated blocks to compile",
            not_accelerated=[f"{cls_name} runs exactly as in Diffusers"],
        )
        return Component(name, module, spec, report)
    if routes:
        check_attention(name, module, routed_sites(module, spec), selector)
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
    background = config.compile_in_background and not spread  # the ranks run the same code each step
    if compile_on:
        options = {} if not isinstance(config.compile, Mapping) else dict(config.compile)
    compiled, not_compiled = _generic_compile_notes(config, blocks, compile_on, background, spread)
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
        parts.append(generic_layout_note(parallel.config))
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
    report_layout(report, parallel)
    generic = runtime if compile_on or fp8 is not None else None
    return Component(name, module, spec, report, cache, parallel=parallel, graphs=graphs, generic=generic)


def _graphs_note(on_cuda: bool) -> str:
    """What CUDA graphs of the steps do here, where they are on."""
    if on_cuda:
        return "steps replayed from CUDA graphs where they run on one CUDA device (counts below)"
    return (
        "cuda_graphs=True, but no step can run on CUDA here (this machine has no CUDA device): every step "
        "runs eagerly, none is captured"
    )


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
        check_generic_layout(module, spec, parallel)
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
    config: AccelConfig, blocks: list, compile_on: bool, background: bool, spread: bool
) -> tuple[str | None, str | None]:
    """What the report says of the repeated blocks' compilation: what was done, or why not."""
    if compile_on:
        listed = sorted({type(block).__name__ for _, block in blocks})
        when = (
            " in the background (eager blocks serve until the code is ready)"
            if background
            else " at the first call per input shape"
            + (" (every rank alike: never in the background under a layout)" if spread else "")
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
