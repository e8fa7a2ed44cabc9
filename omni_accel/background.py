"""Work a background thread runs beside the pipeline that may launch GPU work (a compile's run of the code
it compiled, inductor's autotuning, a kernel build's plan): one piece at a time in the process, and never
beside a CUDA graph capture, which such work invalidates, whichever model either belongs to."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

# Held by each piece of background work while it runs, and by a capture. One compile at a time also
# because tracing keeps process-wide state (torch.fx's patcher).
LOCK = threading.Lock()


@contextlib.contextmanager
def nothing_beside() -> Iterator[bool]:
    """Holds off all background work in the process while the block runs; yields False (holding nothing)
    when some runs now, so that the caller does not capture."""
    free = LOCK.acquire(blocking=False)
    try:
        yield free
    finally:
        if free:
            LOCK.release()


_CAPTURE_WAITS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "omni_accel_capture_waits", default=False
)


@contextlib.contextmanager
def capture_waits() -> Iterator[None]:
    """Marks an eager step that CUDA graphs will capture once what holds the capture off is over (the step's
    warm-up, a provider's kernel build, other background work): no compile starts beside it. A compile started
    there would hold the capture off in turn, so every step until it ended would run eagerly beside it, each
    operator waiting for the GIL (Z-Image 6B on an H100: steps of 0.9-2.5 s against 0.15, eight steps and
    no capture); the compile starts at the first replay instead."""
    token = _CAPTURE_WAITS.set(True)
    try:
        yield
    finally:
        _CAPTURE_WAITS.reset(token)


def capture_waiting() -> bool:
    """Whether the step running on this thread is one a capture waits to follow (``capture_waits``)."""
    return _CAPTURE_WAITS.get()
