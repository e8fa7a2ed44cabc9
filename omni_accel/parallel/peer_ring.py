"""Ring attention between the GPUs of one machine by peer writes: every rank's K/V block is written into
every peer's buffer by the copy engine, so no communication kernel takes SMs from the attention kernel (a
persistent kernel such as FlashInfer's held NCCL's transfers back until it finished: docs/PARALLELISM.md).

On two ranks this is the ring's one transfer; on more it gathers every block at once instead of passing
them around, which costs a rank the whole sequence's K/V in memory (0.7 GB for Wan 14B at 480p, 81
frames) and spares the ring's steps. Rank ``j``'s buffer holds the blocks in ring order from its own:
``j, j + 1, ...``, so the blocks of the other ranks are one contiguous run.

Two ways to spend the transfer time:

* with work that does not depend on the attention (``beside``: a single-stream block's MLP GEMM), that
  work runs while the blocks travel, then one kernel attends over the whole sequence (no log-sum-exp, no
  merge: any provider serves);
* without, the kernel attends over the local block while the others travel, then over theirs, and the two
  partial results are merged through their log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..attention.merge import merge_partials
from .copies import copy_rows_
from .peer_exchange import PeerBuffers
from .placement import Placement

_SEQ = 1

Attend = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def ring_by_peer_writes(
    peers: PeerBuffers,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_sizes: Sequence[int],
    attend: Attend,
    beside: Callable[[], object] | None = None,
    placed: bool = False,
) -> tuple[torch.Tensor, object]:
    """Attention of this rank's queries (BSHD) over every rank's K/V block (``kv_sizes[i]`` tokens on rank
    ``i``), and ``beside()``'s result (None without it). ``placed``: k and v are where ``ring_placement``
    put them, their producer having written them there.

    The copies are fenced (``PeerBuffers.copy_beside``): a rank writes into a peer's buffer only after
    every rank has run the kernels it enqueued before, among them the last call's kernel over that buffer,
    so one buffer per slot serves every call."""
    me, world = peers.rank, peers.world
    total, mine = sum(kv_sizes), kv_sizes[me]
    keys, values = _buffers(peers, kv_sizes, k.shape[0], k.shape[2], k.shape[3], v.shape[3], k.dtype)
    own_k, own_v = keys[me].narrow(_SEQ, 0, mine), values[me].narrow(_SEQ, 0, mine)
    if not placed and beside is None and k.is_contiguous() and v.is_contiguous():
        own_k, own_v = k, v  # sent from where they are: the local block's kernel reads them there
    elif not placed and mine:
        copy_rows_(own_k, k)
        copy_rows_(own_v, v)
    copies = []
    for j in range(world):
        if j != me and mine:
            at = sum(kv_sizes[(j + i) % world] for i in range((me - j) % world))
            for buffer, own in ((keys[j], own_k), (values[j], own_v)):
                copies += zip(buffer.narrow(_SEQ, at, mine).unbind(0), own.unbind(0), strict=True)
    sent = peers.copy_beside(copies, fenced=True)
    if beside is not None or q.numel() == 0:
        done = beside() if beside else None
        peers.wait(sent)
        if q.numel() == 0:  # no queries (or no heads) here: nothing to attend, but the fence was joined
            return q.new_empty(*q.shape[:3], v.shape[-1]), done
        return attend(q, keys[me], values[me], False), done
    out = lse = None
    if mine:
        out, lse = attend(q, own_k, own_v, True)
    peers.wait(sent)
    if total > mine:
        rest = (t.narrow(_SEQ, mine, total - mine) for t in (keys[me], values[me]))
        out, lse = merge_partials(out, lse, *attend(q, *rest, True), q.dtype)
    return out.to(q.dtype), None


def ring_placement(
    peers: PeerBuffers,
    kv_sizes: Sequence[int],
    batch: int,
    heads: int,
    dim: int,
    v_dim: int,
    dtype: torch.dtype,
) -> Placement:
    """This rank's K and V block in its own buffers (q anywhere): written there by their producer, they
    need no copy before they travel."""
    keys, values = _buffers(peers, kv_sizes, batch, heads, dim, v_dim, dtype)
    mine = kv_sizes[peers.rank]
    k, v = (t[peers.rank].narrow(_SEQ, 0, mine) for t in (keys, values))
    return Placement(None, ((0, k),), ((0, v),), (None, k, v))


def _buffers(peers: PeerBuffers, kv_sizes: Sequence[int], batch, heads, dim, v_dim, dtype):
    total = sum(kv_sizes)
    keys = peers.views("ring_k", [(batch, total, heads, dim)] * peers.world, dtype)
    values = peers.views("ring_v", [(batch, total, heads, v_dim)] * peers.world, dtype)
    return keys, values
