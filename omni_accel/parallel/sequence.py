"""Sequence-parallel attention: Ulysses all-to-all, ring attention, and the two combined.

Every rank holds a contiguous slice of the sequence (tensors are BSHD, so the sequence is dim 1). Attention
needs every query to see every key, which the two schemes provide differently:

* Ulysses trades the sequence split for a head split with one all-to-all, runs the kernel on full-length
  sequences for a subset of heads, and trades back. Cheap in steps, but its degree is capped by the head count
  and its all-to-all wants a fast interconnect.
* Ring keeps the query where it is and passes K/V blocks around the ring; each block yields a partial result
  that is merged exactly through the log-sum-exp. Any degree works and P2P hides behind the kernel, but the
  kernel must return the LSE.

The hybrid runs Ulysses inside each ``ulysses_group`` and the ring across them. The sequence slice a rank
holds is ``ring_rank * ulysses_degree + ulysses_rank`` (ulysses inner): the ranks of one Ulysses group hold
adjacent slices, so after their all-to-all each holds one contiguous chunk of the sequence for its heads, and
the ring rotates those chunks. Put the Ulysses group on the fastest links (inside a node), since its
all-to-all is the bandwidth-heavy exchange.

Between the GPUs of one machine Ulysses' exchanges are peer writes into symmetric memory (``peer_exchange``),
and so are the ring's K/V blocks (``peer_ring``); elsewhere (other backends, CPU) they are the group's
all-to-all, in two head stages so one stage's transfers run beside the other's kernel, and send/recv
around the ring.

Everything is exact for non-causal attention without a mask: shards may be uneven or empty, and the head
count need not divide the Ulysses degree (heads are split unevenly, see ``_exchange``). This is inference
code: the collectives are not differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from ..attention.merge import merge_partials
from .comm import all_gather_sizes
from .config import LayoutTuning
from .copies import copy_rows_
from .overlap import NOTHING, Overlap
from .peer_exchange import (
    PeerBuffers,
    describe_exchange,
    peer_buffers,
    ulysses_by_peer_writes,
    ulysses_in_place,
    ulysses_placement,
)
from .peer_ring import ring_by_peer_writes, ring_placement
from .placement import Placement

Attend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor | tuple[torch.Tensor, torch.Tensor]
]
"""``attend(q, k, v, need_lse)`` on BSHD tensors: the output, or ``(output, lse)`` when ``need_lse``."""
Beside = Callable[[], object] | None
"""Work that does not depend on the attention, run while its exchanges travel (None: no such work)."""

_SEQ, _HEADS = 1, 2


def split_sizes(length: int, world: int) -> list[int]:
    """Sizes of ``length`` split over ``world`` ranks, as even as possible, earlier ranks taking the extra
    one; with fewer items than ranks the last ranks get none, which every function here accepts."""
    if length < 0 or world < 1:
        raise ValueError(f"cannot split {length} items over {world} ranks")
    base, extra = divmod(length, world)
    return [base + (rank < extra) for rank in range(world)]


def describe_ulysses(group: dist.ProcessGroup | None, tuning: LayoutTuning) -> str:
    """How Ulysses' exchanges travel in ``group``, for ``describe``."""
    return describe_exchange(
        group,
        tuning.peer_writes,
        "each rank writes its pieces into its peers' symmetric memory: native blocks' q/k kernel writes "
        "every head group of q, k and v into the buffer of the rank that attends over it (a peer's straight, "
        "or staged and sent by the copy engine beside independent work), then one kernel over the rank's "
        "heads; other calls pack them in head stages; outputs go back by the copy engine and the SM copy",
        "all-to-all in head stages",
    )


