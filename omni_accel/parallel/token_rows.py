"""Tensor parallelism with the tokens split over the ranks between its GEMMs (Megatron's sequence
parallelism): outside the column- and row-split projections each rank of the TP group holds a slice of the
tokens, so norms, modulation, gates and residual adds run once per token instead of once per rank.

A column-split GEMM needs every token: ``linear_of_gathered`` gathers the ranks' slices and runs the GEMM
on them. A row-split GEMM gives partial sums over every token: ``linear_summed`` sums, for each rank, its
slice of them over the ranks (a reduce-scatter) where replicated tensor parallelism all-reduces. The bytes
moved are the all-reduce's (an all-reduce is a reduce-scatter and an all-gather), the elementwise work is
halved. (``gather_rows`` and ``sum_rows`` are the bare exchanges, for projections with LoRA adapters.)

A tensor's tokens may be several streams one after another (FLUX's single blocks: text, then image); a rank
holds its slice of each, in the same order, and the full tensor holds each stream whole (``Rows``).

Between the GPUs of one machine the exchanges are peer writes into symmetric memory
(``peer_exchange.PeerBuffers``), with no NCCL kernel: a rank's tokens go to its peers by the copy engine
while its GEMM runs on them, and a row-split GEMM writes the peers' rows of its output straight into their
memory. The GEMM runs rank by rank over the rows (the same calls on every path, so every path gives the
same bits); elsewhere (gloo, CPU, several hosts) an all-to-all moves the rows. The buffers need no
handshake of their own: a rank uses what its buffer of an exchange received before the barrier of the
next exchange, and a block never repeats an exchange of the same name (``Rows.name``) without another
exchange in between, so a peer writes again only after this rank is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from .copies import copy_rows_
from .peer_exchange import describe_exchange, peer_buffers

_SEQ = 1
Sizes = tuple[tuple[int, ...], ...]  # [segment][rank]


@dataclass(frozen=True)
class Rows:
    """Which tokens (dim 1) of a tensor each rank of the TP group ``group`` (its name) holds: ``sizes[s][r]``
    of segment ``s`` on rank ``r``. ``name`` keys the peer buffers (one per stream, or joined streams)."""

    name: str
    group: str
    sizes: Sizes

    def __add__(self, other: Rows) -> Rows:
        """The rows of the two tensors joined along the tokens (``cat([a, b], dim=1)`` on every rank)."""
        return Rows(f"{self.name}+{other.name}", self.group, self.sizes + other.sizes)


def gather_rows(x: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    """Every rank's tokens of ``x`` (``[B, local, ...]``) joined as the full tensor; ``x`` itself without a
    token split."""
    if rows is None:
        return x
    if torch.compiler.is_compiling():
        return _gather_op(x, rows.name, rows.group, _flat(rows.sizes), len(rows.sizes))
    return _gather(x, rows.name, rows.group, rows.sizes)


def linear_of_gathered(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: Rows
) -> torch.Tensor:
    """``F.linear(gather_rows(x, rows), weight, bias)``, the GEMM on this rank's tokens running while they
    travel to the peers."""
    if torch.compiler.is_compiling():
        return _gathered_linear_op(x, weight, bias, rows.name, rows.group, _flat(rows.sizes), len(rows.sizes))
    return _gathered_linear(x, weight, bias, rows.name, rows.group, rows.sizes)


def sum_rows(partial: torch.Tensor, rows: Rows) -> torch.Tensor:
    """This rank's tokens of ``partial`` (``[B, all tokens, ...]``, a row-split GEMM's partial sums) summed
    over the ranks, in rank order (every rank rounds the same way)."""
    if torch.compiler.is_compiling():
        return _sum_op(partial, rows.name, rows.group, _flat(rows.sizes), len(rows.sizes))
    return _sum(partial, rows.name, rows.group, rows.sizes)


def linear_summed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: Rows
) -> torch.Tensor:
    """``sum_rows(F.linear(x, weight, bias), rows)``, each rank's rows of the GEMM written where they are
    summed (the peers' into their memory)."""
    if torch.compiler.is_compiling():
        return _linear_summed_op(x, weight, bias, rows.name, rows.group, _flat(rows.sizes), len(rows.sizes))
    return _linear_summed(x, weight, bias, rows.name, rows.group, rows.sizes)


def describe_rows(group: dist.ProcessGroup) -> str:
    """How the token exchanges travel in the TP ``group``, for ``describe``."""
    return describe_exchange(
        group,
        "each rank's tokens reach its peers' symmetric memory by the copy engine beside its GEMM, the "
        "row-split GEMMs write the peers' rows into their memory, a barrier per exchange",
        "all-to-all",
    )


def _pieces(sizes: Sizes, rank: int) -> Iterator[tuple[int, int, int]]:
    """(start in the full tensor, start in rank ``rank``'s tensor, length) of each of its segments."""
    full = local = 0
    for segment in sizes:
        if segment[rank]:
            yield full + sum(segment[:rank]), local, segment[rank]
        full += sum(segment)
        local += segment[rank]


def _local(sizes: Sizes, rank: int) -> int:
    return sum(segment[rank] for segment in sizes)


def _shape(x: torch.Tensor, tokens: int, features: int | None = None) -> tuple[int, ...]:
    return (x.shape[0], tokens, *x.shape[2:-1], x.shape[-1] if features is None else features)


Emit = Callable[[int, torch.Tensor, bool], None]
"""``emit(rank, src, full)``: rank ``rank``'s tokens are in ``src``, at their places in the full tensor
(``full``) or as that rank holds them."""


def _exchange_gather(x: torch.Tensor, name: str, group_name: str, sizes: Sizes, emit: Emit) -> None:
    """Calls ``emit`` for every rank's tokens of ``x``: this rank's first, straight from ``x`` (beside the
    copy engine's transfers to the peers, for a batch of one), then each peer's once they landed."""
    group = _resolve_process_group(group_name)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = peer_buffers(group)
    if peers is None:
        shapes = [_shape(x, _local(sizes, rank)) for rank in range(world)]
        received = _all_to_all([x.contiguous()] * world, shapes, group)
        for rank in _mine_first(me, world):
            emit(rank, x if rank == me else received[rank], False)
        return
    joined = peers.views(f"gather:{name}", [_shape(x, sum(map(sum, sizes)))] * world, x.dtype)
    copies = [
        (joined[rank].narrow(_SEQ, at, length), x.narrow(_SEQ, start, length))
        for rank in range(world)
        if rank != me
        for at, start, length in _pieces(sizes, me)
    ]
    sent = None
    if x.shape[0] == 1 and x.is_contiguous():
        sent = peers.copy_beside(copies)
    else:
        for dst, src in copies:
            copy_rows_(dst, src)
    emit(me, x, False)
    peers.wait(sent)
    peers.barrier()
    for rank in _mine_first(me, world)[1:]:
        emit(rank, joined[me], True)


def _exchange_sum(
    like: torch.Tensor, features: int, name: str, group_name: str, sizes: Sizes, partial_of: Callable
) -> torch.Tensor:
    """Sums, over the ranks and in rank order, every rank's ``partial_of(dst, rank)`` for this rank:
    ``partial_of`` writes the partial sums of rank ``rank``'s tokens into ``dst`` (``[B, its tokens, ...,
    features]``), a peer's own buffer where peer writes serve."""
    group = _resolve_process_group(group_name)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    shapes = [_shape(like, _local(sizes, rank), features) for rank in range(world)]
    mine = like.new_empty(shapes[me])
    peers = peer_buffers(group)
    if peers is not None:
        inbox = peers.views(f"sum:{name}", [(world, *shape) for shape in shapes], like.dtype)
        for rank in _mine_first(me, world)[1:]:
            partial_of(inbox[rank][me], rank)
        partial_of(mine, me)
        peers.barrier()
        received = [mine if rank == me else inbox[me][rank] for rank in range(world)]
    else:
        sends = [mine if rank == me else like.new_empty(shapes[rank]) for rank in range(world)]
        for rank in range(world):
            partial_of(sends[rank], rank)
        received = _all_to_all(sends, [shapes[me]] * world, group)
        received[me] = mine
    out = torch.add(received[0], received[1])
    for piece in received[2:]:
        out += piece
    return out


def _mine_first(me: int, world: int) -> list[int]:
    return [(me + step) % world for step in range(world)]


def _starts(sizes: Sizes, rank: int, full: bool) -> Iterator[tuple[int, int, int]]:
    """(start in the full tensor, start in ``rank``'s source, length) of its segments in a source holding
    them at their full places (``full``) or as that rank holds them."""
    for at, start, length in _pieces(sizes, rank):
        yield at, at if full else start, length


def _gather(x: torch.Tensor, name: str, group_name: str, sizes: Sizes) -> torch.Tensor:
    out = x.new_empty(_shape(x, sum(map(sum, sizes))))

    def emit(rank: int, src: torch.Tensor, full: bool) -> None:
        for at, start, length in _starts(sizes, rank, full):
            copy_rows_(out.narrow(_SEQ, at, length), src.narrow(_SEQ, start, length))

    _exchange_gather(x, name, group_name, sizes, emit)
    return out


def _gathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str, group_name: str, sizes: Sizes
) -> torch.Tensor:
    out = x.new_empty(_shape(x, sum(map(sum, sizes)), weight.shape[0]))

    def emit(rank: int, src: torch.Tensor, full: bool) -> None:
        for at, start, length in _starts(sizes, rank, full):
            _linear_into(out.narrow(_SEQ, at, length), src.narrow(_SEQ, start, length), weight, bias)

    _exchange_gather(x, name, group_name, sizes, emit)
    return out


