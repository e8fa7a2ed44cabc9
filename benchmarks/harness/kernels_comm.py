"""The exchanges of sequence and tensor parallelism on two ranks: their bandwidth, and whether a Ulysses
transfer runs beside the attention kernel. The full runs are launched by torchrun on two GPUs (NCCL);
``--tiny`` forks two CPU processes that talk over gloo."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_accel.attention import AttentionRequest, get_provider
from omni_accel.parallel.copies import copy_rows_

from .kernels_run import Commands, Run, option
from .timing import graphed, timed

RankWork = Callable[[Run, argparse.Namespace], None]
_TINY_WORLD = 2


def on_ranks(work: RankWork, run: Run, args: argparse.Namespace) -> None:
    """``work`` on every rank, rank 0's results and skips landing in ``run``: under torchrun each rank
    runs this (NCCL, the GPU of ``LOCAL_RANK``); with ``--tiny`` two forked CPU processes do, over gloo."""
    if run.tiny:  # forked: a spawned child would import every module again (~10 s on two busy cores)
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(_tiny_rank, (work, run, args, folder), _TINY_WORLD, start_method="fork")
            reported = json.loads(Path(folder, "rank0.json").read_text())
        run.results.update(reported["results"])
        run.skipped.update(reported["skipped"])
        return
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(
            f"launch it on two GPUs: torchrun --nproc-per-node 2 benchmarks/kernel_bench.py {args.command}"
        )
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    try:
        work(run, args)
    finally:
        dist.destroy_process_group()


def _tiny_rank(rank: int, work: RankWork, run: Run, args: argparse.Namespace, folder: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=_TINY_WORLD
    )
    try:
        with torch.no_grad():
            work(run, args)
        if rank == 0:
            Path(folder, "rank0.json").write_text(
                json.dumps({"results": run.results, "skipped": run.skipped})
            )
    finally:
        dist.destroy_process_group()


def _synced_ms(run: Run, fn: Callable[[], object]) -> float:
    """One timed call of ``fn``, every rank starting it together (device synchronized, then a barrier)."""
    run.synchronize()
    dist.barrier()
    return timed(fn, run.device)[1]


# (tokens over all ranks, width): a FLUX block at 1024x1024; half of Wan 14B's heads (one Ulysses stage)
COLLECTIVE_SHAPES = {"flux": (4608, 3072), "wan": (32760, 2560)}
TINY_COLLECTIVE_SHAPES = {"flux": (64, 48), "wan": (126, 40)}


def _back_to_back_ms(run: Run, fn: Callable[[], object], graph: bool, calls: int) -> float:
    """Mean over ``calls`` back-to-back calls (ms) after a warm-up, launched one by one or as one graph."""
    if graph:  # graphed warms up before it captures; run() below warms up both
        calls_of_fn = graphed(fn, calls, capture_error_mode="thread_local")
    else:

        def calls_of_fn():
            for _ in range(calls):
                fn()

    calls_of_fn()
    return _synced_ms(run, calls_of_fn) / calls


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


def _symmetric_cases(run: Run, x: torch.Tensor, gathered: torch.Tensor) -> dict[str, Callable]:
    """The exchanges through symmetric memory (CUDA peer memory): those this build and machine have."""
    cases = {}
    if not run.cuda:
        run.skip("the exchanges through symmetric memory", "need CUDA peer memory")
        return cases
    for name, copy_engine in (("symmetric memory, copy engine", True), ("symmetric memory, SM copy", False)):
        try:
            cases[f"all_to_all ({name})"] = _symmetric_all_to_all(x, copy_engine)
        except Exception as exc:  # not every build or machine has it: say so, keep the other cases
            run.skip(f"all_to_all ({name})", f"{type(exc).__name__}: {exc}")
    for op in ("two_shot", "one_shot"):
        try:
            cases[f"all_reduce (TP, symmetric memory, {op})"] = _symmetric_all_reduce(gathered, op)
        except Exception as exc:
            run.skip(f"{op} all-reduce", f"{type(exc).__name__}: {exc}")
    return cases


def _collectives_on_rank(run: Run, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, width = (TINY_COLLECTIVE_SHAPES if run.tiny else COLLECTIVE_SHAPES)[args.shape]
    tokens //= world  # this rank's tokens
    x = run.randn(tokens, width)
    kv = run.randn(tokens, 2 * width)
    out = torch.empty_like(x)
    gathered = run.randn(world * tokens, width)
    uneven = [tokens * width // world + (1 if r == 0 else -1) * width for r in range(world)]
    flat = x.view(-1)
    received = [uneven[rank]] * world  # every rank sends rank r its piece r
    flat_out = torch.empty(sum(received), device=run.device, dtype=run.dtype)
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
        **_symmetric_cases(run, x, gathered),
    }
    if not run.cuda:
        run.skip("CUDA-graph replays", f"need CUDA: the calls run eagerly on {run.device}")
    megabytes = x.numel() * x.element_size() / 1e6
    run.results.update(shape=args.shape, backend=dist.get_backend(), mb_per_rank=megabytes)
    for name, fn in cases.items():
        try:
            row = {"eager_us": 1000 * _back_to_back_ms(run, fn, False, args.calls)}
            if run.cuda:
                row["graphed_us"] = 1000 * _back_to_back_ms(run, fn, True, args.calls)
        except Exception as exc:
            row = {"error": f"{type(exc).__name__}: {exc}"}
        if rank == 0:
            run.results[name] = row
            shown = row.get("error") or ", ".join(
                f"{k.removesuffix('_us')} {v:7.1f} us" for k, v in row.items()
            )
            print(f"{name:42s} {megabytes:.1f} MB/rank: {shown}", flush=True)


def collectives(run: Run, args: argparse.Namespace) -> None:
    """Bandwidth of the exchanges sequence and tensor parallelism make per block, on two ranks.

    At FLUX.1-dev's 1024x1024 shapes (or one Wan 14B Ulysses stage at 480p, 81 frames): the Ulysses
    all-to-all (even and uneven splits; NCCL, and the same exchange through symmetric memory: each rank
    writes its pieces straight into the peers' buffers, by the copy engine or by an SM copy kernel, then a
    barrier), the same bytes by all-gather, a ring P2P transfer of K/V, and the TP all-reduce (NCCL, and
    PyTorch's symmetric-memory one- and two-shot all-reduces); us per call, eager and replayed from a CUDA
    graph. Launched on two GPUs by ``torchrun --nproc-per-node 2``."""
    on_ranks(_collectives_on_rank, run, args)


# (tokens, heads of one stage on one rank after the exchange): Wan 14B 480p 81 frames, FLUX 1024x1024
OVERLAP_SHAPES = {"wan": (32760, 10), "flux": (4608, 6)}
TINY_OVERLAP_SHAPES = {"wan": (64, 2), "flux": (32, 2)}


def _median_synced_ms(run: Run, fn: Callable[[], object], calls: int = 7) -> float:
    fn()
    return statistics.median(_synced_ms(run, fn) for _ in range(calls))


def _overlap_on_rank(run: Run, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    side = torch.cuda.Stream() if run.cuda else None  # torch.cuda.stream(None) is a no-op
    if side is None:
        run.skip(
            "the exchange on a side stream", "needs CUDA streams: the exchange and the attention run in turn"
        )

    def fork() -> None:
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())

    def join() -> None:
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    for shape, (tokens, heads) in (TINY_OVERLAP_SHAPES if run.tiny else OVERLAP_SHAPES).items():
        q, k, v = (run.randn(1, tokens, heads, 128) for _ in range(3))
        # One stage's three tensors as this rank holds them before the exchange: its tokens, 2x the heads.
        sends = [run.randn(tokens // world * heads * world * 128)] * 3
        recvs = [torch.empty_like(s) for s in sends]

        def collective(sends=sends, recvs=recvs):
            with torch.cuda.stream(side):
                for send, recv in zip(sends, recvs, strict=True):
                    dist.all_to_all_single(recv, send)

        exchanges, barrier = {dist.get_backend(): collective}, {}
        if run.cuda:
            by_peer_writes, handle = _peer_writes(sends, side)
            exchanges.update(by_peer_writes)
            barrier = dict.fromkeys(by_peer_writes, handle)
        else:
            run.skip("the exchanges by peer writes: copy engine, SM copy", "need CUDA peer memory")
        for provider_name in args.providers:
            provider = get_provider(provider_name)
            reasons = provider.reasons_against(AttentionRequest.for_call(q, k))
            if reasons:
                run.skip(provider_name, "; ".join(reasons))
                continue

            def attend(provider=provider, q=q, k=k, v=v):
                return provider.forward(q, k, v)

            alone = _median_synced_ms(run, attend)
            for name, exchange in exchanges.items():
                only = _median_synced_ms(run, lambda exchange=exchange: (exchange(), join()))

                ends = barrier.get(name)  # peer writes end with the barrier, after the kernel

                def both(exchange=exchange, attend=attend, ends=ends):
                    fork()
                    exchange()
                    attend()
                    join()
                    if ends is not None:
                        ends.barrier(channel=0)

                together = _median_synced_ms(run, both)
                if rank == 0:
                    run.results.setdefault(shape, {}).setdefault(provider_name, {})[name] = {
                        "attention_ms": alone,
                        "exchange_ms": only,
                        "together_ms": together,
                        "ideal_ms": max(alone, only),
                    }
                    print(
                        f"{shape:5s} {provider_name:11s} {name:12s} attention {alone:7.3f} ms, exchange {only:7.3f}"
                        f" ms, together {together:7.3f} ms (ideal {max(alone, only):7.3f})",
                        flush=True,
                    )


def _peer_writes(sends: list[torch.Tensor], side: torch.cuda.Stream):
    """The exchange of ``sends`` through symmetric memory, each rank writing its pieces into the peers'
    buffers on ``side``, by the copy engine or by an SM copy kernel; and the handle whose barrier ends it."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    buffers = [symm_mem.empty(s.numel(), dtype=s.dtype, device="cuda") for s in sends]
    handles = [symm_mem.rendezvous(b, dist.group.WORLD) for b in buffers]
    slots = [
        [h.get_buffer(j, (world, s.numel() // world), s.dtype)[rank] for j in range(world)]
        for h, s in zip(handles, sends, strict=True)
    ]

    def by(copy_engine: bool):
        def write_to_peers():
            with torch.cuda.stream(side):
                for send, peers in zip(sends, slots, strict=True):
                    pieces = send.view(world, -1)
                    for j in range(world):
                        if copy_engine:
                            peers[j].copy_(pieces[j])
                        else:
                            copy_rows_(peers[j].view(1, -1), pieces[j].view(1, -1))

        return write_to_peers

    return {"copy engine": by(True), "sm copy": by(False)}, handles[0]


def overlap(run: Run, args: argparse.Namespace) -> None:
    """Whether a Ulysses transfer runs beside the attention kernel, on two ranks.

    One stage's exchange (Q, K and V of half the heads) is posted on a side stream while the attention
    kernel of the other stage runs, by NCCL's all-to-all or through symmetric memory (the copy engine, or
    an SM copy kernel, writing into the peer's buffer; a barrier after the kernel). Time of the pair
    against each alone (ms, CUDA events, median). Launched on two GPUs by ``torchrun --nproc-per-node 2``."""
    on_ranks(_overlap_on_rank, run, args)


def register(commands: Commands) -> None:
    parser = commands.add("collectives", collectives)
    parser.add_argument("--shape", choices=list(COLLECTIVE_SHAPES), default="flux")
    option(parser, "--calls", 20, 2, "back-to-back calls per timing")

    parser = commands.add("overlap", overlap)
    option(parser, "--providers", ["flashinfer", "sdpa_cudnn"], ["sdpa"], "attention providers", str, "+")