def describe_ring(group: dist.ProcessGroup | None, tuning: LayoutTuning) -> str:
    """How ring attention's K/V blocks travel in ``group``, for ``describe``."""
    return describe_exchange(
        group,
        tuning.peer_writes,
        "each rank writes its K/V block into every peer's symmetric memory by the copy engine beside the "
        "kernel, two barriers per call on a side stream",
        "send/recv around the ring",
    )


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def shard(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (``sizes`` defaults to ``split_sizes``); no communication,
    since every rank already holds the full tensor."""
    sizes = split_sizes(x.shape[dim], _size(group)) if sizes is None else sizes
    rank = _rank(group)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def gather(
    x_local: torch.Tensor, dim: int, group: dist.ProcessGroup | None, sizes: Sequence[int]
) -> torch.Tensor:
    """The full tensor from every rank's slice along ``dim``; slices may differ in size (``sizes``, known to
    every rank)."""
    if _size(group) == 1:
        return x_local
    return all_gather_sizes(x_local, dim, list(sizes), group)


class _Exchange:
    """An all-to-all in flight: piece ``j`` of ``x`` along ``scatter_dim`` goes to rank ``j``; what arrives
    from rank ``i`` is ``gather_sizes[i]`` long along ``gather_dim`` and is joined there by ``wait``.

    Flat buffers with per-peer element counts let both splits be uneven, which is why heads are split
    unevenly rather than zero-padded: uneven sequence shards already need variable splits, so uneven heads
    cost nothing more, while padding would move and attend zeros that are thrown away. Where every dim
    before the split one has size 1 (a batch of one), the pieces are consecutive in memory: the send
    buffer is ``x`` itself, or the received buffer is the joined result, with no copy.
    """

    def __init__(
        self,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        scatter_dim: int,
        scatter_sizes: Sequence[int],
        gather_dim: int,
        gather_sizes: Sequence[int],
    ) -> None:
        self.x, self.gather_dim, self.work = x, gather_dim, None
        if _size(group) == 1:
            return
        if math.prod(x.shape[:scatter_dim]) == 1:
            send = _contiguous(x).view(-1)
        else:
            send = _pieces_in_a_row(x, scatter_dim, scatter_sizes)
        mine = scatter_sizes[_rank(group)]
        self.shapes = []
        for size in gather_sizes:
            shape = list(x.shape)
            shape[scatter_dim], shape[gather_dim] = mine, size
            self.shapes.append(shape)
        self.counts = [math.prod(shape) for shape in self.shapes]
        self.recv = x.new_empty(sum(self.counts))
        sent = [math.prod(x.shape) // max(x.shape[scatter_dim], 1) * size for size in scatter_sizes]
        self.send = send  # kept until the transfer is waited for
        self.work = dist.all_to_all_single(self.recv, send, self.counts, sent, group=group, async_op=True)

    def wait(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """The joined result, written into ``into`` when given (a slice of a larger output)."""
        if self.work is None:
            return self.x if into is None else into.copy_(self.x)
        self.work.wait()
        dim = self.gather_dim
        sizes = [shape[dim] for shape in self.shapes]
        if into is None and math.prod(self.shapes[0][:dim]) == 1:
            joined = list(self.shapes[0])
            joined[dim] = sum(sizes)
            return self.recv.view(joined)
        if into is not None and len(set(sizes)) == 1:
            # One copy: the received pieces side by side are ``into`` split per rank.
            per_rank = into.unflatten(dim, (len(sizes), sizes[0])).movedim(dim, 0)
            copy_rows_(per_rank, self.recv.view(len(sizes), *self.shapes[0]))
            return into
        parts = [
            part.view(shape) for part, shape in zip(self.recv.split(self.counts), self.shapes, strict=True)
        ]
        if into is None:
            return torch.cat(parts, dim=dim)
        for part, piece in zip(parts, into.split(sizes, dim=dim), strict=True):
            copy_rows_(piece, part)
        return into


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    if x.is_contiguous():
        return x
    return copy_rows_(torch.empty_like(x, memory_format=torch.contiguous_format), x)


def _pieces_in_a_row(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``cat([piece.flatten() for piece in x.split(sizes, dim)])`` written in one pass: a copy per piece,
    or a single one when the pieces are equal (a view of ``x`` with the ranks moved outermost)."""
    send = x.new_empty(x.numel())
    if len(set(sizes)) == 1:
        per_rank = x.unflatten(dim, (len(sizes), sizes[0])).movedim(dim, 0)
        copy_rows_(send.view(per_rank.shape), per_rank)
        return send
    start = 0
    for piece in x.split(list(sizes), dim=dim):
        copy_rows_(send[start : start + piece.numel()].view(piece.shape), piece)
        start += piece.numel()
    return send


