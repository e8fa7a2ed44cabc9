"""Work a background thread runs beside the pipeline that may launch GPU work (a compile's run of the code
it compiled, inductor's autotuning, a kernel build's plan): one piece at a time in the process, and never
beside a CUDA graph capture, which such work invalidates, whichever model either belongs to."""

from __future__ import annotations

import contextlib
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
