"""A CFG step's two transformer calls (cond, uncond: batch 1 each) against the same two branches stacked
in one batch-2 call, per layout, in one torchrun launch: the measurement behind ``batch_guidance`` (stack
under tp/ulysses/ring, not on one GPU).

    torchrun --nproc-per-node 2 benchmarks/stacked_guidance.py --model wan --layouts 1gpu ulysses2
    torchrun --nproc-per-node 2 benchmarks/stacked_guidance.py --model flux --layouts 1gpu ulysses2 tp2
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from parallel_profile import LAYOUTS, MODELS
from timing import interleaved

import omni_accel

BATCHED = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="wan")
    parser.add_argument("--layouts", nargs="+", default=["1gpu", "ulysses2"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device, dtype = f"cuda:{torch.cuda.current_device()}", torch.bfloat16
    for name in args.layouts:
        pipe, cond = MODELS[args.model](device, dtype)
        omni_accel.accelerate(pipe, parallel=LAYOUTS[name])
        text = cond["encoder_hidden_states"]
        uncond = dict(cond, hidden_states=cond["hidden_states"] + 0.1, encoder_hidden_states=text.flip(1))

        def apart(model=pipe.transformer, cond=cond, uncond=uncond):
            return model(**cond)[0], model(**uncond)[0]

        def stacked(model=pipe.transformer, cond=cond, uncond=uncond):
            both = {k: torch.cat([cond[k], uncond[k]]) if k in BATCHED else cond[k] for k in cond}
            return model(**both)[0]

        for _ in range(3):  # warm-up; each shape's graph captures on its second call
            apart(), stacked()
        (a, b), c = apart(), stacked()
        diffs = [(c[i : i + 1] - x).abs().max().item() / x.abs().max().item() for i, x in enumerate((a, b))]
        times = interleaved({"apart": apart, "stacked": stacked}, device, args.rounds, 2)
        if omni_accel.is_main_process():
            p, q = times["apart"]["median_ms"], times["stacked"]["median_ms"]
            print(
                f"{name}: two batch-1 calls {p:.1f} ms, one stacked batch-2 call {q:.1f} ms ({p / q:.3f}x); "
                f"largest difference stacked vs apart, cond {diffs[0]:.2e}, uncond {diffs[1]:.2e} (of the "
                "output's largest value)",
                flush=True,
            )
        del pipe, apart, stacked
        gc.collect()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
