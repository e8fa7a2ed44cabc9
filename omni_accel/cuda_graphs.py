"""Whole-step CUDA graphs for an accelerated transformer: one graph launch per denoising step instead of
one launch per kernel, eager or compiled.

A graph replays the kernels it recorded, with the pointers and host-side values of that moment. So a graph
is keyed by everything the host decides a step with: the arguments' structure, shapes, dtypes and
non-tensor values; each parameter's storage (a reloaded or re-packed weight is a new graph; an in-place
edit is seen by the graph, as it is by eager code); the step state its owner gives (``StepHooks``: the
generations of compiled code and of FP8 weight copies, whose addresses the parameters' do not name); the
value of every other attribute of every module (adapter state, an IP-adapter processor's scale, training
flags, a processor's backend...); and the global switches that pick kernels (autocast, reduced-precision
matmuls, SDPA kernels, an ``attention_scope``, Diffusers' attention backend). The key fails closed: an argument or attribute whose value it cannot name
makes the call run eagerly. Kernels built in the background since a capture (``kernel_builds``) are not
in the key: that graph computes the same function with what served while they were built, so it serves
on while no capture may run (a compile beside it) and is captured anew at the first call where one may.
A new key runs eagerly once (lazy initialisation, compilation and weight
packing happen there), is captured on its next call and replayed after that. Calls a graph cannot serve
exactly run eagerly and are counted by reason: hooks that decide per call (step caches, offload),
autograd, tensors off the GPU, capture errors. A move of the module to another device or dtype drops the
graphs keyed on the old weights at the move, and their memory pool with the last (``drop_moved``).

Under a parallel layout the step's collectives (NCCL all-reduces, all-to-alls, ring transfers) are captured
with its kernels. Our layout hooks decide only from shapes, and say what they decided (``replay_key``):
which slice of each sequence this rank holds is part of the key, since an uneven split can give two
sequence lengths the same local shape. Every rank sees the same calls with keys that match, so the ranks
capture and replay the same steps and their collectives stay paired. Outputs are copied out of the graph's
memory, so a caller may keep them across calls (pipelines hold the conditional result while the
unconditional one runs).

Reading the module's state is one walk over every module (milliseconds of host time on a large model:
docs/archive/performance-history.md), which would leave the GPU idle before each replay. So on one GPU the
graph last replayed for the same arguments is launched first, once every tensor it was keyed on is checked to
be alive at its address (the replay then reads valid memory whatever changed), and its result is returned only
if the state read meanwhile is the one it was captured with; otherwise it is dropped, counted, and the call
goes on as without it. Under a layout (whose collectives every rank must launch alike) it never is.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import threading
import types
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from torch import nn
from torch.utils._device import DeviceContext

from omni_accel.patches.hooks_around_native_math import (
    Decision,
    NotDecidedAhead,
    decide,
    decided_calls,
    record,
)

from . import background, kernel_builds
from .attention.selection import current_scope
from .background import capture_waits, nothing_beside
from .capture_constants import REFUSED_COPY, CaptureConstants
from .forward_hooks import (
    InstanceForward,
    global_hooks_active,
    has_foreign_torch_hooks,
    hooked_submodule,
    is_hooked,
)
from .utils.logging import get_logger
from .utils.precision import float32_precision
from .utils.reason_counts import ReasonCounts
from .utils.values import PLAIN_VALUES

logger = get_logger(__name__)

_LIVE: weakref.WeakSet[StepGraphs] = weakref.WeakSet()


def release_all() -> None:
    """Frees the graphs of every live ``StepGraphs`` (they capture again on later calls): a process group
    cannot be destroyed while graphs hold NCCL operations of its communicators."""
    if any(graphs.graphs for graphs in _LIVE):
        torch.cuda.synchronize()
    for graphs in list(_LIVE):
        graphs.release()


class StepHooks(Protocol):
    """What the module's owner tells the graphs at each step (a native transformer's runtime)."""

    def begin_step(self) -> Hashable:
        """Called as each step starts; part of the step's key (the generation of compiled code and of FP8
        weight copies)."""

    def step_eager_reason(self) -> str | None:
        """Why this step must run eagerly (patched code whose Python a replay would skip), or None."""

    def may_capture(self) -> bool:
        """False while a capture would be unsafe (a background compile running beside it)."""

    def before_replay(self) -> None:
        """Called before each replay (starts background work that may run beside replays)."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[Any]  # the static argument leaves the graph reads (tensors) or was keyed on (the rest)
    output: Any  # the forward's output, its tensors in the graph's memory
    key: tuple = ()
    # every tensor its key names (weak, with its address) and whether no layout hook was keyed: then its
    # replay may run while the key is checked (see ``StepGraphs.__call__``)
    reads: tuple = ()
    may_replay_early: bool = False
    constants: tuple = ()  # the pinned host tensors its copies read (``capture_constants``)
    settled: int = 0  # ``kernel_builds.settled()`` when it was captured: kernels built since are not in it

    def in_place(self) -> bool:
        """Every tensor the graph was keyed on is alive at its address: a replay reads valid memory."""
        for ref, address in self.reads:
            tensor = ref()
            if tensor is None or tensor.data_ptr() != address:
                return False
        return True


