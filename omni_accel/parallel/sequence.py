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

Both are written once here (``ulysses_attention``, ``ring_attention``) against the exchange interface of
``exchange.py``; how the pieces travel is the group's transport, chosen per group when the layout is
applied: between the GPUs of one machine peer writes into symmetric memory (``peer_exchange``), elsewhere
(other backends, CPU) the group's all-to-all and send/recv. Ulysses runs in head stages, so one stage's
transfers travel beside the other's kernel.

Everything is exact for non-causal attention without a mask: shards may be uneven or empty, and the head
count need not divide the Ulysses degree (heads are split unevenly, see ``exchange``). This is inference
code: the collectives are not differentiable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from ..attention.merge import merge_partials
from .comm import all_gather_sizes
from .config import LayoutTuning
from .exchange import CollectiveHeads, HeadExchange, HeadsInFlight, KVExchange, OutputsBack, PassedAround
from .overlap import NOTHING, Overlap
from .peer_exchange import PeerHeads, PeerRing
from .peer_memory import PeerBuffers, describe_exchange, peer_buffers
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


def ulysses_attention(
    inputs: Sequence[HeadsInFlight],
    stages: Sequence[tuple[int, Sequence[int]]],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    outputs: OutputsBack,
    after: Callable[[], object] | None = None,
) -> tuple[torch.Tensor, object]:
    """Ulysses attention in head stages (``(first head, heads of each rank)``), its inputs already on
    their way (``inputs``, one per stage, from a ``HeadExchange``, which gave ``outputs`` too): each stage's kernel over this rank's heads of the whole sequence
    once they have landed, its output sent back as the next kernel runs; ``after()`` runs once the last
    kernel has, while the last outputs travel. Returns this rank's tokens of every head and ``after``'s
    result."""
    for index, (first, heads) in enumerate(stages):
        o = attend(*inputs[index].arrived())
        outputs.send(o, first, heads, beside=index < len(stages) - 1 or after is not None)
    done = None if after is None else after()
    return outputs.joined(), done


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attend: Attend,
    ring: KVExchange | None,
    kv_sizes: Sequence[int],
    beside: Beside = None,
    placed: bool = False,
) -> tuple[torch.Tensor, object]:
    """Attention of the local queries over the K/V blocks of every rank of the ring (``kv_sizes[i]``
    tokens on rank ``i``; ``ring`` None: one rank), and ``beside()``'s result, run while the first blocks
    travel. Each block's partial result is merged into the others' through the log-sum-exp; where the
    transport gathers every block at once and there is work beside, one kernel runs over the whole
    sequence once it has landed. ``placed``: k and v are where ``ring``'s placement put them."""
    if ring is None:
        done = _run(beside)
        return _attend_out(attend, q, k, v), done
    flight = ring.circulate(k, v, kv_sizes, placed, beside is not None)  # whole: with work beside
    done = _run(beside)
    whole = None if beside is None else flight.whole()
    if whole is not None:
        return _attend_out(attend, q, *whole), done
    out = lse = None
    for k_block, v_block, last in flight.blocks():
        if q.numel() and k_block.shape[_SEQ]:
            partial_out = attend(q, k_block, v_block, True)
            out, lse = merge_partials(out, lse, *partial_out, q.dtype if last else None)
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
        return self.tuning.place_inputs and self._placing() is not None

    def _peers(self, group: dist.ProcessGroup | None) -> PeerBuffers | None:
        """``group``'s peer buffers where the tuning allows peer writes and its ranks can write each
        other's memory (decided when the layout was applied), else None: its backend's collectives. The
        one place a call of this layout chooses its transport."""
        if _size(group) == 1 or not self.tuning.peer_writes:
            return None
        return peer_buffers(group)

    def _heads(self) -> HeadExchange:
        """Ulysses' transport."""
        peers = self._peers(self.ulysses_group)
        return CollectiveHeads(self.ulysses_group) if peers is None else PeerHeads(peers)

    def _ring(self) -> KVExchange | None:
        """The ring's transport (None: one rank)."""
        if _size(self.ring_group) == 1:
            return None
        peers = self._peers(self.ring_group)
        return PassedAround(self.ring_group) if peers is None else PeerRing(peers)

    def _placing(self) -> PeerHeads | PeerRing | None:
        """The transport that can take inputs written in place: peer writes of a ring alone or of Ulysses
        alone."""
        if _size(self.ulysses_group) > 1 and _size(self.ring_group) > 1:
            return None
        transport = self._heads() if _size(self.ulysses_group) > 1 else self._ring()
        return transport if isinstance(transport, PeerHeads | PeerRing) else None

    def input_placement(
        self, batch: int, heads: int, head_dim: int, v_dim: int, dtype: torch.dtype, beside: bool = False
    ) -> Placement | None:
        """Where this rank's q, k and v can be written for ``attention`` to need no copy of them (between
        the GPUs of one machine: the ring's own K/V block, or Ulysses' buffers of the ranks that attend
        over each head), or None. ``beside``: attention will run work beside its exchanges
        (``attention_beside``), which Ulysses' copy engine then sends the peers' heads behind."""
        transport = self._placing() if self.tuning.place_inputs else None
        kv_sizes = self._sizes(kv=True)
        if isinstance(transport, PeerRing):
            return transport.placement(kv_sizes, batch, heads, head_dim, v_dim, dtype)
        if isinstance(transport, PeerHeads):
            stages = placed_stages(heads, transport.peers.world, sum(kv_sizes), self.tuning)
            dims = (head_dim, v_dim)
            return transport.placement(self.sizes, kv_sizes, stages, batch, dims, dtype, beside)
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
                return self._ulysses_placed(placement, attend, overlap)
        placed = placement is not None
        return overlap.finish(*self._attention_beside(q, k, v, attend, overlap.beside, placed))

    def _ulysses_placed(
        self, placement: Placement, attend: Attend, overlap: Overlap
    ) -> tuple[torch.Tensor, object]:
        """Ulysses over inputs their producer wrote in place: ``beside`` runs while the staged pieces
        travel, ``then`` while the last outputs travel back, into ``overlap.out`` where given."""
        heads = PeerHeads(self._peers(self.ulysses_group))
        head_count = sum(dst.shape[_HEADS] for _, dst in placement.k)
        stages = placed_stages(head_count, heads.peers.world, sum(self._sizes(kv=True)), self.tuning)
        inputs = heads.placed(placement)
        done = overlap.run_beside()
        q, _, v = placement.attend_on
        shape = (q.shape[0], self.sizes[heads.peers.rank], head_count, v.shape[-1])
        outputs = heads.outputs(self.sizes, shape, q, overlap.out)
        then = overlap.then
        after = None if then is None else lambda: then(done)
        out, then_done = ulysses_attention(inputs, stages, partial(_attend_out, attend), outputs, after)
        return out, (done if then is None else then_done)

    def _attention_beside(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend, beside: Beside, placed: bool
    ) -> tuple[torch.Tensor, object]:
        self._check(q, self.sizes, "query")
        self._check(k, self._sizes(kv=True), "key")
        if k.shape[_HEADS] != q.shape[_HEADS]:
            raise ValueError(
                f"query has {q.shape[_HEADS]} heads but key {k.shape[_HEADS]}; expand K/V heads first"
            )
        kv_sizes = self._sizes(kv=True)
        ring, ring_blocks = self._ring(), self._ring_blocks(kv_sizes)
        if _size(self.ulysses_group) == 1:
            return ring_attention(q, k, v, attend, ring, ring_blocks, beside, placed)
        done = _run(beside)

        def around_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ring_attention(q, k, v, attend, ring, ring_blocks)[0]

        heads, degree = self._heads(), _size(self.ulysses_group)
        chunk, kv_chunk = self._chunk(self.sizes), self._chunk(kv_sizes)
        stages = [
            (first, split_sizes(count, degree))
            for first, count in head_stages(q.shape[_HEADS], degree, self.tuning.head_stages)
        ]
        inputs = [
            heads.send_heads(index, (q, k, v), first, counts, chunk, kv_chunk)
            for index, (first, counts) in enumerate(stages)
        ]
        shape = (*q.shape[:3], v.shape[-1])
        outputs = heads.outputs(chunk, shape, q, None)
        return ulysses_attention(inputs, stages, around_ring, outputs)[0], done

    def _check(self, x: torch.Tensor, sizes: Sequence[int], name: str) -> None:
        if x.shape[_SEQ] != sizes[self.index]:
            raise ValueError(
                f"{name} holds {x.shape[_SEQ]} tokens on sequence slice {self.index}, the plan says "
                f"{sizes[self.index]} (plan: {tuple(sizes)})"
            )
