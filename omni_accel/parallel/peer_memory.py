"""Symmetric memory between the GPUs of one machine: each rank's buffers, which its peers write straight
into, and the barriers that say the writes have landed. Whether a group's exchanges use them is decided
once per group, by every rank at the same point, when a layout is applied (``choose_transports``); the
exchanges themselves are ``peer_exchange`` (sequence parallelism) and ``token_rows`` (tensor parallelism's
token split).

The buffers are ``torch.distributed._symmetric_memory`` (each rank maps its peers'). They grow when a call
needs more and are never freed while the group lives, because captured CUDA graphs hold their addresses:
per rank ~56 MB for FLUX at 1024x1024 under Ulysses (placed: 42 MB and 21 MB of staging), ~0.7 GB for
Wan 14B at 480p and 81 frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..utils.logging import get_logger

logger = get_logger(__name__)

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
    if _BY_GROUP.get(name) is not None:
        return by_peer_writes
    why = _WHY_NOT.get(name, "the group is gone (its layout was undone)")
    return f"{dist.get_backend(group)} {otherwise} (no peer writes: {why})"


def forget_groups(names: list[str] | None = None) -> None:
    """Drops the buffers of the groups ``names`` (every group's by default), before they are destroyed."""
    for name in list(_BY_GROUP) if names is None else names:
        _BY_GROUP.pop(name, None)
        _WHY_NOT.pop(name, None)
