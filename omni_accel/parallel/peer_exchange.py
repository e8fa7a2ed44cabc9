"""Sequence parallelism's exchanges by peer writes, between the GPUs of one machine: every rank writes each
peer's piece straight into that peer's buffer (``peer_memory``), and barriers say when the pieces have
landed. No communication kernel runs beside compute: NCCL's all-to-alls, posted on a side stream to overlap
the kernel, took SMs from it and held them waiting for the slower peer, and a persistent kernel such as
FlashInfer's held NCCL's ring transfers back until it finished (docs/PARALLELISM.md).

Ulysses (``PeerHeads``) takes its inputs two ways:

* placed (``placement``, the native blocks): the q/k kernel that writes q, k and v anyway writes each head
  group into the buffer of the rank that attends over it, a peer's as NVLink stores, or into a local
  tensor the copy engine sends on a side stream beside independent work (a FLUX single block's MLP GEMM);
  then one kernel over the rank's heads, or for long sequences one per head stage, the later stage's heads
  staged and sent by the copy engine beside the kernel before;
* packed (any other caller): the first head stage's pieces are written by the packing copy itself
  (``copy_rows_``), the later stages' by the copy engine beside the stage before's kernel.

Outputs go back by the copy engine beside a later stage's kernel or beside work the caller has for that
time (a single-stream block's GELU), else by the SM copy. One buffer per slot serves every call of a group
without a handshake of its own: a peer writes into this rank's buffers for the next call only after a
barrier this rank reaches once it has used what they hold (the last one before a stage's kernel for the
inputs, the next call's first for the outputs).

The ring (``PeerRing``) writes every rank's K/V block into every peer's buffer by the copy engine. On two
ranks this is the ring's one transfer; on more it gathers every block at once instead of passing them
around, which costs a rank the whole sequence's K/V in memory (0.7 GB for Wan 14B at 480p, 81 frames) and
spares the ring's steps. Rank ``j``'s buffer holds the blocks in ring order from its own: ``j, j + 1,
...``, so the blocks of the other ranks are one contiguous run: the kernel attends over the local block
while they travel, then over theirs, or (with work beside the exchange) once over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .copies import copy_rows_
from .exchange import Block, HeadsInFlight, KVInFlight, OutputsBack
from .peer_memory import PeerBuffers
from .placement import Placement

_SEQ, _HEADS = 1, 2


class PeerHeads:
    """Ulysses by peer writes over ``peers``, the group's buffers."""

    def __init__(self, peers: PeerBuffers) -> None:
        self.peers = peers

    def send_heads(
        self,
        stage: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        first: int,
        heads: Sequence[int],
        sizes: Sequence[int],
        kv_sizes: Sequence[int],
    ) -> HeadsInFlight:
        """The first stage's pieces written into the peers' buffers by the packing copy; a later stage's
        packed here and sent by the copy engine, beside the kernel of the stage before."""
        copies, gathered = [], []
        for name, t, lengths in zip("qkv", qkv, (sizes, kv_sizes, kv_sizes), strict=True):
            staged = copies if stage else None
            gathered.append(_gather_heads(self.peers, f"{name}{stage}", t, first, heads, lengths, staged))
        return _Landing(self.peers, tuple(gathered), self.peers.copy_beside(copies) if copies else None)

    def placed(self, placement: Placement) -> list[HeadsInFlight]:
        """Each stage's inputs as ``placement`` (this exchange's) put them, the staged pieces sent now."""
        gathered = [placement.attend_on, *(on for on, _ in placement.later)]
        sends = [self.peers.copy_beside(copies) if copies else None for copies in placement.all_sends()]
        return [_Landing(self.peers, on, sent) for on, sent in zip(gathered, sends, strict=True)]

    def outputs(
        self, sizes: Sequence[int], shape: Sequence[int], like: torch.Tensor, out: torch.Tensor | None
    ) -> OutputsBack:
        return _PeerOutputs(self.peers, sizes, like.new_empty(shape) if out is None else out)

    def placement(
        self,
        sizes: Sequence[int],
        kv_sizes: Sequence[int],
        stages: Sequence[tuple[int, Sequence[int]]],
        batch: int,
        dims: tuple[int, int],
        dtype: torch.dtype,
        staged: bool = False,
    ) -> Placement:
        """Where this rank's q, k and v go for ``placed``, by head stage (``(first head, heads of each
        rank)``): rank ``j``'s heads of a stage into rank ``j``'s buffer of it (``[B, all tokens, heads,
        D]``) at this rank's tokens, so their producer does the exchange; attention then takes this rank's
        buffers. The first stage's peers' heads are written straight into their memory, or (``staged``)
        into a local tensor the copy engine sends on beside other work; a later stage's always so, sent
        beside the stage before's kernel. ``dims``: the head sizes of q and k, and of v."""
        peers = self.peers
        me, world = peers.rank, peers.world
        pieces, attend_on, sends = {"q": [], "k": [], "v": []}, [], []
        for index, (first, heads) in enumerate(stages):
            stage_sends, joined_here = [], []
            staging = staged or index > 0
            for name, lengths, width in (
                ("q", sizes, dims[0]),
                ("k", kv_sizes, dims[0]),
                ("v", kv_sizes, dims[1]),
            ):
                shapes = [(batch, sum(lengths), heads[j], width) for j in range(world)]
                joined = peers.views(f"{name}_placed{index}", shapes, dtype)
                at = sum(lengths[:me])
                if staging:  # kept, like the buffers: the kernel's table of destinations stays the same
                    others = [(batch * lengths[r] * (sum(heads) - heads[r]) * width,) for r in range(world)]
                    rest = peers.views(f"{name}_staged{index}", others, dtype)[me]
                for j in range(world):
                    if heads[j]:
                        dst = joined[j].narrow(_SEQ, at, lengths[me])
                        if staging and j != me and dst.numel():
                            local, rest = rest.split([dst.numel(), rest.numel() - dst.numel()])
                            local = local.view(dst.shape)
                            stage_sends += zip(dst.unbind(0), local.unbind(0), strict=True)
                            dst = local
                        pieces[name].append((first + sum(heads[:j]), dst))
                joined_here.append(joined[me])
            attend_on.append(tuple(joined_here))
            sends.append(tuple(stage_sends))
        later = tuple(zip(attend_on[1:], sends[1:], strict=True))
        q, k, v = (tuple(pieces[name]) for name in "qkv")
        return Placement(q, k, v, attend_on[0], sends[0], later)


