"""The floor under a FLUX.1-dev step: its GEMMs and attention calls alone, against omni_accel's whole step."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import omni_accel

from .kernels_run import Commands, Run, option
from .models import MODELS, Holder, build
from .timing import timed


def _linear(run: Run, tokens: int, fan_in: int, fan_out: int) -> tuple[torch.Tensor, ...]:
    return run.randn(tokens, fan_in), run.randn(fan_out, fan_in) * 0.02, run.randn(fan_out) * 0.02


def step_work(run: Run, config: dict, image: int, text: int):
    """The GEMMs (modulation GEMVs included) and attention calls of one step of the FLUX transformer
    ``config`` at ``image`` + ``text`` tokens, as two callables, and their FLOPs."""
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    doubles, singles = config["num_layers"], config["num_single_layers"]
    dim = heads * head_dim
    mlp = 4 * dim  # FLUX's MLP ratio
    tokens = image + text
    gemms = []
    for _ in range(doubles):
        for rows in (image, text):
            gemms += [
                _linear(run, 1, dim, 6 * dim),
                _linear(run, rows, dim, 3 * dim),
                _linear(run, rows, dim, dim),
                _linear(run, rows, dim, mlp),
                _linear(run, rows, mlp, dim),
            ]
    for _ in range(singles):
        gemms += [_linear(run, 1, dim, 3 * dim), _linear(run, tokens, dim, 3 * dim + mlp)]
        gemms += [_linear(run, tokens, dim + mlp, dim)]
    qkv = [run.randn(1, heads, tokens, head_dim) for _ in range(3)]
    if run.cuda:
        backend = SDPBackend.CUDNN_ATTENTION  # as our step runs it
    else:
        backend = SDPBackend.FLASH_ATTENTION
        run.skip("cuDNN attention", f"needs CUDA: PyTorch's {run.device} flash kernel instead")

    def run_gemms():
        for x, w, b in gemms:
            F.linear(x, w, b)

    def run_attention():
        with sdpa_kernel(backend):
            for _ in range(doubles + singles):
                F.scaled_dot_product_attention(*qkv)

    flops = sum(2 * x.shape[0] * w.shape[0] * w.shape[1] for x, w, _ in gemms)
    flops_attention = (doubles + singles) * 4 * tokens * tokens * heads * head_dim
    return run_gemms, run_attention, flops, flops_attention


def power_floor(run: Run, args: argparse.Namespace) -> None:
    """The floor under a FLUX.1-dev step: its GEMMs and attention alone, burst and sustained, against our step.

    Only the step's GEMMs and attention calls (its shapes, distinct random weights per block, cuBLAS and
    cuDNN as our step runs them), replayed from CUDA graphs back to back as a denoising loop runs them,
    interleaved with omni_accel's whole step. A short burst runs faster than a sustained loop where the
    card is held at its power limit (its clocks drop); the floor that matters for a 28-step image is the
    sustained one, so both are reported (median ms; the first quarter of each sustained run dropped)."""
    spec = MODELS["flux"](run.tiny)
    x = spec.inputs(run.device, run.dtype)
    image, text = x["hidden_states"].shape[1], x["encoder_hidden_states"].shape[1]
    run_gemms, run_attention, flops, flops_attention = step_work(run, spec.config, image, text)
    gemms, attention = run.replay(run_gemms, 1), run.replay(run_attention, 1)
    both = run.replay(lambda: (run_gemms(), run_attention()), 1)
    pipe = omni_accel.accelerate(Holder(build(spec, run.device, run.dtype)))
    for _ in range(3):
        pipe.transformer(**x)
    variants = {
        "gemms": gemms,
        "attention": attention,
        "gemms + attention": both,
        "omni_accel step": lambda: pipe.transformer(**x),
    }
    burst, sustained = {n: [] for n in variants}, {n: [] for n in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            run.synchronize()
            time.sleep(args.cool)  # the card cools to idle: the next call runs at full clocks
            burst[name].append(timed(fn, run.device)[1])
            sustained[name] += [timed(fn, run.device)[1] for _ in range(args.steps)][args.steps // 4 :]
    run.results.update(gemm_tflop=flops / 1e12, attention_tflop=flops_attention / 1e12)
    for name in variants:
        ms = run.results[name] = {
            "burst_ms": statistics.median(burst[name]),
            "sustained_ms": statistics.median(sustained[name]),
        }
        rate = {"gemms": flops, "attention": flops_attention}.get(name)
        extra = (
            f"  ({rate / ms['burst_ms'] / 1e9:.0f} / {rate / ms['sustained_ms'] / 1e9:.0f} TFLOP/s)"
            if rate
            else ""
        )
        print(
            f"{name:20s} burst {ms['burst_ms']:6.1f} ms  sustained {ms['sustained_ms']:6.1f} ms{extra}",
            flush=True,
        )


def register(commands: Commands) -> None:
    parser = commands.add("power-floor", power_floor)
    option(parser, "--steps", 28, 4, "back-to-back steps per sustained run")
    option(parser, "--rounds", 3, 1, "rounds of every variant")
    option(
        parser, "--cool", 2.0, 0.0, "seconds idle before each burst (the GPU's clocks recover)", type=float
    )
