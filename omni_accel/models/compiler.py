"""``compile=True`` for the native blocks' math: compiled at the first call, or beside the running pipeline.

A compiled first call traces and compiles each block function, and the first image waits for it: seconds
of host work even with a warm on-disk cache (docs/archive/performance-history.md). In the background mode (``compile_in_background=True``, on
one device) the first steps run the eager math, the same fused kernels, and a worker thread compiles each
block function by calling it once per input shape the eager steps met, up to ``_SHAPES_COMPILED_AHEAD``
(on the caller's stream, the results thrown away; block math never writes to its inputs): Z-Image's
refiners and main layers run one block function at three shapes a step, and with the first shape alone
compiled the others compiled in the call that met them after the switch (2.4 s of a fresh machine's step
on an H100). The compile starts after the first step (whose
one-time work it slowed 3-4x when beside it), and with CUDA graphs only once a step has been captured, so
that it runs beside replays: eager steps beside it ran 5-10x slower, since each operator waits for the GIL.
A capture never runs beside it (the worker's run of the compiled code then fails with "operation not
permitted when stream is capturing"). The compiled code is switched in at a step boundary once no compile
is in flight, so the blocks of one step run one kind of code. Eager and compiled blocks agree to rounding,
not bitwise: an image made while the switch happens is as accurate as either, but not bitwise the image of
a run that switched at another step (``compile_in_background=False`` compiles at the first call, and every
step runs compiled). Shapes met later recompile at their first call, each into static code of its own
(``dynamic=False`` unless the options say otherwise; torch's limit of 8 compiled variants per block
function then applies, beyond which a block runs its eager math).

Not the default: torch.compile saves process-wide state when a compile starts (torch's CPU and CUDA random
state, the deterministic-algorithms flag, the default dtype, the matmul precision; Python's ``random`` state
in its frame evaluation) and restores it when it ends, so what another thread set meanwhile is undone: a
``torch.manual_seed`` before building a model or before a pipeline call without a generator, a
``torch.use_deterministic_algorithms`` switch (``tests/test_compile.py`` shows it; pytorch issue 111569 is
the thread-safety of this state). A GPU run of many pipelines beside background compiles gave wrong images
that way: models built with a seeded random init got other weights.

Under a parallel layout the ranks must run the same code at every step, so the compile waits (as in the
first-call mode) whatever the option says.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import background
from ..capture_constants import outside_capture_constants
from ..utils.logging import get_logger
from ..utils.values import PLAIN_VALUES
from .complex_products import RealComplexProducts

if TYPE_CHECKING:
    from ..layers.fp8 import Fp8Weights

logger = get_logger(__name__)


@dataclass
class _Function:
    """One block function: its compiled version and where the background compile of it stands."""

    at_first_call: bool = False  # compiled where first called (no background), as torch.compile does
    compiled: Callable | None = None  # in the background made by the worker, off the steps' path
    # per input signature, a call's arguments, state and tensor layout, and the first one's context:
    # compiled together
    queued: dict[Hashable, tuple] = field(default_factory=dict)
    compiling: bool = False
    ready: bool = False  # compiled, switched in at the next step boundary
    active: bool = False  # the blocks call ``compiled``
    error: BaseException | None = None  # raised at the next step boundary
    failed: str | None = None  # after the error was raised: runs eagerly, described
    over_limit: int = 0  # calls run eagerly: Dynamo's recompile limit for the function was reached
    eager_calls: int = 0
    compiled_calls: int = 0
    # perf_counter() when its worker started (it may first wait for another function's compile) and ended
    window: tuple[float, float] | None = None

    def queue(self, args: tuple, kwargs: dict) -> None:
        """Keeps the arguments of a call whose input signature is new, up to ``_SHAPES_COMPILED_AHEAD``."""
        if len(self.queued) >= _SHAPES_COMPILED_AHEAD:
            return
        signature = _signature(args, kwargs)
        if signature not in self.queued:
            state = _CallerState.of((args, kwargs))
            layout = _layout((args, kwargs))
            self.queued[signature] = (args, kwargs, state, layout, contextvars.copy_context())


class BlockCompiler:
    """Compiles the block functions of one accelerated transformer (see the module docstring)."""

    def __init__(
        self, options: Mapping[str, Any], background: bool = True, raise_failures: bool = True
    ) -> None:
        # Static code for every input shape unless the user says otherwise: torch.compile's automatic
        # dynamic shapes would compile the second shape it meets as a dynamic-shape graph, whose kernels
        # are slower (docs/archive/performance-history.md).
        self.options = _with_graph_passes({"dynamic": False, **options})
        self.background = background
        # False: a failed background compile is logged and its blocks run eagerly (compiles nobody asked for)
        self.raise_failures = raise_failures
        self.generation = 0  # advances whenever compiled code is switched in
        self._functions: dict[Callable, _Function] = {}
        self._lock = threading.Lock()
        self._pending = False  # compiled code or an error waits for a step boundary
        self._threads: list[threading.Thread] = []
        self._ordinals: dict[str, int] = {}
        self._last_ordinal = -1

    def math(self, fn: Callable, caller: str, *, background: bool = True) -> Callable:
        """What a block named ``caller`` runs for ``fn``. Blocks run in the same order every step, so a
        block at or before the last one seen starts a step: that is where finished code is switched in."""
        background = self.background and background
        function = self._functions.get(fn) or self._function(fn, background)
        if not background:
            return function.compiled
        ordinal = self._ordinals.setdefault(caller, len(self._ordinals))
        if ordinal <= self._last_ordinal:
            self.begin_step()
            self.start_compiles()
        self._last_ordinal = ordinal
        if function.active:
            return function.compiled

        def eager_meanwhile(*args: Any, **kwargs: Any) -> Any:
            # Locked: another thread's step boundary may start the compile between the check and the queueing
            # (``_start_queued``), which left the arguments queued for a second compile of the function.
            with self._lock:
                function.eager_calls += 1
                # not once compiling, compiled (``active`` too: another thread's step switched it in since
                # this eager math was handed out) or failed (``error`` until the step boundary reports it)
                done = function.ready or function.active or function.failed or function.error is not None
                if not (function.compiling or done):
                    function.queue(args, kwargs)
            return fn(*args, **kwargs)

        return eager_meanwhile

    def begin_step(self) -> int:
        """Switches in the code compiled since the last step once no compile is in flight; returns the
        generation of the code the step runs (CUDA graphs key on it)."""
        if self._pending and not _capturing():
            self._switch()
        return self.generation

    @property
    def compiling(self) -> bool:
        """A compile is running: CUDA graphs must not capture (the worker's first run of the compiled code
        beside a capture failed with "operation not permitted when stream is capturing" on an H200)."""
        return any(f.compiling for f in list(self._functions.values()))

    def start_compiles(self) -> None:
        """Starts the compiles queued by earlier eager calls. Called at the start of an eager step, or
        (with CUDA graphs) before a replay: the eager step captured before it then replays at full speed
        while the worker compiles, where eager steps beside the worker ran 5-10x slower (their every
        operator waits for the GIL). Not in an eager step a capture waits to follow
        (``background.capture_waits``): the compile would hold that capture off."""
        if not _capturing() and not background.capture_waiting():
            self._start_queued()

    def drop_moved(self) -> None:
        """The model moved (``omni_accel.moves``): the queued calls whose tensors no longer have the layout
        they had are dropped now (their compile would stop as stale: ``_build``), rather than keep the old
        activations and weights alive, on the GPU they were on, until the next call starts the compiles.
        The next eager calls queue the model's arguments as they are then."""
        with self._lock:
            for function in self._functions.values():
                for signature, call in list(function.queued.items()):
                    if _layout(call[:2]) != call[3]:
                        del function.queued[signature]

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every compile started so far has finished (its code is used from the next step)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)

    def calls(self) -> dict[str, tuple[int, int]]:
        """Per block function, its calls that ran eagerly and compiled (background mode)."""
        return {fn.__qualname__: (f.eager_calls, f.compiled_calls) for fn, f in list(self._functions.items())}

    def windows(self) -> dict[str, tuple[float, float]]:
        """Per block function compiled in the background, ``time.perf_counter()`` when its worker started
        (compiles run one at a time: it may first wait for another) and when its compiled code was ready."""
        return {fn.__qualname__: f.window for fn, f in list(self._functions.items()) if f.window is not None}

    def failures(self) -> dict[str, str]:
        """Per block function whose compile failed (its blocks run eagerly, or will from the next step once
        the error is raised there), the failure on one line."""
        return {
            fn.__qualname__: _one_line(f.failed if f.failed is not None else _reason(f.error))
            for fn, f in list(self._functions.items())
            if f.failed is not None or f.error is not None
        }

    def summary(self) -> list[str]:
        """One line per block function, for ``describe``."""
        lines = []
        for fn, function in list(self._functions.items()):  # other threads may add to it
            lines.append(self._line(fn, function))
            if function.over_limit:
                lines.append(
                    f"{fn.__qualname__}: {function.over_limit} calls ran eagerly: Dynamo's recompile limit "
                    "(torch._dynamo.config.recompile_limit) was reached for this block class in the process"
                )
        return lines

    @staticmethod
    def _line(fn: Callable, function: _Function) -> str:
        if function.at_first_call:
            state = (
                f"compile failed, runs eagerly: {_one_line(function.failed)}"
                if function.failed
                else "compiled"
            )
            return f"{fn.__qualname__}: {state} at its first call per input shape"
        state = "compiled" if function.active else "compiling" if function.compiling else "not yet compiled"
        if function.ready:
            state = "compiled, switched in at the next step"
        if function.error is not None:
            state = f"compile failed, raised at the next step, then runs eagerly: {_one_line(_reason(function.error))}"
        if function.failed:
            state = f"compile failed, runs eagerly: {_one_line(function.failed)}"
        took = f" in {function.window[1] - function.window[0]:.1f} s" if function.window else ""
        return (
            f"{fn.__qualname__}: {state} in the background{took} ({function.eager_calls} calls ran eagerly "
            f"before, {function.compiled_calls} compiled)"
        )

    def _function(self, fn: Callable, background: bool) -> _Function:
        with self._lock:
            if fn not in self._functions:
                function = _Function(at_first_call=not background)
                if not background:
                    compiled = torch.compile(fn, **self.options)  # kept only once it is made
                    function.compiled = _or_eager(compiled, fn, function, self.raise_failures)
                    logger.warning(  # shown by default: a long first call should not look like a hang
                        "compiling %s: its first call per input shape compiles (seconds to a minute; cached on "
                        "disk)",
                        fn.__qualname__,
                    )
                self._functions[fn] = function
            return self._functions[fn]

    def _switch(self) -> None:
        with self._lock:
            if self.compiling:
                return
            self._pending = False
            failed = [(fn, f.error) for fn, f in self._functions.items() if f.error is not None]
            ready = [f for f in self._functions.values() if f.ready]
            for function in ready:
                function.ready, function.active = False, True
            self.generation += bool(ready)
            for fn, error in failed:
                self._functions[fn].failed, self._functions[fn].error = _reason(error), None
        if failed and not self.raise_failures:
            for fn, error in failed:
                logger.warning(
                    "%s failed to compile; its blocks run eagerly: %s", fn.__qualname__, _reason(error)
                )
        elif failed:
            fn, error = failed[0]
            raise RuntimeError(
                f"compile=True: {fn.__qualname__} in the background failed to compile, so its blocks run eagerly from "
                "now on (pass compile_in_background=False to see the error at the first call, or compile=False): "
                f"{_reason(error)}"
            ) from error

    def _start_queued(self) -> None:
        with self._lock:  # pipelines may be called from several threads
            queued = [(fn, f, list(f.queued.values())) for fn, f in self._functions.items() if f.queued]
            for _, function, _ in queued:
                function.queued, function.compiling = {}, True
            # started and listed under the lock: two threads listing at once each dropped the other's
            # thread (``wait`` returned while it compiled), as would one not yet started (not alive)
            for fn, function, calls in queued:
                logger.warning(  # shown by default: says why the first steps are not yet compiled
                    "compiling %s in the background: its calls run eagerly until the code is ready (seconds; "
                    "cached on disk)",
                    fn.__qualname__,
                )
                thread = self._worker(fn, function, calls)
                thread.start()
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _worker(self, fn: Callable, function: _Function, calls: list[tuple]) -> threading.Thread:
        context = calls[0][4]  # the first call's: what the compile runs in
        return threading.Thread(
            target=context.run,
            args=(self._compile, fn, function, [call[:4] for call in calls]),
            name=f"omni_accel-compile-{fn.__qualname__}",
        )  # not a daemon: an interpreter exiting mid-compile waits for it instead of aborting

    def _compile(self, fn: Callable, function: _Function, calls: list[tuple]) -> None:
        start = time.perf_counter()
        try:
            compiled = self._build(fn, calls, self.options)
        except _Stale:  # not a failure: the next eager calls queue the model's arguments as they are now
            with self._lock:
                function.compiling = False
            logger.info(
                "%s: the model changed since its calls were queued; it compiles from the next calls",
                fn.__qualname__,
            )
            return
        except BaseException as exc:  # raised at the next step boundary, in the caller's thread
            with self._lock:
                function.error, function.compiling, self._pending = exc, False, True
            return
        with self._lock:
            function.window = (start, time.perf_counter())
            function.compiled = _or_eager(_counted(compiled, function), fn, function, self.raise_failures)
            function.ready, function.compiling, self._pending = True, False, True
        logger.info("%s compiled in the background; used from the next step", fn.__qualname__)

    @staticmethod
    def _build(fn: Callable, calls: list[tuple], options: dict) -> Callable:
        """``torch.compile(fn)``, compiled by calling it once per ``(args, kwargs, state, layout)`` in that
        state. Raises ``_Stale`` where the tensors the arguments reach no longer have the ``layout`` they had
        when queued (``pipe.to(torch.float64)`` or a LoRA loaded since: the arguments mix the old activations
        with the new weights, and their run would fail as no call of the model does)."""
        with background.LOCK:
            compiled = torch.compile(fn, **options)
            for args, kwargs, state, layout in calls:
                with contextlib.ExitStack() as stack:
                    state.enter(stack)
                    try:
                        if _layout((args, kwargs)) == layout:
                            compiled(*args, **kwargs)
                    finally:  # before the run or while it ran, whatever it raised
                        if _layout((args, kwargs)) != layout:
                            raise _Stale
        return compiled