class _Landing:
    """A stage's inputs written or on their way: usable once the copy engine's part is joined and a
    barrier says every rank's writes have landed."""

    def __init__(self, peers: PeerBuffers, gathered: tuple, sent: object) -> None:
        self.peers, self.gathered, self.sent = peers, gathered, sent

    def arrived(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.peers.wait(self.sent)
        self.peers.barrier()
        q, k, v = self.gathered
        return q, k, v


class _PeerOutputs:
    """Each stage's outputs written into the peers' buffers as the stage's kernel ends (this rank's own
    tokens straight into ``out``); after a last barrier the peers' pieces are unpacked into ``out``."""

    def __init__(self, peers: PeerBuffers, sizes: Sequence[int], out: torch.Tensor) -> None:
        self.peers, self.sizes, self.out = peers, sizes, out
        self.stages: list[tuple[int, Sequence[int]]] = []
        self.sent: list[object] = []

    def send(self, o: torch.Tensor, first: int, heads: Sequence[int], beside: bool) -> None:
        slot = f"out{len(self.stages)}"
        self.sent.append(_scatter_tokens(self.peers, slot, o, self.out, first, heads, self.sizes, beside))
        self.stages.append((first, heads))

    def joined(self) -> torch.Tensor:
        peers, out = self.peers, self.out
        for sent in self.sent:
            peers.wait(sent)
        peers.barrier()
        for index, (first, heads) in enumerate(self.stages):
            received = _received(peers, f"out{index}", out, heads, self.sizes)[peers.rank]
            for i in range(peers.world):
                if i != peers.rank:
                    _write(out.narrow(_HEADS, first + sum(heads[:i]), heads[i]), received[i])
        return out


def _gather_heads(
    peers: PeerBuffers,
    slot: str,
    t: torch.Tensor,
    first: int,
    heads: Sequence[int],
    lengths: Sequence[int],
    copies: list | None,
) -> torch.Tensor:
    """Writes this rank's tokens of rank ``j``'s heads into rank ``j``'s buffer (``[B, all tokens, heads[j],
    D]``); returns this rank's. With ``copies``, the peers' pieces are packed here and their transfers
    appended to ``copies`` for the copy engine."""
    me, world = peers.rank, peers.world
    batch, _, _, dim = t.shape
    joined = peers.views(slot, [(batch, sum(lengths), heads[j], dim) for j in range(world)], t.dtype)
    at = sum(lengths[:me])
    for j in range(world):
        piece = t.narrow(_HEADS, first + sum(heads[:j]), heads[j])
        dst = joined[j].narrow(_SEQ, at, lengths[me])
        if copies is not None and j != me and piece.numel():
            # a sample's tokens are contiguous in the buffer (the copy engine moves contiguous pairs)
            copies.extend(zip(dst.unbind(0), _packed(piece).unbind(0), strict=True))
        else:
            _write(dst, piece)
    return joined[me]


def _received(
    peers: PeerBuffers, slot: str, out: torch.Tensor, heads: Sequence[int], sizes: Sequence[int]
) -> list[list[torch.Tensor]]:
    """Every rank's output buffer of a stage, split by the rank whose heads each piece holds: on rank
    ``j``, piece ``i`` is ``[B, sizes[j], heads[i], Dv]``."""
    batch, dim = out.shape[0], out.shape[-1]
    flat = peers.views(slot, [(batch * size * sum(heads) * dim,) for size in sizes], out.dtype)
    return [
        [
            part.view(batch, size, count, dim)
            for part, count in zip(buffer.split([batch * size * h * dim for h in heads]), heads, strict=True)
        ]
        for buffer, size in zip(flat, sizes, strict=True)
    ]


def _scatter_tokens(
    peers: PeerBuffers,
    slot: str,
    o: torch.Tensor,
    out: torch.Tensor,
    first: int,
    heads: Sequence[int],
    sizes: Sequence[int],
    beside: bool,
):
    """Sends rank ``j`` its tokens of this rank's heads of a stage (``o`` holds every token); this rank's
    own go straight into ``out``. Returns the copy engine's transfers in flight, if ``beside``."""
    me, world = peers.rank, peers.world
    buffers = _received(peers, slot, out, heads, sizes)
    at = [sum(sizes[:j]) for j in range(world)]
    copies = []
    for j in range(world):
        piece = o.narrow(_SEQ, at[j], sizes[j])
        if j == me:
            _write(out.narrow(_HEADS, first + sum(heads[:me]), heads[me]), piece)
        elif beside and piece.numel():
            copies.append((buffers[j][me], _packed(piece)))
        else:
            _write(buffers[j][me], piece)
    return peers.copy_beside(copies) if copies else None


class PeerRing:
    """The ring by peer writes over ``peers``, the group's buffers. The copies are fenced
    (``PeerBuffers.copy_beside``): a rank writes into a peer's buffer only after every rank has run the
    kernels it enqueued before, among them the last call's kernel over that buffer, so one buffer per slot
    serves every call."""

    def __init__(self, peers: PeerBuffers) -> None:
        self.peers = peers

    def circulate(
        self, k: torch.Tensor, v: torch.Tensor, kv_sizes: Sequence[int], placed: bool, whole: bool
    ) -> KVInFlight:
        peers = self.peers
        me, world = peers.rank, peers.world
        mine = kv_sizes[me]
        keys, values = _ring_buffers(peers, kv_sizes, k.shape[0], k.shape[2], k.shape[3], v.shape[3], k.dtype)
        own_k, own_v = keys[me].narrow(_SEQ, 0, mine), values[me].narrow(_SEQ, 0, mine)
        if not placed and not whole and k.is_contiguous() and v.is_contiguous():
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
        return _Written(peers, (own_k, own_v), (keys[me], values[me]), sum(kv_sizes), sent)

    def placement(
        self, kv_sizes: Sequence[int], batch: int, heads: int, dim: int, v_dim: int, dtype: torch.dtype
    ) -> Placement:
        """This rank's K and V block in its own buffers (q anywhere): written there by their producer, they
        need no copy before they travel."""
        keys, values = _ring_buffers(self.peers, kv_sizes, batch, heads, dim, v_dim, dtype)
        mine = kv_sizes[self.peers.rank]
        k, v = (t[self.peers.rank].narrow(_SEQ, 0, mine) for t in (keys, values))
        return Placement(None, ((0, k),), ((0, v),), (None, k, v))


class _Written:
    """Every block on its way into every buffer: this rank's usable at once, the others' one contiguous
    run after the fence."""

    def __init__(self, peers: PeerBuffers, own: tuple, joined: tuple, total: int, sent: object) -> None:
        self.peers, self.own, self.joined, self.total, self.sent = peers, own, joined, total, sent

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.peers.wait(self.sent)
        return self.joined

    def blocks(self) -> Iterator[Block]:
        mine = self.own[0].shape[_SEQ]
        if mine:
            yield *self.own, mine == self.total
        self.peers.wait(self.sent)
        if self.total > mine:
            yield *(t.narrow(_SEQ, mine, self.total - mine) for t in self.joined), True


def _ring_buffers(peers: PeerBuffers, kv_sizes: Sequence[int], batch, heads, dim, v_dim, dtype):
    total = sum(kv_sizes)
    keys = peers.views("ring_k", [(batch, total, heads, dim)] * peers.world, dtype)
    values = peers.views("ring_v", [(batch, total, heads, v_dim)] * peers.world, dtype)
    return keys, values


def _packed(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` contiguous, as the copy engine moves it."""
    if piece.is_contiguous():
        return piece
    return copy_rows_(torch.empty(piece.shape, dtype=piece.dtype, device=piece.device), piece)


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.numel():
        copy_rows_(dst, src)
