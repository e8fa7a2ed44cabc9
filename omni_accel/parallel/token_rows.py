"""Tensor parallelism with the tokens split over the ranks between its GEMMs (Megatron's sequence
parallelism): outside the column- and row-split projections each rank of the TP group holds a slice of the
tokens, so norms, modulation, gates and residual adds run once per token instead of once per rank.

A column-split GEMM needs every token: ``gather_rows`` joins the ranks' slices before it. A row-split GEMM
gives partial sums over every token: ``sum_rows`` sums, for each rank, its slice of them over the ranks (a
reduce-scatter) where replicated tensor parallelism all-reduces. The bytes moved are the all-reduce's (an
all-reduce is a reduce-scatter and an all-gather), the elementwise work is halved.

A tensor's tokens may be several streams one after another (FLUX's single blocks: text, then image); a rank
holds its slice of each, in the same order, and the full tensor holds each stream whole (``Rows``).

Between the GPUs of one machine both are peer writes into symmetric memory (``peer_memory.PeerBuffers``):
each rank writes its rows into its peers' buffers and a barrier says they landed, with no NCCL kernel.
Elsewhere (gloo, CPU, several hosts) they are an all-to-all. Exchanges of independent streams (FLUX's
double blocks: image and text) may end together, behind one barrier (``gathered_together``,
``sum_together``), the first stream's partial sums travelling by the copy engine while the next stream's
GEMMs run. The buffers need no handshake of their own: a rank uses what its buffer of an exchange received
(the GEMM reads the gathered tokens, the sum the partial sums) before the barrier of the next exchange, and
a block never repeats an exchange of the same name (``Rows.name``) without another barrier in between, so
a peer writes again only after this rank is done.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from .config import LayoutTuning
from .copies import copy_rows_
from .peer_memory import PeerBuffers, describe_exchange, peer_buffers

_SEQ = 1


@dataclass(frozen=True)
class Rows:
    """Which tokens (dim 1) of a tensor each rank of the TP group ``group`` (its name) holds: ``sizes[s][r]``
    of segment ``s`` on rank ``r``. ``name`` keys the peer buffers (one per stream, or joined streams)."""

    name: str
    group: str
    sizes: tuple[tuple[int, ...], ...]

    def __add__(self, other: Rows) -> Rows:
        """The rows of the two tensors joined along the tokens (``cat([a, b], dim=1)`` on every rank)."""
        return Rows(f"{self.name}+{other.name}", self.group, self.sizes + other.sizes)


def gather_rows(x: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    """Every rank's tokens of ``x`` (``[B, local, ...]``) joined as the full tensor; ``x`` itself without a
    token split. Eagerly the result may be a peer buffer, valid until the next exchange of ``rows.name``:
    feed it to the GEMM at once."""
    if rows is None:
        return x
    if torch.compiler.is_dynamo_compiling():
        return _gather_op(x, rows.name, rows.group, _flat(rows.sizes), len(rows.sizes))
    return _gather(x, rows.name, rows.group, rows.sizes)


@dataclass(frozen=True)
class GatherTargets:
    """Where this rank's tokens of a tensor go for a gather by peer writes: for each of its segments, its
    ``(local start, length)`` and the places in every rank's buffer (``[B, length, ...]`` views, maybe a
    peer's memory). Once a producer has written them there, ``done`` gives the gathered tensor."""

    segments: tuple[tuple[int, int, tuple[torch.Tensor, ...]], ...]
    joined: torch.Tensor
    peers: PeerBuffers

    def write(self, x: torch.Tensor) -> None:
        """Copies ``x`` (this rank's tokens, made elsewhere) into its places."""
        for start, length, places in self.segments:
            for place in places:
                copy_rows_(place, x.narrow(_SEQ, start, length))

    def done(self) -> torch.Tensor:
        """Every rank's tokens, once every rank has written its own (a barrier): valid until the next
        exchange of the same ``Rows.name``, so feed it to the GEMM at once."""
        return gathered_together([self])[0]


def gathered_together(targets: Sequence[GatherTargets]) -> list[torch.Tensor]:
    """``done`` of several gathers (of one TP group, written by every rank in the same order): one barrier
    for them all."""
    if targets:
        targets[0].peers.barrier()
    return [target.joined for target in targets]