class CompiledSteps:
    """The CUDA graphs' ``StepHooks`` (see ``omni_accel.cuda_graphs``) of a runtime whose blocks a
    ``BlockCompiler`` (its ``compiler``, or None) compiles: compiled code is switched in between steps, no
    capture runs beside a compile, and replays start the queued compiles."""

    compiler: BlockCompiler | None
    fp8: Fp8Weights | None  # the e4m3 weight copies under quantize="fp8"

    def begin_step(self) -> tuple[int, int]:
        """The generations of the compiled code and of the e4m3 copies (a graph reads a copy where it was
        when captured: one forgotten since may be made again elsewhere)."""
        compiled = 0 if self.compiler is None else self.compiler.begin_step()
        return compiled, 0 if self.fp8 is None else self.fp8.generation

    def step_eager_reason(self) -> str | None:
        """Why this step must run eagerly (not from a graph), or None."""
        return None

    def may_capture(self) -> bool:
        return self.compiler is None or not self.compiler.compiling

    def before_replay(self) -> None:
        if self.compiler is not None:
            self.compiler.start_compiles()

    def drop_moved(self) -> None:
        """The model moved (``omni_accel.moves``): see ``BlockCompiler.drop_moved``."""
        if self.compiler is not None:
            self.compiler.drop_moved()


