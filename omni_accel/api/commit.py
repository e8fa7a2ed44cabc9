"""Phase 2 of ``accelerate``: each planned component's ordered steps (``_NATIVE_STEPS``, ``_GENERIC_STEPS``).

Each step changes the module and appends the undo of what it changed to ``component.undo``; a refused
``accelerate`` runs those undos, newest first, and ``restore`` runs them all. The forward scopes (runtime,
selector, forward marks) are entered by a class patch of the transformer's ``__call__``
(``patches/scoped_calls.py``), so an interrupt mid-forward leaves none entered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from omni_accel.patches import attention_roles, scoped_calls

from .. import cuda_graphs
from ..attention import routing
from ..cache import ExactProjectionCache, wrap_sites
from ..forward_hooks import add_scope
from ..layers.attention import enter_forward, leave_forward
from ..layers.fp8 import Fp8Weights
from ..layers.fp8_linears import install_fp8_linears
from ..models.base import NativeBlock, NativeRuntime, native_blocks, swap_blocks
from ..models.generic import install_regions, repeated_blocks
from ..models.registry import generic_adaptation
from ..moves import AfterMoves
from ..utils import versions
from .placement import role_of
from .state import GENERIC_SETUP, Component, GenericSetup, HeldPatch, Pipeline, setup_of, uncompiled


@dataclass(frozen=True)
class _Step:
    """One step of committing a planned component, in the order of its table: it runs where
    ``applies(component)``, and ``apply`` adds the undo of everything it changes to ``component.undo``
    (a refused ``accelerate`` runs those undos, newest first)."""

    name: str
    applies: Callable[[Component], bool]
    apply: Callable[[Component], None]


def _always(component: Component) -> bool:
    return True


def _swap_native_blocks(component: Component) -> None:
    model = component.spec.native_model()
    swapped = swap_blocks(component.original, model, component.runtime)
    component.undo.append(swapped.undo)
    component.stores.append(swapped)  # the blocks' memos


def _add_scope(component: Component, enter: Callable[[], Any], leave: Callable[[Any], None]) -> None:
    """Runs the module's calls in a scope (``forward_hooks.add_scope``), the class patch that enters it held
    once per component."""
    _scope_calls(component.original, enter, leave, component.undo)


def _scope_calls(
    module: nn.Module, enter: Callable[[], Any], leave: Callable[[Any], None], undo: list[Callable[[], None]]
) -> None:
    """Runs ``module``'s calls in a scope; its undo, and the class patch that enters it (held once per
    module), join ``undo``."""
    if scoped_calls.SCOPES not in vars(module):
        undo.append(HeldPatch("scoped_calls", type(module)))
    undo.append(add_scope(module, enter, leave))


def _bind_forward_runtime(component: Component) -> None:
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


def holders(pipe: Pipeline, transformers: list[nn.Module]) -> list[tuple[str, nn.Module, NativeRuntime, int]]:
    """The pipeline's other components that hold native blocks of an accelerated transformer (Diffusers
    shares some of a transformer's blocks with a module built on it, which calls them from its own forward):
    (name, module, the blocks' runtime, how many it holds), for a module whose native blocks all share one
    runtime."""
    found, seen = [], [*transformers]
    for name, module in pipe.components.items():
        if not isinstance(module, nn.Module) or any(
            uncompiled(module) is uncompiled(other) for other in seen
        ):
            continue
        seen.append(module)
        runtimes = [m.omni_runtime for m in module.modules() if isinstance(m, NativeBlock)]
        if runtimes and all(runtime is runtimes[0] for runtime in runtimes):
            found.append((name, module, runtimes[0], len(runtimes)))
    return found


def binds(module: nn.Module, runtime: NativeRuntime) -> bool:
    """Whether ``module``'s calls run in ``runtime``'s forward scope (``_scope_native_forwards``)."""
    return any(
        isinstance(scope.enter, functools.partial)
        and scope.enter.func is enter_forward
        and scope.enter.args[0] is runtime
        for scope in vars(module).get(scoped_calls.SCOPES, ())
    )


def scope_holders(pipe: Pipeline, components: list[Component]) -> None:
    """A component that holds native blocks of an accelerated transformer (``holders``) gets that
    transformer's forward scopes: the blocks run natively in its calls as in the transformer's (else they
    would run Diffusers' forward there, called outside their transformer's forward). Undone with the
    component whose module runs that runtime (its owner, or the pipeline sharing it: from_pipe)."""
    for _, module, runtime, _ in holders(pipe, [c.original for c in components]):
        component = next((c for c in components if setup_of(c.original) is runtime), None)
        if component is not None and not binds(module, runtime):
            _scope_native_forwards(module, runtime, component.undo)


def _mark_forwards(component: Component) -> None:
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


def _wrap_cache_sites(component: Component) -> None:
    """Model-level modules whose outputs repeat from call to call go through the projection cache."""
    spec = component.spec
    sites = spec.native_model().conditioning_sites if component.runtime is not None else spec.cache_sites
    component.undo += wrap_sites(component.original, sites, component.cache)


def _install_step_graphs(component: Component) -> None:
    component.graphs.install()
    component.undo.append(component.graphs.uninstall)
    component.stores.append(component.graphs)


def _install_block_graphs(component: Component) -> None:
    """Per-block graphs for steps a hook keeps from one graph (on one device: under a layout every rank
    would have to capture alike)."""
    blocks = native_blocks(component.original, component.spec.native_model())
    block_graphs = cuda_graphs.install_block_graphs(blocks, component.runtime)
    component.undo += [graphs.uninstall for graphs in block_graphs]
    component.report.block_graphs = block_graphs
    component.stores += block_graphs


def _adapt_model(component: Component) -> None:
    """Where the model's own code is replaced for the generic tier (``models/``), and how."""
    adaptation = generic_adaptation(component.original)
    if adaptation is not None:
        note, undo = adaptation(component.original)
        component.undo += undo
        component.report.adapted.append(note)


def _install_compiled_regions(component: Component) -> None:
    component.undo += install_regions(component.original, component.generic)


def _install_fp8(component: Component) -> None:
    blocks = repeated_blocks(component.original)
    copies, undo = install_fp8_linears(component.original, blocks, component.generic.fp8)
    component.undo += undo
    component.stores += [copies] if copies is not None else []


def _drop_at_moves(component: Component) -> None:
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


def _keep_generic_setup(component: Component) -> None:
    """The module keeps what set it up (``GenericSetup``), read by another pipeline that holds it."""
    report = component.report
    setup = GenericSetup(report.mode, report.detail, report.selector, component.cache, component.generic)
    object.__setattr__(component.original, GENERIC_SETUP, setup)
    component.undo.append(functools.partial(_drop_generic_setup, component.original, setup))


def _drop_generic_setup(module: nn.Module, setup: GenericSetup) -> None:
    if module.__dict__.get(GENERIC_SETUP) is setup:
        object.__delattr__(module, GENERIC_SETUP)


def _route_attention(component: Component) -> None:
    """Diffusers' attention calls below the module go through our providers: each attention module tagged
    with its role, the call sites' patches held."""
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
            role, category = role_of(component.spec, name, child)
            # Strings: Dynamo guards on their value, so blocks of one role share compiled code (see patches/).
            route = (role, category)
            object.__setattr__(child, attention_roles.ROUTE, route)
            # A partial, not a closure: a deep copy of the pipeline unroutes its own copy of the module.
            component.undo.append(functools.partial(_unroute, child, route))
            route_classes.add(f"{type(child).__module__}:{type(child).__qualname__}")
    for target in sorted(route_classes):  # one at a time: a failed apply leaves the earlier ones undoable
        component.undo.append(HeldPatch("attention_roles", target))
    for name, target in component.spec.attention_routes:
        component.undo.append(HeldPatch(name, target))


def _unroute(module: nn.Module, route: tuple[str, str]) -> None:
    if vars(module).get(attention_roles.ROUTE) == route:
        object.__delattr__(module, attention_roles.ROUTE)


_GENERIC_STEPS = (
    _Step("setup kept on the module", lambda c: c.report.mode != "untouched", _keep_generic_setup),
    _Step("attention routed", _always, _route_attention),
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


def commit_component(component: Component) -> None:
    """Runs the component's steps in order (a module another pipeline accelerated is that one's)."""
    if component.shared:
        return
    for step in _NATIVE_STEPS if component.runtime is not None else _GENERIC_STEPS:
        if step.applies(component):
            step.apply(component)
