"""Calls counted by reason (a block that ran Diffusers' forward, a call a graph ran eagerly...), the
first of each logged, where two threads may count at once (a pipeline called from several threads).
``Counter``'s ``counts[reason] += 1`` runs ``__missing__``, Python code, at a reason's first count: two
threads could both store 1, losing a count and logging the reason twice."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable


class ReasonCounts(Counter):
    """A ``Counter`` (read as one: describe, reports) whose ``count`` is atomic."""

    def __init__(self, *args: object, **kwargs: int) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def count(self, reason: Hashable) -> bool:
        """Counts one call for ``reason``; True at its first count (logged by the caller)."""
        with self._lock:
            total = self[reason] = self.get(reason, 0) + 1
        return total == 1
