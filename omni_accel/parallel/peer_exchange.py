"""Ulysses' all-to-alls between the GPUs of one machine without NCCL: every rank writes each peer's piece
straight into that peer's buffer, and barriers say when the pieces have landed. (Tensor parallelism's token
exchanges, ``token_rows.py``, use the same buffers.)

The buffers are symmetric memory (``torch.distributed._symmetric_memory``: each rank maps its peers'). Two
ways in:

* placed (``ulysses_placement``, the native blocks): the q/k kernel that writes q, k and v anyway writes
  each head group into the buffer of the rank that attends over it, a peer's as NVLink stores, or into a
  local tensor the copy engine sends on a side stream beside independent work (a FLUX single block's MLP
  GEMM); then one kernel over the rank's heads (``ulysses_in_place``), or for long sequences one per head
  stage, the later stage's heads staged and sent by the copy engine beside the kernel before;
* packed (any other caller): the first head stage's pieces are written by the packing copy itself
  (``copy_rows_``), the later stages' by the copy engine beside the stage before's kernel.

Outputs go back by the copy engine beside a later stage's kernel or beside work the caller has for that
time (a single-stream block's GELU), else by the SM copy. No communication kernel runs beside compute:
NCCL's all-to-alls, posted on a side stream to overlap the kernel, took SMs from it and held them waiting
for the slower peer (docs/PARALLELISM.md).

One buffer per slot serves every attention call of a group without a handshake of its own (see
``ulysses_by_peer_writes`` for the order that makes it safe; a placed call's writes come after the same
barriers). Buffers grow when a call needs more and are never freed while the group lives, because captured
CUDA graphs hold their addresses: per rank ~56 MB for FLUX at 1024x1024 (placed: 42 MB and 21 MB of
staging), ~0.7 GB for Wan 14B at 480p and 81 frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..utils.logging import get_logger
from .copies import copy_rows_
from .overlap import Overlap
from .placement import Placement

logger = get_logger(__name__)

_SEQ, _HEADS = 1, 2
_SIDE_CHANNEL = 1  # the side stream's barriers signal apart from the current stream's (channel 0)


class PeerBuffers:
    """Each rank's buffer of every slot, as tensors this rank can write, and a barrier over the group.

    ``allocate(numel, dtype)`` returns ``(every rank's buffer, barrier)``, the barrier taking a channel
    (barriers on different channels, as on two streams, do not pair with each other); the CUDA version
    maps symmetric memory, tests pass one over shared files."""

    def __init__(
        self, rank: int, world: int, allocate: Callable, side: torch.cuda.Stream | None = None
    ) -> None:
        self.rank, self.world, self._allocate, self._side = rank, world, allocate, side
        self._slots: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._kept: list[list[torch.Tensor]] = []  # outgrown buffers a captured graph may still use
        self._barrier: Callable[[], None] | None = None

    def views(self, slot: str, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Rank ``j``'s buffer of ``slot`` viewed as ``shapes[j]`` (every rank passes the same shapes)."""
        need = max(1, *(math.prod(shape) for shape in shapes))
        buffers = self._slots.get((slot, dtype))
        if buffers is None or buffers[0].numel() < need:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "parallel layout: a peer buffer must grow inside a CUDA graph capture; the step's "
                    "eager call should have grown it (report this)"
                )
            if buffers is not None:
                self._kept.append(buffers)
            buffers, barrier = self._allocate(need, dtype)
            self._slots[(slot, dtype)] = buffers
            self._barrier = self._barrier or barrier
        return [buffer[: math.prod(shape)].view(shape) for buffer, shape in zip(buffers, shapes, strict=True)]

    def copy_beside(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]], fenced: bool = False):
        """``dst.copy_(src)`` for contiguous pairs, by the copy engine on a side stream after the work
        enqueued so far, so they run beside the kernels enqueued next; ``wait`` joins them. (Without a side
        stream, on CPU, at once.) The tensors are held until then, so their memory is not reused early.

        ``fenced`` puts a barrier over the group before the copies (every rank has run the work it enqueued
        before, so the buffers written may be overwritten) and one after them (every rank's copies have
        landed, so after ``wait`` the peers' pieces are here too), both on the side stream: the current
        stream goes on meanwhile. Every rank must call it, with or without copies of its own."""
        if self._side is None:
            self._fence(fenced)
            for dst, src in copies:
                dst.copy_(src)
            self._fence(fenced)
            return None
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            self._fence(fenced, _SIDE_CHANNEL)
            for dst, src in copies:
                dst.copy_(src)
            self._fence(fenced, _SIDE_CHANNEL)
            return self._side.record_event(), copies

    def _fence(self, fenced: bool, channel: int = 0) -> None:
        if fenced:
            self._barrier(channel)

    def wait(self, sent) -> None:
        """The current stream waits for transfers ``copy_beside`` started."""
        if sent is not None:
            torch.cuda.current_stream().wait_event(sent[0])

    def barrier(self) -> None:
        """Returns (on the stream) once every rank has called it: their earlier writes have landed."""
        self._barrier(0)