def _sum(partial: torch.Tensor, name: str, group_name: str, sizes: Sizes) -> torch.Tensor:
    def partial_of(dst: torch.Tensor, rank: int) -> None:
        for at, start, length in _pieces(sizes, rank):
            copy_rows_(dst.narrow(_SEQ, start, length), partial.narrow(_SEQ, at, length))

    return _exchange_sum(partial, partial.shape[-1], name, group_name, sizes, partial_of)


def _linear_summed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str, group_name: str, sizes: Sizes
) -> torch.Tensor:
    def partial_of(dst: torch.Tensor, rank: int) -> None:
        for at, start, length in _pieces(sizes, rank):
            _linear_into(dst.narrow(_SEQ, start, length), x.narrow(_SEQ, at, length), weight, bias)

    return _exchange_sum(x, weight.shape[0], name, group_name, sizes, partial_of)


def _linear_into(
    dst: torch.Tensor, src: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """``dst.copy_(F.linear(src, weight, bias))``, the GEMM writing ``dst`` itself where it can (a batch of
    one: its rows are contiguous), wherever ``dst`` lives (a peer's memory included). ``src`` is made
    contiguous first, so the GEMM is the same call wherever the rows came from."""
    rows = src.contiguous().view(-1, src.shape[-1])
    if not dst.is_contiguous():
        dst.copy_(F.linear(rows, weight, bias).view(dst.shape))
        return
    into = dst.view(-1, dst.shape[-1])
    if bias is None:
        torch.mm(rows, weight.t(), out=into)
    else:
        torch.addmm(bias, rows, weight.t(), out=into)


def _all_to_all(
    sends: list[torch.Tensor], shapes: list[tuple[int, ...]], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Sends ``sends[r]`` to rank ``r``; returns what rank ``r`` sent this one (of ``shapes[r]``)."""
    send = torch.cat([piece.reshape(-1) for piece in sends])
    counts = [int(torch.Size(shape).numel()) for shape in shapes]
    recv = send.new_empty(sum(counts))
    dist.all_to_all_single(recv, send, counts, [piece.numel() for piece in sends], group=group)
    return [part.view(shape) for part, shape in zip(recv.split(counts), shapes, strict=True)]


def _flat(sizes: Sizes) -> list[int]:
    return [size for segment in sizes for size in segment]


def _table(flat: Sequence[int], segments: int) -> Sizes:
    world = len(flat) // segments
    return tuple(tuple(flat[s * world : (s + 1) * world]) for s in range(segments))


# Compiled graphs call the exchanges as opaque ops: their communication never traces.
@torch.library.custom_op("omni_accel::gather_rows", mutates_args=())
def _gather_op(x: torch.Tensor, name: str, group: str, sizes: list[int], segments: int) -> torch.Tensor:
    return _gather(x, name, group, _table(sizes, segments))


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
    return _gathered_linear(x, weight, bias, name, group, _table(sizes, segments))


@_gathered_linear_op.register_fake
def _(x, weight, bias, name, group, sizes, segments):
    return x.new_empty(_shape(x, sum(sizes), weight.shape[0]))


def _local_fake(
    like: torch.Tensor, group: str, sizes: list[int], segments: int, features: int
) -> torch.Tensor:
    rank = dist.get_rank(_resolve_process_group(group))
    return like.new_empty(_shape(like, _local(_table(sizes, segments), rank), features))


@torch.library.custom_op("omni_accel::sum_rows", mutates_args=())
def _sum_op(partial: torch.Tensor, name: str, group: str, sizes: list[int], segments: int) -> torch.Tensor:
    return _sum(partial, name, group, _table(sizes, segments))


@_sum_op.register_fake
def _(partial, name, group, sizes, segments):
    return _local_fake(partial, group, sizes, segments, partial.shape[-1])


@torch.library.custom_op("omni_accel::linear_summed", mutates_args=())
def _linear_summed_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    name: str,
    group: str,
    sizes: list[int],
    segments: int,
) -> torch.Tensor:
    return _linear_summed(x, weight, bias, name, group, _table(sizes, segments))


@_linear_summed_op.register_fake
def _(x, weight, bias, name, group, sizes, segments):
    return _local_fake(x, group, sizes, segments, weight.shape[0])