def head_stages(heads: int, degree: int, stages: int) -> list[tuple[int, int]]:
    """``(first head, count)`` of each pipeline stage of Ulysses attention: up to ``stages`` stages, as many
    as give every rank a head in each, so one stage's exchanges run while the kernel works on another."""
    stages = max(1, min(stages, heads // degree)) if degree > 1 else 1
    counts = split_sizes(heads, stages)
    return [(sum(counts[:i]), count) for i, count in enumerate(counts)]


def placed_stages(heads: int, degree: int, tokens: int, tuning: LayoutTuning) -> list[tuple[int, list[int]]]:
    """``(first head, heads of each rank)`` of each head stage of Ulysses with placed inputs: one kernel over
    a rank's heads below ``tuning.placed_stages_from`` tokens, where a kernel over fewer heads loses its
    efficiency; from there the later stages' heads travel by the copy engine beside the kernel before."""
    if tokens >= tuning.placed_stages_from:
        stages = head_stages(heads, degree, tuning.head_stages)
    else:
        stages = [(0, heads)]
    return [(first, split_sizes(count, degree)) for first, count in stages]


def _attend_out(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output alone; a rank with no queries or no heads skips the kernel, which may not take empties."""
    if q.numel() == 0:
        return q.new_empty(*q.shape[:3], v.shape[-1])
    return attend(q, k, v, False)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attend: Attend,
    group: dist.ProcessGroup | None,
    kv_sizes: Sequence[int],
    beside: Beside = None,
    placed: bool = False,
    peers: PeerBuffers | None = None,
) -> tuple[torch.Tensor, object]:
    """Attention of the local queries over the K/V blocks of every rank in ``group`` (``kv_sizes[i]`` tokens
    on rank ``i``), and ``beside()``'s result, run while the first blocks travel. Between the GPUs of one
    machine the blocks are peer writes into ``peers``, the group's buffers (``peer_ring``; ``placed``: K/V already
    in its buffers); elsewhere
    block ``i`` travels rank to rank, the transfer of the next block posted before the kernel runs on the
    current one, so communication overlaps compute."""
    world = _size(group)
    if world == 1:
        done = _run(beside)
        return _attend_out(attend, q, k, v), done
    if peers is not None:
        return ring_by_peer_writes(peers, q, k, v, kv_sizes, attend, beside, placed)
    rank = _rank(group)
    k, v = k.contiguous(), v.contiguous()  # sent as they are
    send_to = dist.get_global_rank(group, (rank + 1) % world)
    recv_from = dist.get_global_rank(group, (rank - 1) % world)
    out = lse = None
    block = rank
    for step in range(world):
        last = step == world - 1
        if not last:
            block = (block - 1) % world  # the block the previous rank holds now
            next_k = k.new_empty(k.shape[0], kv_sizes[block], *k.shape[2:])
            next_v = v.new_empty(v.shape[0], kv_sizes[block], *v.shape[2:])
            ops = [dist.P2POp(dist.isend, t, send_to, group) for t in (k, v)]
            ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in (next_k, next_v)]
            requests = dist.batch_isend_irecv(ops)
            if step == 0:
                done = _run(beside)
        if q.numel() and k.shape[_SEQ]:
            out, lse = merge_partials(out, lse, *attend(q, k, v, True), q.dtype if last else None)
        if not last:
            for request in requests:
                request.wait()
            k, v = next_k, next_v
    if out is None:  # no queries or no heads here
        return q.new_empty(*q.shape[:3], v.shape[-1]), done
    return out.to(q.dtype), done


def _run(beside: Beside) -> object:
    return None if beside is None else beside()


@dataclass(frozen=True)
class SequenceParallel:
    """How one sequence is spread over a Ulysses x ring grid of ranks, and attention over it.

    ``sizes[i]`` is the query length held by sequence slice ``i = ring_rank * ulysses_degree + ulysses_rank``;
    ``kv_sizes`` is the same for K/V when they are sharded with another length (cross attention), ``None``
    when they follow ``sizes``. A group left ``None`` has degree 1. ``tuning``: how the exchanges run.
    Build one with ``plan``.
    """

    sizes: tuple[int, ...]
    kv_sizes: tuple[int, ...] | None = None
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    tuning: LayoutTuning = field(default_factory=LayoutTuning)

    def __post_init__(self) -> None:
        for name, sizes in (("sizes", self.sizes), ("kv_sizes", self.kv_sizes)):
            if sizes is not None and (len(sizes) != self.degree or sum(sizes) == 0):
                raise ValueError(
                    f"{name} must give a length to each of the {self.degree} ranks, and a nonzero total "
                    f"(got {sizes})"
                )

    @classmethod
    def plan(
        cls,
        length: int,
        *,
        kv_length: int | None = None,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
        tuning: LayoutTuning | None = None,
    ) -> SequenceParallel:
        """The even split of a ``length``-token sequence (and of ``kv_length`` K/V tokens, if they differ)."""
        degree = _size(ulysses_group) * _size(ring_group)
        kv_sizes = None if kv_length is None else tuple(split_sizes(kv_length, degree))
        tuning = LayoutTuning() if tuning is None else tuning
        return cls(tuple(split_sizes(length, degree)), kv_sizes, ulysses_group, ring_group, tuning)

    @property
    def degree(self) -> int:
        return _size(self.ulysses_group) * _size(self.ring_group)

    @property
    def index(self) -> int:
        """Which slice of the sequence this rank holds."""
        return _rank(self.ring_group) * _size(self.ulysses_group) + _rank(self.ulysses_group)

    def _sizes(self, kv: bool) -> tuple[int, ...]:
        return self.kv_sizes if kv and self.kv_sizes is not None else self.sizes

    def _chunk(self, sizes: Sequence[int]) -> Sequence[int]:
        """The slice sizes inside this rank's Ulysses group."""
        start = _rank(self.ring_group) * _size(self.ulysses_group)
        return sizes[start : start + _size(self.ulysses_group)]

    def _ring_blocks(self, sizes: Sequence[int]) -> list[int]:
        """The sequence length each ring rank holds once its Ulysses group has gathered the sequence."""
        ulysses = _size(self.ulysses_group)
        return [sum(sizes[start : start + ulysses]) for start in range(0, len(sizes), ulysses)]

    def shard(self, x: torch.Tensor, dim: int = _SEQ, *, kv: bool = False) -> torch.Tensor:
        """This rank's slice of a full tensor (``kv`` picks the K/V plan)."""
        sizes = self._sizes(kv)
        return x.narrow(dim, sum(sizes[: self.index]), sizes[self.index])

    def gather(self, x_local: torch.Tensor, dim: int = _SEQ, *, kv: bool = False) -> torch.Tensor:
        """The full tensor on every rank: within the Ulysses group, then across the ring."""
        sizes = self._sizes(kv)
        chunk = gather(x_local, dim, self.ulysses_group, self._chunk(sizes))
        return gather(chunk, dim, self.ring_group, self._ring_blocks(sizes))

    def places_inputs(self) -> bool:
        """Whether ``input_placement`` gives a placement: between the GPUs of one machine, a ring alone or
        Ulysses alone, where the tuning places inputs. ``attention_beside`` then hides its work behind the
        exchanges."""
        return self.tuning.place_inputs and (
            self._peers(self.ring_group, self.ulysses_group) is not None
            or self._peers(self.ulysses_group, self.ring_group) is not None
        )

    def _transport(self, group: dist.ProcessGroup | None) -> PeerBuffers | None:
        """How ``group``'s exchanges travel: its peer buffers (peer writes) where the tuning allows them
        and its ranks can write each other's memory, else None (its backend's collectives). The one place
        a call of this layout chooses."""
        if _size(group) == 1 or not self.tuning.peer_writes:
            return None
        return peer_buffers(group)

    def _peers(self, group: dist.ProcessGroup | None, other: dist.ProcessGroup | None = None):
        """``group``'s peer buffers where no ``other`` group has more than one rank (inputs are placed
        only for a ring alone or Ulysses alone)."""
        return None if _size(other) > 1 else self._transport(group)

    def input_placement(
        self, batch: int, heads: int, head_dim: int, v_dim: int, dtype: torch.dtype, beside: bool = False
    ) -> Placement | None:
        """Where this rank's q, k and v can be written for ``attention`` to need no copy of them (between
        the GPUs of one machine: the ring's own K/V block, or Ulysses' buffers of the ranks that attend
        over each head), or None. ``beside``: attention will run work beside its exchanges
        (``attention_beside``), which Ulysses' copy engine then sends the peers' heads behind."""
        if not self.tuning.place_inputs:
            return None
        ring = self._peers(self.ring_group, self.ulysses_group)
        if ring is not None:
            return ring_placement(ring, self._sizes(kv=True), batch, heads, head_dim, v_dim, dtype)
        ulysses = self._peers(self.ulysses_group, self.ring_group)
        if ulysses is not None:
            stages = placed_stages(heads, ulysses.world, sum(self._sizes(kv=True)), self.tuning)
            args = (self.sizes, self._sizes(kv=True), stages, batch, (head_dim, v_dim), dtype, beside)
            return ulysses_placement(ulysses, *args)
        return None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Full attention of this rank's queries over the whole sequence; returns this rank's output slice.
        ``q``, ``k`` and ``v`` are this rank's BSHD slices. (Attention over K/V every rank holds whole, such
        as a cross-attention's text, needs no layout at all: each rank attends with its own queries.)"""
        return self.attention_beside(q, k, v, attend)[0]

    def attention_beside(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attend: Attend,
        overlap: Overlap = NOTHING,
    ) -> tuple[torch.Tensor, object]:
        """``attention``, and ``overlap.beside()``'s result (or ``then``'s of it): under a ring the work runs
        once the K/V blocks are posted, while they travel; under Ulysses with its inputs placed while the
        staged heads travel, and ``then`` while the outputs travel back; otherwise first (beside the packed
        stages it does not pay). ``overlap.placement``: q, k and v are what ``input_placement`` gave, written
        there; ``overlap.out``: where the output goes, written there by the exchange itself where the outputs
        travel back by peer writes."""
        placement = overlap.placement
        if placement is not None:
            if any(a is not b for a, b in zip(placement.written(q), (q, k, v), strict=True)):
                raise ValueError("attention got q, k and v other than those its placement holds")
            if _size(self.ulysses_group) > 1:
                heads = sum(dst.shape[_HEADS] for _, dst in placement.k)
                tokens = sum(self._sizes(kv=True))
                stages = placed_stages(heads, _size(self.ulysses_group), tokens, self.tuning)
                attend_here = partial(_attend_out, attend)
                args = (self.sizes, stages, attend_here, overlap)
                return ulysses_in_place(self._peers(self.ulysses_group), placement, *args)
        placed = placement is not None
        return overlap.finish(*self._attention_beside(q, k, v, attend, overlap.beside, placed))

    def _attention_beside(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend, beside: Beside, placed: bool
    ) -> tuple[torch.Tensor, object]:
        group, ring = self.ulysses_group, self.ring_group
        self._check(q, self.sizes, "query")
        self._check(k, self._sizes(kv=True), "key")
        if k.shape[_HEADS] != q.shape[_HEADS]:
            raise ValueError(
                f"query has {q.shape[_HEADS]} heads but key {k.shape[_HEADS]}; expand K/V heads first"
            )
        chunk = self._chunk(self.sizes)
        kv_sizes = self._sizes(kv=True)
        kv_chunk, ring_blocks = self._chunk(kv_sizes), self._ring_blocks(kv_sizes)
        stage_count, ring_peers = self.tuning.head_stages, self._transport(ring)
        if _size(group) == 1:
            return ring_attention(q, k, v, attend, ring, ring_blocks, beside, placed, ring_peers)
        done = _run(beside)

        def around_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ring_attention(q, k, v, attend, ring, ring_blocks, peers=ring_peers)[0]

        peers = self._transport(group)
        if peers is not None:
            stages = [
                (first, split_sizes(count, peers.world))
                for first, count in head_stages(q.shape[_HEADS], peers.world, stage_count)
            ]
            return ulysses_by_peer_writes(peers, q, k, v, chunk, kv_chunk, stages, around_ring), done
        # Every stage's inputs are posted first: the communication stream runs them back to back while the
        # kernel works on earlier stages, and each stage's output travels back during the next one's kernel.
        stages = []
        for first, count in head_stages(q.shape[_HEADS], _size(group), stage_count):
            heads = split_sizes(count, _size(group))

            def send(t: torch.Tensor, sizes: Sequence[int], first=first, count=count, heads=heads):
                return _Exchange(t.narrow(_HEADS, first, count), group, _HEADS, heads, _SEQ, sizes)

            stages.append((first, count, heads, send(q, chunk), [send(k, kv_chunk), send(v, kv_chunk)]))
        back = []
        for first, count, heads, q_sent, kv in stages:
            o = around_ring(q_sent.wait(), *(t.wait() for t in kv))
            back.append((_Exchange(o, group, _SEQ, chunk, _HEADS, heads), first, count))
        if len(back) == 1:
            return back[0][0].wait(), done
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        for sent, first, count in back:
            sent.wait(into=out.narrow(_HEADS, first, count))
        return out, done

    def _check(self, x: torch.Tensor, sizes: Sequence[int], name: str) -> None:
        if x.shape[_SEQ] != sizes[self.index]:
            raise ValueError(
                f"{name} holds {x.shape[_SEQ]} tokens on sequence slice {self.index}, the plan says "
                f"{sizes[self.index]} (plan: {tuple(sizes)})"
            )
