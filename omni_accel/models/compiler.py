"""``compile=True`` for the native blocks' math: compiled at the first call, or beside the running pipeline.

A compiled first call traces and compiles each block function, and the first image waits for it: seconds
of host work even with a warm on-disk cache (FLUX.1-dev on an H200: 8.1 s from ``accelerate`` to the first
image against 3.6 s for a warm one, docs/PERFORMANCE.md). In the background mode (the default on one
device) a call whose compiled code is not ready runs the eager math, the same fused kernels, while a worker
thread compiles ahead of time (``aot_compile``: traced with fake tensors, nothing runs on the device).
Finished code is switched in at the next step boundary, so the blocks of one step run one generation of code.
A new input shape does the same: it runs eagerly until its code is ready where torch.compile would stop to
recompile. Eager and compiled blocks agree to rounding, not bitwise: an image made while the switch
happens is as accurate as either, but not bitwise the image of a run that switched at another step
(``compile_in_background=False`` compiles at the first call, and every step runs compiled).

Under a parallel layout the ranks must run the same code at every step, so the compile waits (as in the
first-call mode) whatever the option says; so does ``fullgraph=False``, which ahead-of-time compilation
cannot serve.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..utils.logging import get_logger

logger = get_logger(__name__)

# Compiled variants kept per block function (one per input shape); torch.compile's own limit is 8 too.
MAX_VARIANTS = 8
# One background compile at a time in the process: tracing keeps process-wide state (torch.fx's patcher).
_COMPILING = threading.Lock()


@dataclass
class _Variants:
    """The compiled code of one block function, one variant per input signature."""

    active: list[Any] = field(default_factory=list)  # AOT-compiled functions the math dispatches to
    ready: list[Any] = field(default_factory=list)  # compiled, switched in at the next step boundary
    compiling: bool = False
    error: BaseException | None = None  # raised at the next step boundary
    failed: str | None = None  # after the error was raised: runs eagerly, described
    capped: bool = False
    compiled_calls: int = 0
    eager_calls: int = 0


class BlockCompiler:
    """Compiles the block functions of one accelerated transformer (see the module docstring)."""

    def __init__(self, options: Mapping[str, Any], background: bool = True) -> None:
        self.options = dict(options)
        self.background = background and self.options.get("fullgraph", True) is not False
        self.generation = 0  # advances whenever compiled code is switched in
        self._first_call: dict[Callable, Callable] = {}
        self._variants: dict[Callable, _Variants] = {}
        self._lock = threading.Lock()
        self._pending = False  # compiled code or an error is waiting for a step boundary
        self._threads: list[threading.Thread] = []
        self._ordinals: dict[str, int] = {}
        self._last_ordinal = -1

    def math(self, fn: Callable, caller: str, *, background: bool = True) -> Callable:
        """What a block named ``caller`` runs for ``fn``. Blocks run in the same order every step, so a
        block at or before the last one seen starts a step: that is where finished code is switched in."""
        if not (self.background and background and _has_aot_compile()):
            return self._compiled_at_first_call(fn)
        ordinal = self._ordinals.setdefault(caller, len(self._ordinals))
        if ordinal <= self._last_ordinal:
            self.begin_step()
        self._last_ordinal = ordinal
        variants = self._variants.get(fn) or self._variants.setdefault(fn, _Variants())

        def dispatch(*args: Any) -> Any:
            for compiled in variants.active:
                if compiled.guard_check(*args):
                    variants.compiled_calls += 1
                    return compiled.fn(*args)
            variants.eager_calls += 1
            self._submit(fn, variants, args)
            return fn(*args)

        return dispatch

    def begin_step(self) -> int:
        """Switches in the code finished since the last step once no compile is in flight (so the blocks of
        one step run one generation of code); returns that generation (CUDA graphs key on it). Not while a
        graph captures: a compiled function's first run tunes its kernels, which a capture cannot hold."""
        if not self._pending or _capturing():
            return self.generation
        with self._lock:
            if any(variants.compiling for variants in self._variants.values()):
                return self.generation
            self._pending = False
            failures = []
            if any(variants.ready for variants in self._variants.values()):
                self.generation += 1
            for fn, variants in self._variants.items():
                variants.active.extend(variants.ready)
                variants.ready.clear()
                if variants.error is not None:
                    failures.append((fn, variants.error))
                    variants.failed, variants.error = _reason(variants.error), None
        if failures:
            fn, error = failures[0]
            raise RuntimeError(
                f"compile=True: compiling {fn.__name__} in the background failed ({_reason(error)}). Its blocks "
                "run eagerly from now on; pass compile_in_background=False to see the error at the first call, "
                "or compile=False."
            ) from error
        return self.generation

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every compile started so far has finished (its code is used from the next step)."""
        for thread in list(self._threads):
            thread.join(timeout)

    def summary(self) -> list[str]:
        """One line per block function, for ``describe``."""
        lines = []
        for fn, variants in self._variants.items():
            state = (
                f"{len(variants.active)} input shape(s) compiled, {variants.compiled_calls} calls ran compiled, "
                f"{variants.eager_calls} eagerly"
            )
            if variants.ready:
                state += f", {len(variants.ready)} ready for the next step"
            if variants.compiling:
                state += ", compiling another (its calls run eagerly meanwhile)"
            if variants.failed:
                state += f", compile failed, runs eagerly: {variants.failed}"
            if variants.capped:
                state += f", further shapes run eagerly (at most {MAX_VARIANTS} are kept)"
            lines.append(f"{fn.__name__}: {state}")
        lines += [f"{fn.__name__}: compiled at its first call per input shape" for fn in self._first_call]
        return lines

    def _compiled_at_first_call(self, fn: Callable) -> Callable:
        compiled = self._first_call.get(fn)
        if compiled is None:
            logger.warning(  # shown by default: a long first call should not look like a hang
                "compiling %s: its first call per input shape compiles (seconds to a minute; cached on disk)",
                fn.__name__,
            )
            compiled = self._first_call[fn] = torch.compile(fn, **self.options)
        return compiled

    def _submit(self, fn: Callable, variants: _Variants, args: tuple) -> None:
        with self._lock:
            if variants.compiling or variants.failed or variants.error is not None or variants.ready:
                return
            if len(variants.active) >= MAX_VARIANTS:
                if not variants.capped:
                    variants.capped = True
                    logger.warning(
                        "%s: %d input shapes compiled; further shapes run eagerly", fn.__name__, MAX_VARIANTS
                    )
                return
            variants.compiling = True
        logger.warning(  # shown by default: says why the first steps are not yet compiled
            "compiling %s in the background: its calls run eagerly until the code is ready (seconds; cached on "
            "disk)",
            fn.__name__,
        )
        thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._compile, fn, variants, args, _ThreadState.of_caller(args)),
            name=f"omni_accel-compile-{fn.__name__}",
        )  # not a daemon: an interpreter exiting mid-compile waits for it instead of aborting
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _compile(self, fn: Callable, variants: _Variants, args: tuple, state: _ThreadState) -> None:
        try:
            with _COMPILING, contextlib.ExitStack() as stack:
                state.enter(stack)
                options = {**self.options, "fullgraph": True}
                compiled = torch.compile(fn, **options).aot_compile((args, {}))
        except BaseException as exc:  # raised at the next step boundary, in the caller's thread
            with self._lock:
                variants.error, variants.compiling, self._pending = exc, False, True
            return
        with self._lock:
            variants.ready.append(compiled)
            variants.compiling, self._pending = False, True
        logger.info("%s compiled in the background; used from the next step", fn.__name__)


@dataclass(frozen=True)
class _ThreadState:
    """The calling thread's torch state that Dynamo's guards check, to be set in the worker thread."""

    grad: bool
    inference: bool
    device: torch.device | None

    @classmethod
    def of_caller(cls, args: tuple) -> _ThreadState:
        tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        device = tensors[0].device if tensors and tensors[0].is_cuda else None
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), device)

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.inference:  # first: inference mode sets the grad mode too
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        if self.device is not None:  # a stream of its own: nothing it launches meets a graph being captured
            stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.cuda.stream(torch.cuda.Stream(self.device)))


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@functools.cache
def _has_aot_compile() -> bool:
    if hasattr(torch.compile(_identity, fullgraph=True), "aot_compile"):
        return True
    logger.warning(
        "compiling in the background needs torch.compile(...).aot_compile (newer torch); "
        "compiling at the first call instead"
    )
    return False


def _identity(x: Any) -> Any:
    return x


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