class StepGraphs(InstanceForward):
    """Captures and replays the forward of ``module`` (see the module docstring), installed as the
    module's instance ``forward`` (see ``InstanceForward``)."""

    def __init__(
        self,
        module: nn.Module,
        max_graphs: int = 4,
        hooks: StepHooks | None = None,
        memory: GraphMemory | None = None,
    ) -> None:
        super().__init__(module)
        self.hooks = hooks
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.warmed: set[tuple] = set()
        self.uncapturable: dict[tuple, str] = {}  # key -> why its capture failed
        self.memory = GraphMemory() if memory is None else memory
        self.captures = self.replays = self.early_replays = self.early_misses = 0
        self.inputs_in_place = 0  # arguments a replay read where a graph before wrote them (``GraphMemory``)
        self.latest: dict[tuple, _Graph] = {}  # the graph last replayed per key without the module state
        self.eager = ReasonCounts()
        self._lock = threading.Lock()
        _LIVE.add(self)

    def release(self) -> None:
        """Drops the captured graphs and their memory pool; later calls capture anew."""
        with self._lock:
            self.graphs.clear()
            self.latest.clear()
            self.warmed.clear()
            self.memory.pool = None

    def drop_moved(self) -> None:
        """The module moved (``omni_accel.moves``): drops the graphs keyed on tensors no longer where they
        were, which no call can replay again, with their static inputs and, once no graph is left, the
        memory pool, so that a module moved off its GPU leaves nothing there (they stayed until evicted by
        later captures, and the pool for good)."""
        with self._lock:
            moved = [key for key, graph in self.graphs.items() if not graph.in_place()]
            if not moved:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # a replay in flight may still read the memory freed here
            for key in moved:
                self._forget_latest(self.graphs.pop(key))
            if not self.graphs:
                self.memory.pool = None

    def __deepcopy__(self, memo: dict) -> StepGraphs:
        # Graphs hold this module's pointers: a copy starts empty and captures its own.
        twin = StepGraphs(copy.deepcopy(self.module, memo), self.max_graphs, copy.deepcopy(self.hooks, memo))
        twin.inner, twin.enabled = copy.deepcopy(self.inner, memo), self.enabled
        return twin

    def __reduce__(self):
        return _unpickle, (self.module, self.inner, self.max_graphs, self.enabled, self.hooks)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, forward = self.module, self._step_forward()
        if (
            not self.enabled or torch.compiler.is_dynamo_compiling()
        ):  # a compiler tracing us sees the plain forward
            return forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        reason = _eager_reason(module, leaves) or (self.hooks and self.hooks.step_eager_reason())
        if reason is not None:
            return self._eager(reason, forward, args, kwargs)
        state = self._begin_step()
        device = next(leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor))
        early = None
        try:
            call = _call_key(leaves, spec, state)
            early = self._early_replay(call, leaves, device)
            module_state = self._state()
        except Unkeyable as exc:  # fail closed: what the key cannot name, a replay could get wrong
            self.early_misses += early is not None
            return self._eager(f"{exc} that cannot be compared between calls", forward, args, kwargs)
        key = None if module_state is None else (call, module_state)
        if early is not None:
            graph, out = early
            if key == graph.key:
                return out
            self.early_misses += 1  # the module changed since: its result is dropped, and not tried again
            self.latest.pop(call, None)
        if key is None:
            with _hooked_step(state):  # the blocks' own graphs may serve it (``BlockGraphs``)
                return self._eager(_HOOKED, forward, args, kwargs)
        with self._lock, torch.cuda.device(device):  # capture and replay on the arguments' GPU
            graph = self.graphs.get(key)
            settled = kernel_builds.settled()
            if graph is not None and graph.settled != settled and self._may_capture():
                graph = None  # kernels were built since its capture: captured anew (it serves meanwhile)
            if graph is None:
                if (key, settled) in self.uncapturable:
                    return self._eager(self.uncapturable[key, settled], forward, args, kwargs)
                if (key, settled) not in self.warmed:  # each kernel built so far launched before a capture
                    with capture_waits():
                        out = forward(*args, **kwargs)
                    if len(self.warmed) >= 64:
                        self.warmed.clear()
                    with contextlib.suppress(Unkeyable):  # the key as the call left it (weights packed...)
                        left = self._state()
                        self.warmed.add((None if left is None else (call, left), settled))
                    return out
                if self.hooks is not None and not self.hooks.may_capture():
                    return self._eager(
                        "compiled blocks are being built in the background", forward, args, kwargs
                    )
                with nothing_beside() as free:
                    if not free:
                        with capture_waits():
                            return self._eager(_COMPILE_BESIDE, forward, args, kwargs)
                    graph = self._capture(key, forward, leaves, spec, settled)
                if graph is None:
                    return forward(*args, **kwargs)
            else:
                self.graphs.move_to_end(key)
            self.latest[call] = graph
            return self._replay(graph, leaves)

    def _begin_step(self) -> Hashable:
        return self.hooks.begin_step() if self.hooks is not None else None

    def _may_capture(self) -> bool:
        """Whether a capture may run now: no compile or kernel build that plans on the GPU runs beside it."""
        return (self.hooks is None or self.hooks.may_capture()) and not background.LOCK.locked()

    def _step_forward(self) -> Callable[..., Any]:
        """What a call runs, eagerly or captured: the module's forward."""
        return self._forward()

    def _state(self, seen: _Seen | None = None) -> tuple | None:
        return _module_state(self.module, seen)

    def _early_replay(
        self, call: tuple, leaves: list[Any], device: torch.device
    ) -> tuple[_Graph, Any] | None:
        """The replay of the graph last replayed for ``call``, launched before the module's state is read:
        that walk over every module (milliseconds of host time on a large model) then runs while the GPU
        replays, and a changed state drops the result. Only where every tensor the graph was keyed on is
        alive at its address (the replay reads valid memory) and no layout hook was keyed (every rank of a
        layout must launch the same collectives)."""
        graph = self.latest.get(call)
        if graph is None or not graph.may_replay_early or graph.settled != kernel_builds.settled():
            return None  # a graph older than the latest kernel builds may be replaced: the full path decides
        if not graph.in_place():
            return None
        with self._lock, torch.cuda.device(device):
            if self.graphs.get(graph.key) is not graph:  # evicted or released since
                return None
            self.early_replays += 1
            return graph, self._replay(graph, leaves)

    def _eager(self, reason: str, forward, args, kwargs) -> Any:
        if self.eager.count(reason):
            logger.info("CUDA graphs: a call runs eagerly: %s (counted in describe)", reason)
        return forward(*args, **kwargs)

    def _capture(self, key: tuple, forward, leaves: list[Any], spec, settled: int) -> _Graph | None:
        with self.memory.lock:
            inputs = static_inputs(leaves, [graph.inputs for graph in self.graphs.values()], self.memory)
        args, kwargs = pytree.tree_unflatten(inputs, spec)
        constants = None
        try:
            try:
                graph, output = self._record(forward, args, kwargs, contextlib.nullcontext())
            except RuntimeError as exc:  # host values copied to the GPU: again, served from pinned memory
                if not _refused_copy(exc):
                    raise
                constants = CaptureConstants()
                graph, output = self._record(forward, args, kwargs, constants)
        except Exception as exc:  # e.g. a host synchronisation inside the forward
            self.uncapturable[key, settled] = f"the step failed to capture: {_first_line(exc)}"
            logger.warning("CUDA graphs: this step cannot be captured, it runs eagerly: %s", exc)
            return None
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(output)):
            self.uncapturable[key, settled] = "the forward returned no tensor a replay could copy out"
            logger.warning("CUDA graphs: the forward returned no tensor we can copy out; it runs eagerly")
            return None
        self.memory.pool = graph.pool()
        self.captures += 1
        seen, reads = _Seen(), ()
        with contextlib.suppress(Unkeyable):
            if self._state(seen) is not None:
                reads = tuple((weakref.ref(t), t.data_ptr()) for t in seen.tensors)
        pinned = tuple(constants.pinned) if constants is not None else ()
        captured = _Graph(graph, inputs, output, key, reads, not seen.layouts, pinned, settled)
        self.graphs[key] = captured  # in place of one captured before kernels built since
        while len(self.graphs) > self.max_graphs:
            self._forget_latest(self.graphs.popitem(last=False)[1])
        return captured

    def _forget_latest(self, graph: _Graph) -> None:
        """``graph`` is dropped: no call replays it early. In place: a Diffusers hook registered on the module
        after us copied our attributes, this very dict among them (``functools.update_wrapper`` copies the
        wrapped forward's ``__dict__``), so a new dict would leave the old, and each graph in it, alive."""
        for call in [call for call, kept in self.latest.items() if kept is graph]:
            del self.latest[call]

    def _record(self, forward, args: tuple, kwargs: dict, mode: contextlib.AbstractContextManager):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory.pool, capture_error_mode="thread_local"), mode:
            output = forward(*args, **kwargs)
        return graph, output

    def _replay(self, graph: _Graph, leaves: list[Any]) -> Any:
        memory, known = self.memory, _known_hooks_only(self.module)
        with memory.lock:
            if self.hooks is not None:
                self.hooks.before_replay()
            for static, leaf in zip(graph.inputs, leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    if known and memory.holds(static, leaf):
                        self.inputs_in_place += 1
                    elif static is not leaf:
                        static.copy_(leaf)
            memory.forget()  # the replay may write any of the pool's memory
            graph.graph.replay()
            self.replays += 1
            statics, spec = pytree.tree_flatten(graph.output)
            copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in statics]
            if known:
                memory.copied_out(statics, copies)
            return pytree.tree_unflatten(copies, spec)

    def stats(self) -> dict[str, Any]:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "early_replays": self.early_replays,
            "early_misses": self.early_misses,
            "inputs_in_place": self.inputs_in_place,
            "graphs": len(self.graphs),
            "eager": dict(self.eager),
        }