def gather_targets(x: torch.Tensor, rows: Rows) -> GatherTargets | None:
    """Where a producer of ``x`` (this rank's tokens, ``[B, local, ...]``) can write it for ``gather_rows``
    to need no copy: between the GPUs of one machine, every rank's buffer of the gather; else None."""
    if torch.compiler.is_dynamo_compiling():
        return None
    transport = _transport(rows)
    return transport.targets(x, rows) if isinstance(transport, _PeerWrites) else None


def linear_of_gathered(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: Rows
) -> torch.Tensor:
    """``F.linear(gather_rows(x, rows), weight, bias)``; compiled, as one op, so the gathered tokens never
    leave it (no copy of them out of the peer buffer)."""
    if torch.compiler.is_dynamo_compiling():
        return _gathered_linear_op(x, weight, bias, rows.name, rows.group, _flat(rows.sizes), len(rows.sizes))
    return F.linear(_gather(x, rows.name, rows.group, rows.sizes), weight, bias)


def sum_rows(partial: torch.Tensor, rows: Rows) -> torch.Tensor:
    """This rank's tokens of ``partial`` (``[B, all tokens, ...]``, a row-split GEMM's partial sums) summed
    over the ranks, in rank order (every rank rounds the same way)."""
    return sum_together([start_sum(partial, rows)])[0]


@dataclass(frozen=True)
class SumInFlight:
    """A ``sum_rows`` started over ``transport``: by peer writes, this rank's partial sums of each peer's
    tokens on their way into that peer's buffer (``sent``: copy-engine transfers still travelling) and this
    rank's buffer, where the peers' land (``inbox[r]``: rank ``r``'s); ``sum_together`` ends it."""

    partial: torch.Tensor
    rows: Rows
    transport: _PeerWrites | _Collective | None = None  # None: while compiling
    inbox: torch.Tensor | None = None
    sent: object = None


def start_sum(partial: torch.Tensor, rows: Rows, beside: bool = False) -> SumInFlight:
    """Starts ``sum_rows(partial, rows)``: between the GPUs of one machine its sends to the peers go out
    now, by the copy engine when ``beside`` (work enqueued next runs while they travel), else by the SM copy;
    elsewhere the whole exchange waits for ``sum_together``."""
    if torch.compiler.is_dynamo_compiling():
        return SumInFlight(partial, rows)
    return _transport(rows).start_sum(partial, rows, beside)


def sum_together(sums: Sequence[SumInFlight]) -> list[torch.Tensor]:
    """Ends the ``sums`` (started in order by every rank, on the same TP group): by peer writes one barrier
    says every rank's sends of all of them have landed; each result is this rank's tokens summed in rank
    order."""
    if not sums:
        return []
    if torch.compiler.is_dynamo_compiling():
        return [
            _sum_op(s.partial, s.rows.name, s.rows.group, _flat(s.rows.sizes), len(s.rows.sizes))
            for s in sums
        ]
    return sums[0].transport.end_sums(sums)


def _transport(rows: Rows) -> _PeerWrites | _Collective:
    """How the exchanges of ``rows``' TP group travel: peer writes where its ranks write each other's
    memory (decided once per group, when the layout was applied), else the group's all-to-all. The one
    place an exchange chooses."""
    group = _resolve_process_group(rows.group)
    peers = peer_buffers(group)
    return _Collective(group) if peers is None else _PeerWrites(peers)


