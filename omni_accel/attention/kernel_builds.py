"""Kernels ``auto`` would pick that are compiled on their first use, built in the background meanwhile.

FlashInfer JIT-compiles a kernel the first time a process plans it (over a minute with a cold disk cache:
docs/PERFORMANCE.md, "First call"), so a first call that waited for it would break the rule that a first call
costs at most two warm ones. Instead the first call asking for such a kernel starts its build in a background
thread and is served by the next provider in ``auto``'s order (cuDNN); once the build is done,
``generation()`` moves on, which every cached resolution and CUDA graph key reads, so the calls after it
resolve (and capture) anew with the built kernel. A step during which a build finishes runs both kernels; each
is lossless, so it agrees with either to rounding, not bitwise.

Under a parallel layout (a process group of more than one rank) the caller builds it instead and waits:
every rank must pick the same kernel at the same call, or ranks that compute the same tokens (the tokens a
layout leaves whole) would round differently. A background build holds ``background.LOCK``, so no CUDA
graph is captured beside its GPU work. A failed build is logged once and never retried; that kernel is then never
picked automatically.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable

import torch

from .. import background
from ..utils.logging import get_logger

logger = get_logger(__name__)

_LOCK = threading.Lock()
_READY: set[Hashable] = set()
_FAILED: dict[Hashable, str] = {}
_BUILDING: dict[Hashable, threading.Thread] = {}
_GENERATION = [0]


def generation() -> int:
    """How many builds have finished in this process: what a cached choice of kernel depends on."""
    return _GENERATION[0]


def state(key: Hashable) -> str:
    """``"ready"``, ``"building"``, ``"failed: <why>"`` or ``"not started"``."""
    if key in _READY:
        return "ready"
    if key in _FAILED:
        return f"failed: {_FAILED[key]}"
    return "building" if key in _BUILDING else "not started"


def ready(key: Hashable, build: Callable[[], None], what: str) -> bool:
    """Whether the kernel ``key`` names is built in this process. If not, starts ``build()`` (once, in a
    background thread; in the caller under a parallel layout) and says False until it has finished."""
    if key in _READY:
        return True
    if key in _FAILED:
        return False
    if _parallel():  # nothing runs beside the caller's build: no lock (a capture may hold it)
        _run(key, build, what, contextlib.nullcontext())
        return key in _READY
    with _LOCK:
        if key not in _BUILDING and key not in _READY and key not in _FAILED:
            logger.warning(
                "%s: building it in the background (JIT-compiled on its first use on a machine: about a "
                "minute, cached on disk afterwards); the next provider serves meanwhile",
                what,
            )
            args = (key, build, what, background.LOCK)
            thread = threading.Thread(target=_run, args=args, daemon=True, name="omni-build")
            _BUILDING[key] = thread
            thread.start()
    return key in _READY


def wait(timeout: float | None = None) -> None:
    """Waits for the builds in flight (benchmarks and tests that time the built kernels)."""
    for thread in list(_BUILDING.values()):
        thread.join(timeout)


def _run(
    key: Hashable, build: Callable[[], None], what: str, held: contextlib.AbstractContextManager
) -> None:
    try:
        with held:
            build()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # its GPU work is done before a capture may start
    except Exception as error:
        _FAILED[key] = f"{type(error).__name__}: {error}"
        logger.warning("%s: the build failed, so it is never picked automatically: %s", what, _FAILED[key])
    else:
        _READY.add(key)
        logger.info("%s: built; calls from now on may use it", what)
    finally:
        with _LOCK:
            _BUILDING.pop(key, None)
            _GENERATION[0] += 1


def _parallel() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