def _plain_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with a version counter even under inference mode: graphs keyed apart by the mode may share
    it (``static_inputs``), and a call outside inference mode must be able to write it."""
    with torch.inference_mode(False):
        return tensor.clone()


def static_inputs(leaves: list[Any], kept: list[list[Any]], memory: GraphMemory | None = None) -> list[Any]:
    """The memory a new graph reads its argument leaves from: for each tensor, the graph memory that holds
    it (``memory``: see ``GraphMemory``), else the static input of a kept graph (``kept``: their inputs) at
    the same position with the same shape, dtype, device and strides, else a copy; never one memory for two
    arguments. Graphs of one ``StepGraphs`` replay one after another, each after copying its call's
    arguments in, so they may share it (a block's graph per step-cache decision, a graph per LoRA scale)."""
    inputs, taken = [], set()
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            inputs.append(leaf)
            continue
        held = memory.holding(leaf) if memory is not None else None
        if held is None or id(held) in taken:
            shared = (
                other[index]
                for other in kept
                if index < len(other) and _same_layout(other[index], leaf) and id(other[index]) not in taken
            )
            held = next(shared, None)
        inputs.append(_plain_clone(leaf) if held is None else held)
        taken.add(id(inputs[-1]))
    return inputs


def _same_layout(static: Any, leaf: torch.Tensor) -> bool:
    return (
        isinstance(static, torch.Tensor)
        and static.shape == leaf.shape
        and static.dtype == leaf.dtype
        and static.device == leaf.device
        and static.stride() == leaf.stride()
    )


def _refused_copy(exc: BaseException | None) -> bool:
    """Whether a capture failed on a copy from pageable host memory (maybe under the error its end raised)."""
    while exc is not None:
        if REFUSED_COPY in str(exc):
            return True
        exc = exc.__context__
    return False


def _first_line(exc: Exception) -> str:
    """An exception as one short line for ``describe``'s counters (the log has it whole)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _unpickle(module: nn.Module, inner: Any, max_graphs: int, enabled: bool, hooks: Any) -> StepGraphs:
    graphs = StepGraphs(module, max_graphs, hooks)
    graphs.inner, graphs.enabled = inner, enabled
    return graphs


_STEP = threading.local()  # the step in flight that its whole-step graph declined for hooks (its state)


@contextlib.contextmanager
def _hooked_step(state: Hashable):
    outer = getattr(_STEP, "hooked", None)
    _STEP.hooked = (state,)
    try:
        yield
    finally:
        _STEP.hooked = outer


def _known_hooks_only(module: nn.Module) -> bool:
    """Every hook on ``module`` is Diffusers' or ours. Those make new tensors and write in place only
    through PyTorch ops, which move the version counters ``GraphMemory`` reads; a user's hook might write
    an output in place through ``.data`` or a raw kernel launch, which do not."""
    registry = module.__dict__.get("_diffusers_hook")
    hooks = registry.hooks.values() if registry is not None else ()
    return not has_foreign_torch_hooks(module) and all(
        type(hook).__module__.startswith(("diffusers.", "omni_accel.")) for hook in hooks
    )


class GraphMemory:
    """The memory of a ``StepGraphs``' graphs, or of every block's of a transformer (``BlockGraphs``): its
    pool (blocks replay one after another, each output copied out, so a graph's intermediates may reuse
    the memory of the block's before it), and what the graphs' outputs hold between replays.

    A step passes each block's output on to the next block unchanged: the next graph reads it where the
    graph before wrote it (a graph captured with such an argument takes that memory as its static input)
    instead of having it copied in, for 28 MB fewer read and written per FLUX block at 1024x1024 under a step
    cache. Only the last replay's outputs are known: any replay may write any of the pool's memory (its
    intermediates may lie where a graph captured after it keeps its output), and a copy in or the replay
    that reads it writes the memory it goes to. And only where the output was not written since it was
    copied out (its version counter) and only Diffusers' hooks and ours ran on either block
    (``_known_hooks_only``)."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.lock = threading.Lock()  # what memory holds is checked and relied on under it
        # id(output memory) -> (that memory, the tensor the last replay copied it out to, its version)
        self._holds: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}

    def holds(self, memory: torch.Tensor, leaf: torch.Tensor) -> bool:
        """Whether ``memory`` holds exactly ``leaf``'s values: the last replay copied ``memory`` out to
        ``leaf``, and ``leaf`` was not written since."""
        held = self._holds.get(id(memory))
        return held is not None and held[0]() is memory and held[1]() is leaf and leaf._version == held[2]

    def holding(self, leaf: Any) -> torch.Tensor | None:
        """The output memory that holds exactly ``leaf``'s values (``holds``), or None."""
        if not isinstance(leaf, torch.Tensor):
            return None
        for memory_ref, _, _ in self._holds.values():
            memory = memory_ref()
            if memory is not None and self.holds(memory, leaf):
                return memory
        return None

    def copied_out(self, outputs: list[Any], copies: list[Any]) -> None:
        """A replay's ``outputs`` were copied out to ``copies``."""
        for memory, copied in zip(outputs, copies, strict=True):
            # a copy made under inference mode has no version counter: a write to it would leave no trace
            if isinstance(copied, torch.Tensor) and not copied.is_inference():
                self._holds[id(memory)] = (weakref.ref(memory), weakref.ref(copied), copied._version)

    def forget(self) -> None:
        """A replay will run (see the class docstring): no memory holds anything known."""
        self._holds.clear()

    def __deepcopy__(self, memo: dict) -> GraphMemory:
        return GraphMemory()

    def __reduce__(self):
        return GraphMemory, ()


class BlockGraphs(StepGraphs):
    """CUDA graphs of one repeated block, for the steps whose whole-step graph a hook declines: a step cache
    (FirstBlockCache, MagCache) hooks the blocks and decides on the host between them, so the step cannot be
    one graph; each block it computes can. Installed as the block's instance ``forward``, so a hook on the
    block wraps it and stays outside what is captured; a hook below the block makes the block run eagerly,
    counted, but TaylorSeer's on the attention modules the native math runs around: those decide before the
    block, and each decision has its graph (``_decided_call``). Off the hooked steps it is the block's plain
    forward: the whole-step graph captures and replays the blocks as they are."""

    def __init__(self, block: nn.Module, memory: GraphMemory, hooks: StepHooks | None = None) -> None:
        super().__init__(block, max_graphs=2, hooks=hooks, memory=memory)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling() or getattr(_STEP, "hooked", None) is None:
            return self._forward()(*args, **kwargs)
        around = _hooks_deciding_ahead(self.module)
        if around:
            return self._decided_call(around, args, kwargs)
        return super().__call__(*args, **kwargs)

    def _decided_call(self, around: list[nn.Module], args: tuple, kwargs: dict) -> Any:
        """A call of a block whose attention modules carry TaylorSeer's hook (which the native math runs
        around the attention part): the hooks decide first, so that each decision (which parts compute and
        which take the hooks' predictions, given as arguments) has its graph; the computed parts' outputs
        come back beside the block's and the hooks record them, as on Diffusers' modules."""
        decisions = [decide(module) for module in around]
        pattern = tuple(decision.computes for decision in decisions)
        predicted = tuple(decision.predicted for decision in decisions if not decision.computes)
        _AHEAD.decisions, _AHEAD.around = decisions, frozenset(around)
        try:
            result = super().__call__(*args, **kwargs, **{_DECIDED: (pattern, predicted)})
        except NotDecidedAhead:  # the block runs Diffusers' forward, which calls the hooks: they decide
            result = None
        finally:
            _AHEAD.decisions = _AHEAD.around = None
        if result is None:
            for decision in decisions:
                decision.undo()
            return super().__call__(*args, **kwargs)
        out, computed = result
        for decision, outputs in zip([d for d in decisions if d.computes], computed, strict=True):
            record(decision, outputs)
        return out

    def _step_forward(self) -> Callable[..., Any]:
        return functools.partial(_run_decided, self._forward())

    def __deepcopy__(self, memo: dict) -> BlockGraphs:
        twin = BlockGraphs(
            copy.deepcopy(self.module, memo),
            copy.deepcopy(self.memory, memo),
            copy.deepcopy(self.hooks, memo),
        )
        twin.inner, twin.enabled = copy.deepcopy(self.inner, memo), self.enabled
        return twin

    def __reduce__(self):
        return _unpickle_block, (self.module, self.inner, self.memory, self.enabled, self.hooks)

    def _begin_step(self) -> Hashable:
        return _STEP.hooked[0]  # the step's, read once by the transformer's graphs

    def _state(self, seen: _Seen | None = None) -> tuple | None:
        # A hook registered on the block after us wraps us; one that was there before is what we call.
        outside = self.inner is None or isinstance(self.inner, InstanceForward)
        decided = getattr(_AHEAD, "around", None) or frozenset()  # their hooks decided before the call
        return _module_state(self.module, seen, root_hooks_outside=outside, decided=decided)


_AHEAD = threading.local()  # the decisions of the block call in flight (``BlockGraphs._decided_call``)
_DECIDED = "_omni_accel_decided"  # the keyword that carries them into the forward a graph records


def _hooks_deciding_ahead(block: nn.Module) -> list[nn.Module]:
    """The submodules of ``block`` whose hooks the native math runs around its parts
    (``NativeBlock.hooks_around``), when every hook below the block is one of those."""
    hooks_around = getattr(block, "hooks_around", None)
    around = hooks_around() if hooks_around is not None else []
    if not around or hooked_submodule(block, around) is not None:
        return []
    return around


def _run_decided(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``; with the decisions of ``BlockGraphs._decided_call`` (``pattern``: which
    modules compute; ``predicted``: the others' outputs, in the graph's input memory when it is captured)
    it runs the math with each computed part's outputs kept and each predicted part served from
    ``predicted``, and returns ``(output, the computed parts' outputs)``."""
    decided = kwargs.pop(_DECIDED, None)
    if decided is None:
        return forward(*args, **kwargs)
    _, predicted = decided
    decisions: Sequence[Decision] = _AHEAD.decisions
    computed: list[Any] = [None] * sum(decision.computes for decision in decisions)
    calls, served, kept = {}, iter(predicted), iter(range(len(computed)))
    for decision in decisions:
        if decision.computes:
            calls[decision.module] = functools.partial(_keep, computed, next(kept))
        else:
            calls[decision.module] = functools.partial(_serve, next(served))
    with decided_calls(calls):
        out = forward(*args, **kwargs)
    return out, tuple(computed)


def _keep(computed: list[Any], index: int, compute: Callable[[], Any]) -> Any:
    computed[index] = compute()
    return computed[index]


def _serve(predicted: Any, compute: Callable[[], Any]) -> Any:
    return predicted


def _unpickle_block(
    module: nn.Module, inner: Any, memory: GraphMemory, enabled: bool, hooks: Any
) -> BlockGraphs:
    graphs = BlockGraphs(module, memory, hooks)
    graphs.inner, graphs.enabled = inner, enabled
    return graphs


def install_block_graphs(blocks: list[nn.Module], hooks: StepHooks | None) -> list[BlockGraphs]:
    """A ``BlockGraphs`` on every block of ``blocks`` (one transformer's, sharing their memory), installed."""
    memory = GraphMemory()
    installed = [BlockGraphs(block, memory, hooks) for block in blocks]
    for graphs in installed:
        graphs.install()
    return installed


def block_graph_stats(blocks: list[BlockGraphs]) -> dict[str, Any]:
    """``StepGraphs.stats`` summed over the blocks."""
    counts = ("captures", "replays", "graphs", "inputs_in_place")
    total: dict[str, Any] = {**dict.fromkeys(counts, 0), "eager": Counter()}
    for graphs in blocks:
        stats = graphs.stats()
        for name in counts:
            total[name] += stats[name]
        total["eager"].update(stats["eager"])
    return total


def _eager_reason(module: nn.Module, leaves: list[Any]) -> str | None:
    """Why this call cannot be served by a graph, or None."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors or any(not t.is_cuda or t.device != tensors[0].device for t in tensors):
        return "arguments not all on one CUDA device"
    if torch.cuda.is_current_stream_capturing():
        return "called inside someone else's CUDA graph capture"
    if torch.is_grad_enabled():
        return "autograd is enabled (pipelines call under torch.no_grad())"
    if global_hooks_active():
        return _HOOKED
    return _modes_reason()  # hooks on the module itself or below are found while its state is read (step_key)


def _modes_reason() -> str | None:
    """Why the modes active around a call keep it from a graph (a mode may change what each operator
    computes, and a replay runs no Python): any torch-function or dispatch mode but ours and a
    ``DeviceContext``, whose device the key holds."""
    ours = DeviceContext | CaptureConstants
    foreign = [type(mode).__name__ for mode in _modes() if not isinstance(mode, ours)]
    return f"{', '.join(foreign)} active around the call" if foreign else None


def _modes() -> list[Any]:
    """The torch-function and dispatch modes active on this thread (``torch.set_default_device`` keeps a
    ``DeviceContext`` there, which only picks where factory calls without a device put their tensors)."""
    return [
        *torch.overrides._get_current_function_mode_stack(),
        *torch.utils._python_dispatch._get_current_dispatch_mode_stack(),
    ]


_HOOKED = "hooks on the transformer or its submodules (a step cache, offload...) decide per call"
_COMPILE_BESIDE = "a background compile or kernel build runs in this process (no capture beside it)"


def step_key(
    module: nn.Module, leaves: list[Any], spec: pytree.TreeSpec, step_state: Hashable = None
) -> tuple | None:
    """Everything the host decides a forward with (see the module docstring), or None when a hook on the
    module or below decides per call; raises ``Unkeyable`` for state it cannot compare between calls."""
    call = _call_key(leaves, spec, step_state)
    state = _module_state(module)
    return None if state is None else (call, state)


def _call_key(leaves: list[Any], spec: pytree.TreeSpec, step_state: Hashable) -> tuple:
    """The key's part that is not the module's state: the arguments, the global switches, the step state."""
    return (spec, tuple(_argument(leaf) for leaf in leaves), _global_state(), step_state)


class _Seen:
    """What a walk of ``_module_state`` met: every tensor it keyed on, and whether a layout hook."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.layouts = False


class Unkeyable(TypeError):
    """A call's argument or a module's attribute whose value a key cannot name (fail closed: eager)."""


_PLAIN = frozenset(PLAIN_VALUES) - {enum.Enum}  # most attributes: found by type alone, before any isinstance


def _argument(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.device)
    if isinstance(leaf, PLAIN_VALUES):
        return leaf
    raise Unkeyable(f"an argument of type {type(leaf).__name__}")


# nn.Module's own bookkeeping (hooks are read by ``is_hooked``, tensors and children below) and ours (the
# runtime's state is the step state; layout hooks say what they decide through ``replay_key``).
# An instance ``_apply`` (ours: ``omni_accel.moves``) runs at moves, never in a forward.
_MODULE_INTERNALS = (frozenset(vars(nn.Module())) - {"training"}) | {
    "_diffusers_hook",
    "_hf_hook",
    "forward",
    "_apply",
}
_OURS = ("omni_", "_omni")


def _module_state(
    module: nn.Module,
    seen: _Seen | None = None,
    root_hooks_outside: bool = False,
    decided: frozenset[nn.Module] = frozenset(),
) -> tuple | None:
    """One walk over the modules per call: their identity, tensors and every other attribute's value (a
    processor's scale, an adapter's state, a flag: anything a call may change), or None at the first hook
    that may decide per call. An attribute whose value cannot be compared raises ``Unkeyable``. ``seen``
    collects what the walk met. ``root_hooks_outside``: the hooks on ``module`` itself wrap the graphs (they
    run around each call, not inside what is captured). ``decided``: modules whose hooks decided before
    the call (``BlockGraphs._decided_call``), outside what is captured.

    It runs before every replay (per block under a step cache), so it is written for host time: no module
    names are built (``nn.Module.modules`` builds each one's dotted name), and which attributes to read
    is looked up by the module's attribute names rather than worked out again (``_attributes_read``)."""
    state = []
    append = state.append
    visited = {id(module)}
    stack = [module]
    while stack:
        child = stack.pop()
        attrs = child.__dict__
        if is_hooked(child) and not (root_hooks_outside and child is module) and child not in decided:
            layout = _layout_hooks_state(child)
            if layout is None:
                return None
            append(layout)
            if seen is not None:
                seen.layouts = True
        append(id(child))
        for tensors in (attrs["_parameters"], attrs["_buffers"]):
            for tensor in tensors.values():
                if tensor is not None:
                    append((tensor.data_ptr(), tensor.dtype, tensor.shape))
                    if seen is not None:
                        seen.tensors.append(tensor)
        names = _attributes_read(attrs)
        if names:
            append(names)
            for name in names:
                value = attrs[name]
                append(value if type(value) in _PLAIN else _value(value, name, 0, seen))
        children = [sub for sub in attrs["_modules"].values() if sub is not None and id(sub) not in visited]
        visited.update(map(id, children))
        stack.extend(reversed(children))  # depth first, children in order, each module once
    return tuple(state)  # compared whole, not by a hash that could collide


def _attributes_read(attrs: dict) -> tuple[str, ...]:
    """The attributes of a module that its state reads, sorted: those besides nn.Module's bookkeeping and
    ours, looked up by the module's attribute names (modules of one class share them)."""
    keys = tuple(attrs)
    names = _ATTRIBUTES_READ.get(keys)
    if names is None:
        if len(_ATTRIBUTES_READ) >= 4096:
            _ATTRIBUTES_READ.clear()
        names = tuple(
            sorted(name for name in keys if name not in _MODULE_INTERNALS and not name.startswith(_OURS))
        )
        _ATTRIBUTES_READ[keys] = names
    return names


_ATTRIBUTES_READ: dict[tuple[str, ...], tuple[str, ...]] = {}


def _value(value: Any, where: str, depth: int = 0, seen: _Seen | None = None) -> Hashable:
    """``value`` as something that compares equal exactly when a call would see the same thing."""
    if isinstance(value, PLAIN_VALUES):
        return value
    if isinstance(value, nn.Module | type | types.FunctionType | types.BuiltinFunctionType):
        return id(value)  # a submodule is walked on its own; functions and classes are what they are
    if isinstance(value, torch.Tensor):
        if seen is not None:
            seen.tensors.append(value)
        return (value.data_ptr(), value.dtype, value.shape, value.stride())  # as a parameter's
    if isinstance(value, types.MethodType):
        return (id(value.__func__), id(value.__self__))
    if isinstance(value, tuple | list):
        return (type(value), tuple(_value(item, where, depth, seen) for item in value))
    if isinstance(value, set | frozenset):
        return (type(value), frozenset(_value(item, where, depth, seen) for item in value))
    if isinstance(value, Mapping):
        return (type(value), tuple((key, _value(item, where, depth, seen)) for key, item in value.items()))
    if isinstance(value, functools.partial):
        return (
            id(value.func),
            _value(value.args, where, depth, seen),
            _value(value.keywords, where, depth, seen),
        )
    if depth < _MAX_DEPTH and hasattr(value, "__dict__"):  # a plain object: a processor, a config...
        return (type(value), _value(vars(value), where, depth + 1, seen))
    raise Unkeyable(f"attribute {where!r} holds a {type(value).__name__}")


_MAX_DEPTH = 3


def _layout_hooks_state(module: nn.Module) -> tuple | None:
    """What the hooks on ``module`` decided for the call in flight when every one is a layout hook (it has
    ``replay_key``: it decides from shapes alone), else None."""
    attrs = module.__dict__
    registry = attrs.get("_diffusers_hook")
    if registry is None or has_foreign_torch_hooks(module):
        return None
    keys = []
    for name, hook in registry.hooks.items():
        replay_key = getattr(hook, "replay_key", None)
        if replay_key is None:
            return None
        keys.append((name, replay_key()))
    return tuple(keys)


def _global_state() -> tuple:
    """The process-wide switches a step's kernels are picked by: autocast, reduced-precision matmuls, which
    SDPA kernels PyTorch may use, determinism, inference mode, the default dtype and device (what factory
    calls in the forward make), an ``attention_scope`` and Diffusers' attention backend.
    Kernels built since a capture are not part of the key: its graph computes the same function with what
    served while they were built, and is captured anew at the first call where a capture may run
    (``kernel_builds.settled``)."""
    cuda = torch.backends.cuda
    return (
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        float32_precision(),
        cuda.matmul.allow_bf16_reduced_precision_reduction,
        cuda.matmul.allow_fp16_reduced_precision_reduction,
        getattr(cuda.matmul, "allow_fp16_accumulation", None),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        # a graph captured in inference mode holds inference tensors, which no call outside it may write
        torch.is_inference_mode_enabled(),
        torch.get_default_dtype(),
        tuple(mode.device for mode in _modes() if isinstance(mode, DeviceContext)),
        current_scope(),
        _AttentionBackendRegistry._active_backend,
    )
