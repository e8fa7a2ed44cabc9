"""Calls from several threads of one process under a layout: one call that communicates at a time, in the
same order on every rank.

A layout's collectives pair with the other ranks' in the order each rank issues them; two threads calling
the pipeline at once (a web server's requests) would issue theirs interleaved, in another order on each
rank, and cross (a gloo abort, or one call's partial sums added to another's). So every call that
communicates (a transformer forward under tp or sequence parallelism, a CFG pair or split, a split VAE
call) first registers a fingerprint of its inputs as waiting; one thread of the process at a time gathers
every rank's waiting fingerprints, and every rank runs the smallest one waiting on all of them (the same
decision everywhere). Two waiting calls with the same fingerprint have the same inputs, hence the same
outputs, so which one runs first does not matter. A process with one thread in its calls gathers too (a
rank cannot tell alone whether another rank's next call is another thread's), one small all-gather per
call, beside the layout's own collectives.

Where no fingerprint is common, split VAE calls pair with each other anyway (the split then compares their
inputs and runs each whole, as ranks holding their own latents do); else the ranks gather again, and after
the layout's ``timeout_s`` every waiting call raises on every rank, before any collective of it (a rank
cannot tell another thread's call that has not arrived yet from a call with other inputs on each rank,
which the layout could not compute anyway: a tensor-parallel all-reduce would add up two calls' halves).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .mesh import device_type_of

_OFFERED = 64  # waiting calls a rank offers per gather (a few bytes each); the others wait for a later one
_RETRY_S = 0.001  # pause between gathers that found no call waiting on every rank

NO_COMMON_CALL = (
    "Calls of an accelerated pipeline from several threads: for {waited:.0f} s the ranks have had no call with "
    "the same inputs waiting on all of them (this rank's threads wait on calls whose inputs no other rank "
    "has). Under a parallel layout each rank must make the same calls; from several threads, serialise them "
    "(a lock around pipe(...), or one pipeline call at a time per process) or make the same calls on every "
    "rank."
)


class Turns:
    """The turns of one process's calls that communicate over the layouts of its default group."""

    def __init__(self) -> None:
        self.timeout_s = 600.0  # the last layout set up sets its own (``ParallelConfig.timeout_s``)
        self._lock = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: dict[int, tuple[int, int, bool]] = {}  # ticket -> (fingerprint high, low, vae call)
        self._busy = False  # a thread gathers, or a granted call runs
        self._granted: int | None = None
        self._failed: set[int] = set()
        self._owner: int | None = None  # the thread whose call runs (its nested calls pass)
        self._stuck_since: float | None = None  # the first of the gathers since the last common call
        self.gathers = 0

    @contextmanager
    def turn(self, inputs: Any, vae: bool = False) -> Iterator[None]:
        """Runs the body when every rank runs the call with this fingerprint of ``inputs`` (tensors and
        plain values, nested)."""
        me = threading.get_ident()
        if self._owner == me:  # a call inside the granted one (a tiled VAE's decoder)
            yield
            return
        high, low = _fingerprint(inputs)
        with self._lock:
            ticket = next(self._tickets)
            self._waiting[ticket] = (high, low, vae)
            try:
                self._wait_for(ticket)
            except BaseException:
                self._waiting.pop(ticket, None)
                self._failed.discard(ticket)
                self._lock.notify_all()
                raise
            self._owner = me
        try:
            yield
        finally:
            with self._lock:
                del self._waiting[ticket]
                self._owner = self._granted = None
                self._busy = False
                self._lock.notify_all()

    def _wait_for(self, ticket: int) -> None:
        while self._granted != ticket:
            if ticket in self._failed:
                self._failed.discard(ticket)
                raise RuntimeError(NO_COMMON_CALL.format(waited=self.timeout_s))
            if self._busy:
                self._lock.wait()
                continue
            self._busy = True
            offered = dict(itertools.islice(self._waiting.items(), _OFFERED))
            self._lock.release()
            try:
                chosen, expired = self._agree(offered)
            except BaseException:  # the gather failed (a rank gone): the next waiting thread tries its own
                with self._lock:
                    self._busy = False
                raise
            finally:
                self._lock.acquire()
            if chosen is None:
                self._busy = False
                if expired:
                    self._failed.update(offered)
                self._lock.notify_all()
                if not expired:
                    self._lock.wait(_RETRY_S)
                continue
            self._granted = chosen
            self._lock.notify_all()

    def _agree(self, offered: dict[int, tuple[int, int, bool]]) -> tuple[int | None, bool]:
        """The ticket of ``offered`` whose call every rank runs now (None: none yet), and whether the ranks
        gathered for longer than the timeout without finding one (every rank's streak of such gathers is
        the same gathers: the longest is the same verdict everywhere)."""
        now = time.monotonic()
        stuck = 0.0 if self._stuck_since is None else now - self._stuck_since
        rows = [[high, low, int(vae)] for high, low, vae in offered.values()]
        rows += [[0, 0, -1]] * (_OFFERED - len(rows))  # -1: an empty slot
        mine = torch.tensor([[len(offered), 0, int(stuck * 1000)], *rows], dtype=torch.int64)
        device = device_type_of(dist.get_backend())
        mine = mine.to(device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        self.gathers += 1
        tables = [t.tolist() for t in gathered]
        waiting = [{(h, lo) for h, lo, kind in t[1:] if kind >= 0} for t in tables]
        common = set.intersection(*waiting)
        if common:
            want = min(common)
            self._stuck_since = None
            return next(k for k, (h, lo, _) in offered.items() if (h, lo) == want), False
        if all(any(kind == 1 for *_, kind in t[1:]) for t in tables):  # a VAE call waiting on every rank
            self._stuck_since = None
            return next(k for k, (*_, vae) in offered.items() if vae), False
        expired = max(t[0][2] for t in tables) / 1000 >= self.timeout_s
        self._stuck_since = None if expired else (self._stuck_since or now)
        return None, expired


def _fingerprint(inputs: Any) -> tuple[int, int]:
    """Two integers from the bits of every tensor in ``inputs`` and the plain values beside them, the same
    in every process for the same inputs."""
    from .vae import fingerprint  # the split VAE's (it imports this module)

    leaves = pytree.tree_leaves(inputs)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    tensors = [t.to(tensors[0].device) for t in tensors]
    plain = repr([leaf for leaf in leaves if isinstance(leaf, int | float | str | bool | type(None))])
    high, low = fingerprint(tensors).tolist() if tensors else (0, 0)
    return high, (low * 31 + zlib.crc32(plain.encode())) % 2**63


_TURNS: weakref.WeakKeyDictionary[dist.ProcessGroup, Turns] = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def turns() -> Turns:
    """The turns of this process's calls over its default group (made at the first ask)."""
    with _TURNS_LOCK:
        return _TURNS.setdefault(dist.group.WORLD, Turns())