def _with_graph_passes(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with our inductor passes added (``complex_products``), where inductor compiles and the
    options leave room: torch.compile takes a ``mode`` or ``options``, not both; a pass of the user's own
    in the same slot is kept instead."""
    if options.get("backend", "inductor") != "inductor" or "mode" in options:
        return options
    passes = {"post_grad_custom_pre_pass": RealComplexProducts()}
    return {**options, "options": {**passes, **(options.get("options") or {})}}


def _or_eager(compiled: Callable, fn: Callable, function: _Function, raise_failures: bool) -> Callable:
    """``compiled``, where a call past Dynamo's recompile limit (its cache of compiled versions per code
    object is shared with every compile of the same block class in the process) runs ``fn`` eagerly alone,
    whoever asked for the compile: the versions compiled before keep serving the inputs they were compiled
    for. Unless ``raise_failures``, ``fn`` as well from the first call that ``compiled`` fails (logged; the
    compile nobody asked for must not fail the call); an error ``fn`` raises too is the caller's own, raised
    as it is."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if function.failed is not None:
            return fn(*args, **kwargs)
        try:
            return outside_capture_constants(compiled, *args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            out = fn(*args, **kwargs)
            if not function.over_limit:
                logger.warning(_OVER_LIMIT + ": %s", fn.__qualname__, _reason(error))
            function.over_limit += 1
            return out
        except Exception as error:
            if raise_failures:
                raise
            out = fn(*args, **kwargs)
            function.failed = _reason(error)
            logger.warning(
                "%s failed to compile; its blocks run eagerly: %s", fn.__qualname__, function.failed
            )
            return out

    return run


_OVER_LIMIT = (
    "%s: Dynamo's recompile limit was reached (torch._dynamo.config.recompile_limit, counted over every compile of "
    "this block class in the process), so calls needing another compiled version run eagerly"
)


def _counted(compiled: Callable, function: _Function) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        function.compiled_calls += 1
        return outside_capture_constants(compiled, *args, **kwargs)

    return run


@dataclass(frozen=True)
class _CallerState:
    """The calling thread's state the compiled code depends on (Dynamo guards the grad mode), to be set in
    the worker thread; on CUDA also the caller's device and stream, so the worker's run of the compiled code
    is ordered after the arguments were made and before their memory is used again."""

    grad: bool
    inference: bool
    stream: torch.cuda.Stream | None

    @classmethod
    def of(cls, args: Any) -> _CallerState:
        tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        stream = torch.cuda.current_stream(tensors[0].device) if tensors and tensors[0].is_cuda else None
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), stream)

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.inference:  # first: inference mode sets the grad mode too
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        if self.stream is not None:
            stack.enter_context(torch.cuda.device(self.stream.device))
            stack.enter_context(torch.cuda.stream(self.stream))


