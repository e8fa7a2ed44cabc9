"""Kernels compiled on their first use, built in the background while something else serves.

Two kinds. FlashInfer JIT-compiles an attention kernel the first time a process plans it (over a minute with
a cold disk cache: docs/PERFORMANCE.md, "First call"); the call asking for it is served by the next provider
in ``auto``'s order (cuDNN) while ``ready`` builds it. Triton compiles each of our kernels the first time a
process launches it with a new specialization (0.1-0.5 s each with a cold disk cache); the launch is served by
the op's PyTorch reference while ``compiled`` builds it (``utils/triton_builds.py``). Either way a first call
never waits for a compiler, which would break the rule that it costs at most two warm ones.

Once a build is done, ``generation()`` moves on, which every cached resolution reads, so the calls after it
resolve anew with the built kernel. CUDA graphs read ``settled()`` instead, which moves on when the last
build in flight is done: a step captured while builds run keeps what served meanwhile until then, and is
captured anew once, with every kernel built, rather than once per build (a fresh machine's first Z-Image
steps met a dozen Triton builds finishing one after another over several seconds); until a capture may run
(none beside a compile) the older graph serves on. A kernel built between
a step's warm-up and its capture is first launched inside the capture, which loads its module there (CUDA
12.3+ drivers allow it; an older one fails the capture and the step runs eagerly until the builds settle). A
step during which a build finishes runs both kernels; each computes the same function, so it agrees with
either to rounding, not bitwise.

Under a parallel layout (a process group of more than one rank) the caller builds instead and waits: every
rank must pick the same kernel at the same call, or ranks that compute the same tokens (the tokens a layout
leaves whole) would round differently. A provider's build plans on the GPU, so that part holds
``background.LOCK`` (no CUDA graph captured beside it); its JIT compile before it (FlashInfer's nvcc run,
~90 s on a fresh machine) and a Triton compile run on the host alone and hold nothing. A failed build is
logged once and never retried.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable

import torch

from . import background
from .utils.logging import get_logger

logger = get_logger(__name__)

_LOCK = threading.Lock()
_READY: set[Hashable] = set()
_FAILED: dict[Hashable, str] = {}
_BUILDING: dict[Hashable, threading.Thread] = {}
_GENERATION = [0]
_SETTLED = [0]


def generation() -> int:
    """How many builds have finished in this process: what a cached choice of kernel depends on."""
    return _GENERATION[0]


def settled() -> int:
    """How many times every build in flight has been done: what a CUDA graph is captured anew after."""
    return _SETTLED[0]


def in_flight() -> bool:
    """Whether a build runs now (a graph captured now keeps what serves meanwhile until they settle)."""
    return bool(_BUILDING)


def building() -> list[str]:
    """What is being built now, by name (``describe`` and the cold-start benchmark show it)."""
    return [thread.name.removeprefix("omni-build: ") for thread in list(_BUILDING.values())]


def state(key: Hashable) -> str:
    """``"ready"``, ``"building"``, ``"failed: <why>"`` or ``"not started"``."""
    if key in _READY:
        return "ready"
    if key in _FAILED:
        return f"failed: {_FAILED[key]}"
    return "building" if key in _BUILDING else "not started"


def ready(key: Hashable, build: Callable[[], None], what: str, jit: Callable[[], None] | None = None) -> bool:
    """Whether the provider kernel ``key`` names is built in this process. If not, starts the build (once,
    in a background thread; in the caller under a parallel layout) and says False until it has finished:
    ``jit()`` first, holding nothing (a JIT compile is host work: CUDA graphs and compiles go on beside
    it), then ``build()``, which may plan on the GPU, holding ``background.LOCK``."""
    notice = (
        "%s: building it in the background (JIT-compiled on its first use on a machine: about a minute, "
        "cached on disk afterwards); the next provider serves meanwhile"
    )
    return _ready(key, build, what, background.LOCK, logging.WARNING, notice, jit)


def compiled(key: Hashable, build: Callable[[], None], what: str, wait: float = 0.0) -> bool:
    """``ready`` for a build that runs on the host alone (a Triton kernel's compile): it holds no lock, and
    the caller waits up to ``wait`` seconds for it (a compile found in the disk cache takes milliseconds)."""
    notice = "%s: compiling it in the background; PyTorch's ops serve meanwhile"
    if _ready(key, build, what, contextlib.nullcontext(), logging.DEBUG, notice) or not wait:
        return key in _READY
    thread = _BUILDING.get(key)
    if thread is not None:
        thread.join(wait)
    return key in _READY


def join(key: Hashable) -> None:
    """Waits for the build of ``key`` if it is in flight."""
    thread = _BUILDING.get(key)
    if thread is not None:
        thread.join()


def wait(timeout: float | None = None) -> None:
    """Waits for the builds in flight (benchmarks and tests that time the built kernels)."""
    for thread in list(_BUILDING.values()):
        thread.join(timeout)


def parallel() -> bool:
    """Whether this process is one rank of several (where builds run in the caller)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _ready(
    key: Hashable,
    build: Callable[[], None],
    what: str,
    held: contextlib.AbstractContextManager,
    level: int,
    notice: str,
    jit: Callable[[], None] | None = None,
) -> bool:
    if key in _READY:
        return True
    if key in _FAILED:
        return False
    if parallel():  # nothing runs beside the caller's build: no lock (a capture may hold it)
        _run(key, build, what, contextlib.nullcontext(), jit)
        return key in _READY
    with _LOCK:
        if key not in _BUILDING and key not in _READY and key not in _FAILED:
            logger.log(level, notice, what)
            thread = threading.Thread(
                target=_run, args=(key, build, what, held, jit), daemon=True, name=f"omni-build: {what}"
            )
            _BUILDING[key] = thread
            thread.start()
    return key in _READY


def _run(
    key: Hashable,
    build: Callable[[], None],
    what: str,
    held: contextlib.AbstractContextManager,
    jit: Callable[[], None] | None,
) -> None:
    """``jit()`` (if any) holding nothing, then ``build()`` holding ``held``."""
    try:
        if jit is not None:
            jit()
        with held:
            build()
            if held is background.LOCK and torch.cuda.is_available():
                torch.cuda.synchronize()  # its GPU work is done before a capture may start
    except Exception as error:
        _FAILED[key] = f"{type(error).__name__}: {error}"
        logger.warning("%s: its build failed: %s", what, _FAILED[key])
    else:
        _READY.add(key)
        logger.info("%s: built; calls from now on may use it", what)
    finally:
        with _LOCK:
            _BUILDING.pop(key, None)
            _GENERATION[0] += 1
            if not _BUILDING:
                _SETTLED[0] += 1
