"""Bandwidth of the exchanges sequence and tensor parallelism make per block, at FLUX.1-dev's 1024x1024
shapes on two GPUs (or one Wan 14B Ulysses stage at 480p, 81 frames): the Ulysses all-to-all (even and
uneven splits; NCCL, and the same exchange through symmetric memory: each rank writes its pieces straight
into the peers' buffers, by the copy engine or by an SM copy kernel, then a barrier), the same bytes by
all-gather, a ring P2P transfer of K/V, and the TP all-reduce (NCCL, and PyTorch's symmetric-memory one-
and two-shot all-reduces); eager and replayed from a CUDA graph.

    torchrun --nproc-per-node 2 benchmarks/collectives.py
    torchrun --nproc-per-node 2 benchmarks/collectives.py --shape wan
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from timing import graphed as graph_of

import omni_accel
from omni_accel.parallel.copies import copy_rows_

# (tokens over all ranks, width): a FLUX block at 1024x1024; half of Wan 14B's heads (one Ulysses stage)
SHAPES = {"flux": (4608, 3072), "wan": (32760, 2560)}


def _time(fn, graphed: bool, calls: int = 20) -> float:
    """Mean over ``calls`` back-to-back calls (ms) after a warm-up, launched one by one or as one graph."""
    if graphed:  # graph_of warms up before it captures; run() below warms up both
        run = graph_of(fn, calls, capture_error_mode="thread_local")
    else:

        def run():
            for _ in range(calls):
                fn()

    run()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _symmetric_all_to_all(x: torch.Tensor, copy_engine: bool):
    """All-to-all of ``x``'s equal pieces through symmetric memory: piece ``j`` is written into rank ``j``'s
    buffer (slot ``rank``), then a barrier tells every rank its slots are full."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
    handle = symm_mem.rendezvous(buffer, dist.group.WORLD)
    pieces = x.view(world, -1)
    slots = [handle.get_buffer(j, (world, pieces.shape[1]), x.dtype)[rank] for j in range(world)]

    def exchange():
        for j in range(world):
            if copy_engine:
                slots[j].copy_(pieces[j])
            else:
                copy_rows_(slots[j].view(1, -1), pieces[j].view(1, -1))
        handle.barrier(channel=0)

    return exchange


def _symmetric_all_reduce(x: torch.Tensor, op: str):
    """PyTorch's all-reduce of a symmetric-memory tensor in place (``two_shot``: each rank sums a slice
    and writes it to every rank) or into another tensor (``one_shot``: each rank reads every rank's whole)."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buffer, dist.group.WORLD)
    buffer.copy_(x)
    name = dist.group.WORLD.group_name
    if op == "two_shot":
        return lambda: torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", name)
    out = torch.empty_like(x)
    return lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", name, out)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="flux")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    tokens, width = SHAPES[args.shape]
    tokens //= world  # this rank's tokens, bf16
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    gathered = torch.empty(world * tokens, width, device="cuda", dtype=torch.bfloat16)
    uneven = [tokens * width // world + (1 if r == 0 else -1) * width for r in range(world)]
    flat = x.view(-1)
    received = [uneven[rank]] * world  # every rank sends rank r its piece r
    flat_out = torch.empty(sum(received), device="cuda", dtype=torch.bfloat16)
    peer = (rank + 1) % world
    recv = torch.empty_like(kv)

    def p2p():
        ops = [dist.P2POp(dist.isend, kv, peer), dist.P2POp(dist.irecv, recv, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    cases = {
        "all_to_all_single (even)": lambda: dist.all_to_all_single(out, x),
        "all_to_all_single (uneven splits)": lambda: dist.all_to_all_single(flat_out, flat, received, uneven),
        "all_gather_into_tensor (same bytes sent)": lambda: dist.all_gather_into_tensor(gathered, x),
        "ring P2P of K/V (2x bytes)": p2p,
        "all_reduce (TP, full tokens)": lambda: dist.all_reduce(gathered),
    }
    for name, copy_engine in (("symmetric memory, copy engine", True), ("symmetric memory, SM copy", False)):
        try:
            cases[f"all_to_all ({name})"] = _symmetric_all_to_all(x, copy_engine)
        except Exception as exc:  # not every build or machine has it: say so, keep the other cases
            if omni_accel.is_main_process():
                print(f"{name}: unavailable ({type(exc).__name__}: {exc})")
    for op in ("two_shot", "one_shot"):
        try:
            cases[f"all_reduce (TP, symmetric memory, {op})"] = _symmetric_all_reduce(gathered, op)
        except Exception as exc:
            if omni_accel.is_main_process():
                print(f"{op} all-reduce: unavailable ({type(exc).__name__}: {exc})")
    megabytes = x.numel() * x.element_size() / 1e6
    for name, fn in cases.items():
        try:
            eager, graphed = _time(fn, False), _time(fn, True)
        except Exception as exc:
            if omni_accel.is_main_process():
                print(f"{name:42s} failed: {type(exc).__name__}: {exc}")
            continue
        if omni_accel.is_main_process():
            print(
                f"{name:42s} {megabytes:.1f} MB/rank: eager {eager * 1000:7.1f} us, graphed {graphed * 1000:7.1f} us"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