# Input shapes of one block function compiled before its switch; Dynamo's recompile limit (8 by default,
# counted over every compile of the block class in the process) keeps room for later resolutions.
_SHAPES_COMPILED_AHEAD = 4


def _signature(args: tuple, kwargs: dict) -> Hashable:
    """What tells calls apart for a static compile: each tensor's shape, strides, dtype, device and grad
    flag, each plain value (Dynamo specializes on it), a module's structure (the generic tier's block: SD3's
    last one, ``context_pre_only``, has other submodules and compiles a graph of its own) and the type of
    anything else (an object passed to every block alike, whose identity must not make each block's call
    look new)."""
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    parts: list[Hashable] = [spec]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, PLAIN_VALUES):
            parts.append((type(leaf), leaf))
        elif isinstance(leaf, torch.nn.Module):
            parts.append((tuple(type(module) for module in leaf.modules()), _layout(leaf)))
        else:
            parts.append(type(leaf))
    return tuple(parts)


class _Stale(Exception):
    """The model changed between a call and the background compile of its arguments."""


def _layout(value: Any) -> tuple:
    """The dtype, device and shape of every tensor ``value`` reaches: in containers, dataclasses (a
    ``LinearWeights``) and modules (a generic block's parameters and buffers). Parameters keep their
    identity when ``Module.to`` or a LoRA changes them, so a queued call sees those changes here."""
    found: list[tuple] = []
    for leaf in torch.utils._pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append((leaf.dtype, leaf.device, tuple(leaf.shape)))
        elif isinstance(leaf, torch.nn.Module):
            found.append(_layout([*leaf.parameters(), *leaf.buffers()]))
        elif is_dataclass(leaf) and not isinstance(leaf, type):
            found.append(_layout([getattr(leaf, f.name) for f in fields(leaf)]))
    return tuple(found)


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _one_line(reason: str, limit: int = 400) -> str:
    """``reason`` as one line of ``describe``: torch's errors run over many lines (a graph break's
    explanation and user code, a backend's own error under its wrapper, advice on logging), which split the
    report's line in the middle. The whole error is raised with its traceback (at the next step boundary,
    or at the first call with ``compile_in_background=False``)."""
    lines = (line.strip() for line in reason.splitlines())
    text = " ".join(line for line in lines if line and not line.startswith("Set TORCHDYNAMO_VERBOSE"))
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