def _symmetric_allocator(group: dist.ProcessGroup) -> Callable:
    import torch.distributed._symmetric_memory as symm_mem

    world = dist.get_world_size(group)
    owners = []  # the allocations and their mappings, alive as long as the views of them

    def allocate(numel: int, dtype: torch.dtype):
        local = symm_mem.empty(numel, dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
        handle = symm_mem.rendezvous(local, group)
        owners.append((local, handle))
        buffers = [handle.get_buffer(rank, (numel,), dtype) for rank in range(world)]
        return buffers, lambda channel: handle.barrier(channel=channel)

    return allocate


_BY_GROUP: dict[str, PeerBuffers | None] = {}
_WHY_NOT: dict[str, str] = {}


def peer_buffers(group: dist.ProcessGroup | None) -> PeerBuffers | None:
    """The peer buffers of ``group``, or None where its ranks cannot write each other's memory (not CUDA,
    not NCCL, symmetric memory unavailable): then NCCL's all-to-all carries the exchange. (Whether a
    layout uses them is its ``LayoutTuning.peer_writes``.)"""
    if group is None or dist.get_world_size(group) == 1:
        return None
    name = group.group_name
    if name not in _BY_GROUP:
        _BY_GROUP[name] = _try_peer_buffers(group)
    return _BY_GROUP[name]


def choose_transports(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """Decides for each group whether its exchanges are peer writes (mapping its buffers) or its backend's
    collectives, once, when a layout is applied: every rank calls it at the same point."""
    for group in groups:
        peer_buffers(group)


def ranks_write_each_other() -> bool:
    """Whether every rank of the default group can write its peers' memory (decided with them: every rank
    calls it at the same point)."""
    return dist.is_initialized() and peer_buffers(dist.group.WORLD) is not None


def _try_peer_buffers(group: dist.ProcessGroup) -> PeerBuffers | None:
    """Decided once per group, by every rank at the same call: a probe buffer is mapped on all of them."""
    backend = dist.get_backend(group)
    if backend != "nccl" or not torch.cuda.is_available():
        _WHY_NOT[group.group_name] = "they need NCCL ranks on CUDA"
        return None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers = PeerBuffers(rank, world, _symmetric_allocator(group), side=torch.cuda.Stream())
    try:
        peers.views("probe", [(1,)] * peers.world, torch.int32)
    except Exception as exc:  # no symmetric memory here (no peer access, an older driver, several hosts)
        _WHY_NOT[group.group_name] = f"symmetric memory is unavailable: {str(exc).splitlines()[0][:160]}"
        logger.warning(
            "parallel layout: exchanges between GPUs go through NCCL: %s", _WHY_NOT[group.group_name]
        )
        return None
    return peers


def describe_exchange(
    group: dist.ProcessGroup | None, peer_writes: bool, by_peer_writes: str, otherwise: str
) -> str:
    """How exchanges travel in ``group``, for ``describe``: ``by_peer_writes`` says how they go where peer
    writes serve (and ``peer_writes``, the layout's tuning, allows them), ``otherwise`` names the
    collective (after the backend) that carries them elsewhere."""
    if group is None or dist.get_world_size(group) == 1:
        return "no exchange (one rank)"
    name = group.group_name
    if not peer_writes:
        return f"{dist.get_backend(group)} {otherwise} (peer writes switched off: LayoutTuning.peer_writes)"
    if name not in _BY_GROUP:
        return "decided at the first exchange"
    if _BY_GROUP[name] is not None:
        return by_peer_writes
    return f"{dist.get_backend(group)} {otherwise} (no peer writes: {_WHY_NOT[name]})"


def forget_groups() -> None:
    """Drops every group's buffers (before the groups are destroyed)."""
    _BY_GROUP.clear()
    _WHY_NOT.clear()


def ulysses_by_peer_writes(
    peers: PeerBuffers,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sizes: Sequence[int],
    kv_sizes: Sequence[int],
    stages: Sequence[tuple[int, Sequence[int]]],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Ulysses attention of BSHD slices (``sizes[i]`` query and ``kv_sizes[i]`` K/V tokens on rank ``i``)
    in pipeline stages: ``(first head, heads of each rank)`` per stage. Each rank gathers its heads of a
    stage over the whole sequence in its buffers, attends there, and sends each rank its tokens back.

    The first stage's pieces are written by the packing copy itself (SM stores into the peers' memory);
    the later stages' are packed here and sent by the copy engine beside the kernel of the stage before,
    as is every output but the last stage's. A barrier precedes each stage's kernel and the unpacking of
    the outputs. A peer writes into this rank's buffers for the next call only after a barrier this rank
    reaches once it has used what they hold (the last one for the inputs, the next call's first for the
    outputs), so the buffers need no handshake of their own."""
    gathered, sends = [], []
    for index, (first, heads) in enumerate(stages):
        copies, stage = [], []
        for name, t, lengths in (("q", q, sizes), ("k", k, kv_sizes), ("v", v, kv_sizes)):
            stage.append(
                _gather_heads(peers, f"{name}{index}", t, first, heads, lengths, copies if index else None)
            )
        gathered.append(stage)
        sends.append(peers.copy_beside(copies) if copies else None)
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    return _attend_and_return(peers, stages, gathered, sends, attend, out, sizes)[0]


def ulysses_placement(
    peers: PeerBuffers,
    sizes: Sequence[int],
    kv_sizes: Sequence[int],
    stages: Sequence[tuple[int, Sequence[int]]],
    batch: int,
    dims: tuple[int, int],
    dtype: torch.dtype,
    staged: bool = False,
) -> Placement:
    """Where this rank's q, k and v go for ``ulysses_in_place``, by head stage (``(first head, heads of
    each rank)``): rank ``j``'s heads of a stage into rank ``j``'s buffer of it (``[B, all tokens, heads,
    D]``) at this rank's tokens, so their producer does the exchange; attention then takes this rank's
    buffers. The first stage's peers' heads are written straight into their memory, or (``staged``) into a
    local tensor the copy engine sends on beside other work; a later stage's always so, sent beside the
    stage before's kernel. ``dims``: the head sizes of q and k, and of v."""
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