class _PeerWrites:
    """Each rank writes its rows into its peers' buffers; a barrier says they landed."""

    def __init__(self, peers: PeerBuffers) -> None:
        self.peers = peers

    def targets(self, x: torch.Tensor, rows: Rows) -> GatherTargets:
        peers = self.peers
        shape = _shape(x, sum(map(sum, rows.sizes)))
        joined = peers.views(f"gather:{rows.name}", [shape] * peers.world, x.dtype)
        segments = tuple(
            (start, length, tuple(buffer.narrow(_SEQ, at, length) for buffer in joined))
            for at, start, length in _pieces(rows.sizes, peers.rank)
            if length
        )
        return GatherTargets(segments, joined[peers.rank], peers)

    def gather(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        targets = self.targets(x, rows)
        targets.write(x)
        return targets.done()

    def start_sum(self, partial: torch.Tensor, rows: Rows, beside: bool) -> SumInFlight:
        peers = self.peers
        me, world = peers.rank, peers.world
        shapes = [(world, *_shape(partial, _local(rows.sizes, r))) for r in range(world)]
        inbox = peers.views(f"sum:{rows.name}", shapes, partial.dtype)
        copies = []
        for rank in range(world):
            if rank == me:
                continue
            if not beside:
                _take(inbox[rank][me], partial, rows.sizes, rank)
                continue
            for at, start, length in _pieces(rows.sizes, rank):
                if length:  # the copy engine moves contiguous pairs: a sample's rows
                    dst, src = inbox[rank][me].narrow(_SEQ, start, length), partial.narrow(_SEQ, at, length)
                    copies += zip(dst.unbind(0), src.unbind(0), strict=True)
        sent = peers.copy_beside(copies) if copies else None
        return SumInFlight(partial, rows, self, inbox[me], sent)

    def end_sums(self, sums: Sequence[SumInFlight]) -> list[torch.Tensor]:
        for s in sums:
            self.peers.wait(s.sent)
        self.peers.barrier()
        return [_add_in_rank_order(s.partial, list(s.inbox), s.rows.sizes, self.peers.rank) for s in sums]


class _Collective:
    """The TP group's all-to-all (gloo, several hosts, NCCL without peer writes); a sum waits for
    ``sum_together`` as a whole."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def gather(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        shapes = [_shape(x, _local(rows.sizes, r)) for r in range(world)]
        received = _all_to_all([x.contiguous()] * world, shapes, self.group)
        full = x.new_empty(_shape(x, sum(map(sum, rows.sizes))))
        for rank, piece in enumerate(received):
            _place(full, piece, rows.sizes, rank)
        return full

    def start_sum(self, partial: torch.Tensor, rows: Rows, beside: bool) -> SumInFlight:
        return SumInFlight(partial, rows, self)

    def end_sums(self, sums: Sequence[SumInFlight]) -> list[torch.Tensor]:
        return [self._sum(s.partial, s.rows.sizes) for s in sums]

    def _sum(self, partial: torch.Tensor, sizes) -> torch.Tensor:
        me, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        sends = []
        for rank in range(world):
            piece = partial.new_empty(_shape(partial, _local(sizes, rank)))
            _take(piece, partial, sizes, rank)
            sends.append(piece)
        received = _all_to_all(sends, [_shape(partial, _local(sizes, me))] * world, self.group)
        return _add_in_rank_order(partial, received, sizes, me)


def split_pays(group: dist.ProcessGroup, peer_writes: bool) -> bool:
    """Whether to split the tokens over the TP ``group``: by peer writes it pays (where ``peer_writes``, the
    layout's tuning, allows them); through NCCL's all-to-all it is slower than keeping every token on every
    rank (one all-reduce per projection pair; docs/PARALLELISM.md), so NCCL without peer writes (PCIe GPUs
    without peer access, several hosts) keeps them whole; gloo (CPU) splits. Decided once per group, by
    every rank at the same call (the first decision maps the peer buffers)."""
    if dist.get_backend(group) != "nccl":
        return True
    return peer_writes and peer_buffers(group) is not None


def describe_rows(group: dist.ProcessGroup, tuning: LayoutTuning) -> str:
    """Whether and how the tokens are split over the TP ``group``, for ``describe``."""
    whole = "every rank holds every token (one all-reduce per row-split projection)"
    if not tuning.split_tokens:
        return f"{whole}: LayoutTuning.split_tokens is off"
    if not split_pays(group, tuning.peer_writes):
        why = describe_exchange(group, tuning.peer_writes, "", "all-to-all")
        return f"{whole}: the token exchanges would be a {why}, slower than the all-reduce"
    how = describe_exchange(
        group,
        tuning.peer_writes,
        "each rank writes its tokens into its peers' symmetric memory (native blocks' norm-modulate "
        "kernel writes a gather's rows there itself), a barrier per exchange (per pair where a block's "
        "two streams exchange together)",
        "all-to-all",
    )
    return (
        "each rank norms and modulates its share of the tokens; gathered before the column-split projections, "
        f"summed after the row-split ones: {how}"
    )


def _flat(sizes: tuple[tuple[int, ...], ...]) -> list[int]:
    return [size for segment in sizes for size in segment]


def _table(flat: Sequence[int], segments: int) -> tuple[tuple[int, ...], ...]:
    world = len(flat) // segments
    return tuple(tuple(flat[s * world : (s + 1) * world]) for s in range(segments))


def _pieces(sizes: tuple[tuple[int, ...], ...], rank: int) -> Iterator[tuple[int, int, int]]:
    """(start in the full tensor, start in rank ``rank``'s tensor, length) of each of its segments."""
    full = local = 0
    for segment in sizes:
        yield full + sum(segment[:rank]), local, segment[rank]
        full += sum(segment)
        local += segment[rank]


def _place(full: torch.Tensor, x: torch.Tensor, sizes, rank: int) -> None:
    """Writes rank ``rank``'s tokens ``x`` where they belong in ``full``."""
    for at, start, length in _pieces(sizes, rank):
        if length:
            copy_rows_(full.narrow(_SEQ, at, length), x.narrow(_SEQ, start, length))


def _take(dst: torch.Tensor, full: torch.Tensor, sizes, rank: int) -> None:
    """Writes rank ``rank``'s tokens of ``full`` into ``dst``."""
    for at, start, length in _pieces(sizes, rank):
        if length:
            copy_rows_(dst.narrow(_SEQ, start, length), full.narrow(_SEQ, at, length))


def _shape(x: torch.Tensor, tokens: int) -> tuple[int, ...]:
    return (x.shape[0], tokens, *x.shape[2:])


def _gather(x: torch.Tensor, name: str, group_name: str, sizes) -> torch.Tensor:
    rows = Rows(name, group_name, sizes)
    return _transport(rows).gather(x, rows)


def _add_in_rank_order(
    partial: torch.Tensor, received: Sequence[torch.Tensor], sizes, me: int
) -> torch.Tensor:
    """This rank's tokens of ``partial`` plus what every other rank sent of them (``received[r]``, this
    rank's tokens of rank ``r``'s partial sums), added in rank order."""
    world = len(received)
    out = partial.new_empty(_shape(partial, _local(sizes, me)))
    for at, start, length in _pieces(sizes, me):
        if not length:
            continue
        terms = [
            partial.narrow(_SEQ, at, length) if r == me else received[r].narrow(_SEQ, start, length)
            for r in range(world)
        ]
        into = out.narrow(_SEQ, start, length)
        torch.add(terms[0], terms[1], out=into)
        for term in terms[2:]:
            into += term
    return out


def _local(sizes, rank: int) -> int:
    return sum(segment[rank] for segment in sizes)


def _all_to_all(
    sends: list[torch.Tensor], shapes: list[tuple[int, ...]], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Sends ``sends[r]`` to rank ``r``; returns what rank ``r`` sent this one (of ``shapes[r]``)."""
    send = torch.cat([piece.reshape(-1) for piece in sends])
    counts = [int(torch.Size(shape).numel()) for shape in shapes]
    recv = send.new_empty(sum(counts))
    dist.all_to_all_single(recv, send, counts, [piece.numel() for piece in sends], group=group)
    return [part.view(shape) for part, shape in zip(recv.split(counts), shapes, strict=True)]


# Compiled graphs call the exchanges as opaque ops (their communication never traces). No op returns a peer
# buffer: the compiler may reuse an op's output memory for a later tensor, which a peer's next write would
# then overwrite.
@torch.library.custom_op("omni_accel::gather_rows", mutates_args=())
def _gather_op(x: torch.Tensor, name: str, group: str, sizes: list[int], segments: int) -> torch.Tensor:
    return _gather(x, name, group, _table(sizes, segments)).clone()


@_gather_op.register_fake
def _(x, name, group, sizes, segments):
    return x.new_empty(_shape(x, sum(sizes)))


@torch.library.custom_op("omni_accel::gathered_linear", mutates_args=())
def _gathered_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    name: str,
    group: str,
    sizes: list[int],
    segments: int,
) -> torch.Tensor:
    return F.linear(_gather(x, name, group, _table(sizes, segments)), weight, bias)


@_gathered_linear_op.register_fake
def _(x, weight, bias, name, group, sizes, segments):
    return x.new_empty(x.shape[0], sum(sizes), *x.shape[2:-1], weight.shape[0])


@torch.library.custom_op("omni_accel::sum_rows", mutates_args=())
def _sum_op(partial: torch.Tensor, name: str, group: str, sizes: list[int], segments: int) -> torch.Tensor:
    return sum_rows(partial, Rows(name, group, _table(sizes, segments)))


@_sum_op.register_fake
def _(partial, name, group, sizes, segments):
    table = _table(sizes, segments)
    rank = dist.get_rank(_resolve_process_group(group))
    return partial.new_empty(_shape(partial, _local(table, rank)))
