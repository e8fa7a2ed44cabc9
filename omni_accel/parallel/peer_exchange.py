"""Ulysses' all-to-alls between the GPUs of one machine without NCCL: every rank writes each peer's piece
straight into that peer's buffer, then one barrier says every piece has landed.

The buffers are symmetric memory (``torch.distributed._symmetric_memory``: each rank maps its peers'), so
the copy that packs a piece anyway (``copy_rows_``) is the transfer, as NVLink stores, and no
communication kernel runs beside the compute. NCCL's all-to-alls, posted on a side stream to overlap the
attention kernel, took SMs from it and held them waiting for the slower peer (docs/PARALLELISM.md).

One buffer per slot serves every attention call of a group without a handshake of its own: a peer writes
the next call's pieces only after passing a barrier this rank reaches after it has used the previous
call's (see ``ulysses_by_peer_writes``). Buffers grow when a call needs more and are never freed while
the group lives: captured CUDA graphs hold their addresses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..utils.logging import get_logger
from .copies import copy_rows_

logger = get_logger(__name__)

_SEQ, _HEADS = 1, 2
ENABLED = True  # benchmarks flip it for an A/B against NCCL's all-to-all


class PeerBuffers:
    """Each rank's buffer of every slot, as tensors this rank can write, and a barrier over the group.

    ``allocate(numel, dtype)`` returns ``(every rank's buffer, barrier)``; the CUDA version maps symmetric
    memory, tests pass one over shared files."""

    def __init__(self, rank: int, world: int, allocate: Callable) -> None:
        self.rank, self.world, self._allocate = rank, world, allocate
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
                    "sequence parallelism: a peer buffer must grow inside a CUDA graph capture; the step's "
                    "eager call should have grown it (report this)"
                )
            if buffers is not None:
                self._kept.append(buffers)
            buffers, barrier = self._allocate(need, dtype)
            self._slots[(slot, dtype)] = buffers
            self._barrier = self._barrier or barrier
        return [buffer[: math.prod(shape)].view(shape) for buffer, shape in zip(buffers, shapes, strict=True)]

    def barrier(self) -> None:
        """Returns (on the stream) once every rank has called it: their earlier writes have landed."""
        self._barrier()


def _symmetric_allocator(group: dist.ProcessGroup) -> Callable:
    import torch.distributed._symmetric_memory as symm_mem

    world = dist.get_world_size(group)
    owners = []  # the allocations and their mappings, alive as long as the views of them

    def allocate(numel: int, dtype: torch.dtype):
        local = symm_mem.empty(numel, dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
        handle = symm_mem.rendezvous(local, group)
        owners.append((local, handle))
        buffers = [handle.get_buffer(rank, (numel,), dtype) for rank in range(world)]
        return buffers, lambda: handle.barrier(channel=0)

    return allocate


_BY_GROUP: dict[str, PeerBuffers | None] = {}
_WHY_NOT: dict[str, str] = {}


def peer_buffers(group: dist.ProcessGroup | None) -> PeerBuffers | None:
    """The peer buffers of ``group``, or None where its ranks cannot write each other's memory (not CUDA,
    not NCCL, symmetric memory unavailable): then NCCL's all-to-all carries the exchange."""
    if not ENABLED or group is None or dist.get_world_size(group) == 1:
        return None
    name = group.group_name
    if name not in _BY_GROUP:
        _BY_GROUP[name] = _try_peer_buffers(group)
    return _BY_GROUP[name]


def _try_peer_buffers(group: dist.ProcessGroup) -> PeerBuffers | None:
    """Decided once per group, by every rank at the same call: a probe buffer is mapped on all of them."""
    backend = dist.get_backend(group)
    if backend != "nccl" or not torch.cuda.is_available():
        _WHY_NOT[group.group_name] = "they need NCCL ranks on CUDA"
        return None
    peers = PeerBuffers(dist.get_rank(group), dist.get_world_size(group), _symmetric_allocator(group))
    try:
        peers.views("probe", [(1,)] * peers.world, torch.int32)
    except Exception as exc:  # no symmetric memory here (no peer access, an older driver, several hosts)
        _WHY_NOT[group.group_name] = f"symmetric memory is unavailable: {str(exc).splitlines()[0][:160]}"
        logger.warning(
            "sequence parallelism: Ulysses exchanges go through NCCL: %s", _WHY_NOT[group.group_name]
        )
        return None
    return peers


def describe_exchange(group: dist.ProcessGroup | None) -> str:
    """How Ulysses' exchanges travel in ``group``, for ``describe``."""
    if group is None or dist.get_world_size(group) == 1:
        return "no exchange (one rank)"
    name = group.group_name
    if not ENABLED:
        return f"{dist.get_backend(group)} all-to-all in two head stages (peer writes switched off)"
    if name not in _BY_GROUP:
        return "decided at the first attention call"
    if _BY_GROUP[name] is not None:
        return "each rank writes its pieces into its peers' symmetric memory, one barrier per exchange"
    return f"{dist.get_backend(group)} all-to-all in two head stages (no peer writes: {_WHY_NOT[name]})"


def forget_groups() -> None:
    """Drops every group's buffers (before the groups are destroyed)."""
    _BY_GROUP.clear()
    _WHY_NOT.clear()


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def ulysses_by_peer_writes(
    peers: PeerBuffers,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sizes: Sequence[int],
    kv_sizes: Sequence[int],
    heads: Sequence[int],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Ulysses attention of BSHD slices (``sizes[i]`` query and ``kv_sizes[i]`` K/V tokens on rank ``i``,
    which attends over ``heads[i]`` consecutive heads): each rank's heads gathered over the whole sequence in its buffers, ``attend`` there, the output sent
    back by sequence slice. The result is this rank's output buffer, valid until the group's next call.

    Order per rank: write Q/K/V pieces, barrier, attend, write output pieces, barrier. A peer writes into
    this rank's Q/K/V buffers for the next call only after the second barrier, which this rank reaches
    after its kernel has read them; and into its output buffer only after the next call's first barrier,
    which this rank reaches after the caller has enqueued its use of this output."""
    me, world = peers.rank, peers.world
    head_at = _offsets(heads)

    def gather_heads(slot: str, t: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        batch, _, _, dim = t.shape
        joined = peers.views(slot, [(batch, sum(lengths), heads[j], dim) for j in range(world)], t.dtype)
        at = sum(lengths[:me])
        for j in range(world):
            _write(joined[j].narrow(_SEQ, at, lengths[me]), t.narrow(_HEADS, head_at[j], heads[j]))
        return joined[me]

    q, k, v = gather_heads("q", q, sizes), gather_heads("k", k, kv_sizes), gather_heads("v", v, kv_sizes)
    peers.barrier()
    out = attend(q, k, v)
    shapes = [(out.shape[0], sizes[j], sum(heads), out.shape[-1]) for j in range(world)]
    outputs = peers.views("out", shapes, out.dtype)
    seq_at = _offsets(sizes)
    for j in range(world):
        _write(outputs[j].narrow(_HEADS, head_at[me], heads[me]), out.narrow(_SEQ, seq_at[j], sizes[j]))
    peers.barrier()
    return outputs[me]


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.numel():
        copy_rows_(dst, src)