def ulysses_in_place(
    peers: PeerBuffers,
    placement: Placement,
    sizes: Sequence[int],
    stages: Sequence[tuple[int, Sequence[int]]],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    overlap: Overlap,
) -> tuple[torch.Tensor, object]:
    """Ulysses attention over this rank's heads of the whole sequence, stage by stage (as
    ``ulysses_placement`` placed them), and ``overlap.beside()``'s result (or ``then``'s of it): the staged
    pieces travel by the copy engine while ``beside`` runs (a later stage's, while the stage before's kernel
    runs), and once a barrier passes every rank's are here; one kernel per stage, then each rank's tokens of
    its output sent back as ``ulysses_by_peer_writes`` sends a stage's, the last stage's by the copy engine
    while ``then`` runs, into ``overlap.out`` where given."""
    gathered = [placement.attend_on, *(on for on, _ in placement.later)]
    sent = [peers.copy_beside(copies) if copies else None for copies in placement.all_sends()]
    done = overlap.run_beside()
    q, _, v = placement.attend_on
    out, then = overlap.out, overlap.then
    if out is None:
        out = q.new_empty(q.shape[0], sizes[peers.rank], sum(sum(heads) for _, heads in stages), v.shape[-1])
    after = None if then is None else lambda: then(done)
    out, then_done = _attend_and_return(peers, stages, gathered, sent, attend, out, sizes, after)
    return out, (done if then is None else then_done)


def _attend_and_return(peers, stages, gathered, sends, attend, out, sizes, after=None):
    """Each stage's kernel once its inputs have landed (``sends`` joined, a barrier), its outputs sent to
    the ranks whose tokens they are (the copy engine beside the next stage's kernel, or beside ``after()``
    for the last; else the SM copy), and after a last barrier the peers' outputs unpacked into ``out``.
    Returns ``out`` and ``after()``'s result."""
    me, world = peers.rank, peers.world
    returns = []
    for index, (first, heads) in enumerate(stages):
        peers.wait(sends[index])
        peers.barrier()
        o = attend(*gathered[index])
        later = index < len(stages) - 1 or after is not None
        returns.append(_scatter_tokens(peers, f"out{index}", o, out, first, heads, sizes, later))
    done = None if after is None else after()
    for sent in returns:
        peers.wait(sent)
    peers.barrier()
    for index, (first, heads) in enumerate(stages):
        received = _received(peers, f"out{index}", out, heads, sizes)[me]
        for i in range(world):
            if i != me:
                _write(out.narrow(_HEADS, first + sum(heads[:i]), heads[i]), received[i])
    return out, done


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


def _packed(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` contiguous, as the copy engine moves it."""
    if piece.is_contiguous():
        return piece
    return copy_rows_(torch.empty(piece.shape, dtype=piece.dtype, device=piece.device), piece)


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.numel():
        copy_rows_(dst, src)
