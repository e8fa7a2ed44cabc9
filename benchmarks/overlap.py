"""Does a Ulysses transfer run beside the attention kernel? On two GPUs, one stage's exchange (Q, K and V
of half the heads) is posted on a side stream while the attention kernel of the other stage runs, by NCCL's
all-to-all or through symmetric memory (the copy engine, or an SM copy kernel, writing into the peer's
buffer; a barrier after the kernel). Time of the pair against each alone (ms, CUDA events, median).

    torchrun --nproc-per-node 2 benchmarks/overlap.py
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import omni_accel
from omni_accel.attention import get_provider
from omni_accel.parallel.copies import copy_rows_

# (tokens, heads of one stage on one rank after the exchange): Wan 14B 480p 81 frames, FLUX 1024x1024
SHAPES = {"wan": (32760, 10), "flux": (4608, 6)}


def _median_ms(fn, calls: int = 7) -> float:
    fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.no_grad()
def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    side = torch.cuda.Stream()
    for shape, (tokens, heads) in SHAPES.items():
        q, k, v = (torch.randn(1, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        # One stage's three tensors as this rank holds them before the exchange: its tokens, 2x the heads.
        sends = [torch.randn(tokens // world * heads * world * 128, device="cuda", dtype=torch.bfloat16)] * 3
        recvs = [torch.empty_like(s) for s in sends]
        buffers = [symm_mem.empty(s.numel(), dtype=s.dtype, device="cuda") for s in sends]
        handles = [symm_mem.rendezvous(b, dist.group.WORLD) for b in buffers]
        slots = [
            [h.get_buffer(j, (world, s.numel() // world), s.dtype)[rank] for j in range(world)]
            for h, s in zip(handles, sends, strict=True)
        ]

        def nccl(sends=sends, recvs=recvs):
            with torch.cuda.stream(side):
                for send, recv in zip(sends, recvs, strict=True):
                    dist.all_to_all_single(recv, send)

        def symmetric(copy_engine: bool, sends=sends, slots=slots):
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

        exchanges = {"nccl": nccl, "copy engine": symmetric(True), "sm copy": symmetric(False)}
        for provider_name in ("flashinfer", "sdpa_cudnn"):
            provider = get_provider(provider_name)
            if provider.unavailable_reason() is not None:
                continue

            def attend(provider=provider, q=q, k=k, v=v):
                return provider.forward(q, k, v)

            alone = _median_ms(attend)
            for name, exchange in exchanges.items():
                only = _median_ms(
                    lambda exchange=exchange: (exchange(), torch.cuda.current_stream().wait_stream(side))
                )

                def both(exchange=exchange, attend=attend, name=name, handles=handles):
                    side.wait_stream(torch.cuda.current_stream())
                    exchange()
                    attend()
                    torch.cuda.current_stream().wait_stream(side)
                    if name != "nccl":
                        handles[0].barrier(channel=0)

                together = _median_ms(both)
                if omni_accel.is_main_process():
                    print(
                        f"{shape:5s} {provider_name:11s} {name:12s} attention {alone:7.3f} ms, exchange {only:7.3f}"
                        f" ms, together {together:7.3f} ms (ideal {max(alone, only):7.3f})",
                        flush=True,
                    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
