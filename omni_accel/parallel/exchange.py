"""How sequence parallelism's pieces travel inside one group: the interface that Ulysses and ring attention
(``sequence.py``) are written against, and its transport over the group's collectives.

Ulysses moves heads: each rank sends every peer that peer's heads of its tokens, attends over its own heads
of the whole sequence, and sends every peer that peer's tokens of the output back (``HeadExchange``). The
ring moves K/V blocks: each rank attends its queries over every rank's block as the blocks arrive
(``KVExchange``). Two transports implement both:

* the group's collectives (here): all-to-all for Ulysses, send/recv around the ring; any backend, any
  machine;
* peer writes into symmetric memory (``peer_exchange``): between the GPUs of one machine, with no
  communication kernel beside the attention kernel.

``SequenceParallel`` picks one per group, from what ``peer_memory`` decided when the layout was applied.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from .copies import copy_rows_

_SEQ, _HEADS = 1, 2

Block = tuple[torch.Tensor, torch.Tensor, bool]
"""``(k, v, last)``: one rank's K/V block (or several ranks' joined), and whether it is the last."""


class HeadsInFlight(Protocol):
    """One head stage's q, k and v on their way to the ranks that attend over them."""

    def arrived(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads of the stage over the whole sequence, once they have landed."""


class OutputsBack(Protocol):
    """The outputs of a call's head stages on their way back to the ranks whose tokens they are."""

    def send(self, o: torch.Tensor, first: int, heads: Sequence[int], beside: bool) -> None:
        """Sends each rank its tokens of this rank's heads of a stage (``o``: every token; the stage's
        heads start at ``first``, ``heads[j]`` of them are rank ``j``'s). ``beside``: other kernels follow
        before the outputs are joined, which the transfers may run beside."""

    def joined(self) -> torch.Tensor:
        """This rank's tokens of every head, once every stage's have landed."""


class HeadExchange(Protocol):
    """Ulysses' two moves in one group."""

    def send_heads(
        self,
        stage: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        first: int,
        heads: Sequence[int],
        sizes: Sequence[int],
        kv_sizes: Sequence[int],
    ) -> HeadsInFlight:
        """Starts sending stage ``stage``'s heads (from ``first``, ``heads[j]`` to rank ``j``) of this rank's
        tokens of q, k and v (``sizes[i]`` query and ``kv_sizes[i]`` K/V tokens on rank ``i``)."""

    def outputs(
        self, sizes: Sequence[int], shape: Sequence[int], like: torch.Tensor, out: torch.Tensor | None
    ) -> OutputsBack:
        """Where a call's outputs come back: into ``out`` if given, else a new tensor of ``shape`` (this
        rank's ``sizes[rank]`` tokens of every head) like ``like``."""


class KVInFlight(Protocol):
    """A call's K/V blocks travelling between the ranks of the ring."""

    def whole(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every block, joined in ring order from this rank's, once all have landed; None where the
        transport passes the blocks around instead (then use ``blocks``)."""

    def blocks(self) -> Iterator[Block]:
        """The blocks as they become usable, every one of them (a rank with nothing to attend must still
        step through them: its peers wait for its sends)."""


class KVExchange(Protocol):
    """The ring's move in one group."""

    def circulate(
        self, k: torch.Tensor, v: torch.Tensor, kv_sizes: Sequence[int], placed: bool, whole: bool
    ) -> KVInFlight:
        """Starts moving this rank's K/V block (``kv_sizes[i]`` tokens on rank ``i``). ``placed``: k and v
        are where the transport's placement put them; ``whole``: the caller will ask for ``whole``."""


class CollectiveHeads:
    """Ulysses by the group's all-to-all, every stage's inputs posted first: the communication stream runs
    them back to back while the kernel works on earlier stages, and each stage's output travels back during
    the next one's kernel."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send_heads(
        self,
        stage: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        first: int,
        heads: Sequence[int],
        sizes: Sequence[int],
        kv_sizes: Sequence[int],
    ) -> HeadsInFlight:
        count = sum(heads)
        return _AllArrive(
            [
                _AllToAll(t.narrow(_HEADS, first, count), self.group, _HEADS, heads, _SEQ, lengths)
                for t, lengths in zip(qkv, (sizes, kv_sizes, kv_sizes), strict=True)
            ]
        )

    def outputs(
        self, sizes: Sequence[int], shape: Sequence[int], like: torch.Tensor, out: torch.Tensor | None
    ) -> OutputsBack:
        return _CollectiveOutputs(self.group, sizes, shape, like, out)


class _AllArrive:
    def __init__(self, sent: list[_AllToAll]) -> None:
        self.sent = sent

    def arrived(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (t.wait() for t in self.sent)
        return q, k, v


class _CollectiveOutputs:
    def __init__(self, group, sizes, shape, like, out) -> None:
        self.group, self.sizes, self.shape, self.like, self.out = group, sizes, shape, like, out
        self.sent: list[tuple[_AllToAll, int, int]] = []

    def send(self, o: torch.Tensor, first: int, heads: Sequence[int], beside: bool) -> None:
        self.sent.append((_AllToAll(o, self.group, _SEQ, self.sizes, _HEADS, heads), first, sum(heads)))

    def joined(self) -> torch.Tensor:
        if len(self.sent) == 1 and self.out is None:
            return self.sent[0][0].wait()  # the received buffer itself, where it is the result
        out = self.like.new_empty(self.shape) if self.out is None else self.out
        for sent, first, count in self.sent:
            sent.wait(into=out.narrow(_HEADS, first, count))
        return out


class _AllToAll:
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
        group: dist.ProcessGroup,
        scatter_dim: int,
        scatter_sizes: Sequence[int],
        gather_dim: int,
        gather_sizes: Sequence[int],
    ) -> None:
        self.gather_dim = gather_dim
        if math.prod(x.shape[:scatter_dim]) == 1:
            send = _contiguous(x).view(-1)
        else:
            send = _pieces_in_a_row(x, scatter_dim, scatter_sizes)
        mine = scatter_sizes[dist.get_rank(group)]
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


class PassedAround:
    """The ring by send/recv: block ``i`` travels rank to rank, the transfer of the next block posted
    before the kernel runs on the current one, so communication overlaps compute."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def circulate(
        self, k: torch.Tensor, v: torch.Tensor, kv_sizes: Sequence[int], placed: bool, whole: bool
    ) -> KVInFlight:
        return _Passing(self.group, k.contiguous(), v.contiguous(), kv_sizes)  # sent as they are


class _Passing:
    def __init__(self, group, k: torch.Tensor, v: torch.Tensor, kv_sizes: Sequence[int]) -> None:
        self.group, self.k, self.v, self.kv_sizes = group, k, v, kv_sizes
        rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.send_to = dist.get_global_rank(group, (rank + 1) % self.world)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % self.world)
        self.block = rank
        self._post()

    def _post(self) -> None:
        """Sends the block held now on and receives the one the previous rank holds."""
        self.block = (self.block - 1) % self.world
        k, v = self.k, self.v
        self.next = [t.new_empty(t.shape[0], self.kv_sizes[self.block], *t.shape[2:]) for t in (k, v)]
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group) for t in (k, v)]
        ops += [dist.P2POp(dist.irecv, t, self.recv_from, self.group) for t in self.next]
        self.requests = dist.batch_isend_irecv(ops)

    def whole(self) -> None:
        return None

    def blocks(self) -> Iterator[Block]:
        for step in range(self.world):
            last = step == self.world - 1
            yield self.k, self.v, last
            if not last:
                for request in self.requests:
                    request.wait()
                self.k, self.v = self.next
                if step + 1 < self.world - 1:
                    self._post()
