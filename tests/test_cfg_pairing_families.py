"""cfg=2 on the pipelines that call a transformer without native blocks twice per guided step (cond, then
uncond): the registry's pairing rule for each family (``models/registry.py``) pairs the two calls over the
two ranks, within 1e-5 (fp32) of plain Diffusers on one rank, the ranks bitwise equal, every pair of a step
counted (the first step of a generic model runs whole: it shows the output's shape). Lucy Edit's Wan
transformer pairs by the native Wan rule; Lumina 2 with truncated guidance (one call a step past
``cfg_trunc_ratio``) does not pair. One spawn (two gloo ranks) runs every check."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import tiny_guided_pipelines as tiny
import torch
import torch.distributed as dist
from multirank import run_checks, run_multirank

import omni_accel

STEPS = 2
_IMAGE_CALL = {"guidance_scale": 5.0, "negative_prompt": "a dog", "max_sequence_length": 8}

# builder, call arguments, paired calls in the first pipeline call (a generic model's first step runs whole)
CASES: tuple[tuple[Callable, Callable[[], dict], int], ...] = (
    (tiny.tiny_cogview4_pipeline, lambda: {"guidance_scale": 5.0, "negative_prompt": "a dog"}, STEPS - 1),
    (tiny.tiny_skyreels_v2_pipeline, tiny.video_call, STEPS - 1),
    (
        tiny.tiny_longcat_image_pipeline,
        lambda: {"guidance_scale": 5.0, "negative_prompt": "a dog", "enable_prompt_rewrite": False},
        STEPS - 1,
    ),
    (tiny.tiny_chroma_pipeline, lambda: dict(_IMAGE_CALL), STEPS - 1),
    (tiny.tiny_ovis_image_pipeline, lambda: dict(_IMAGE_CALL), STEPS - 1),
    (tiny.tiny_chronoedit_pipeline, tiny.chronoedit_call, STEPS - 1),
    (tiny.tiny_helios_pipeline, tiny.helios_call, 2 * STEPS - 1),  # two chunks of latent frames
    (tiny.tiny_lucy_edit_pipeline, tiny.lucy_edit_call, STEPS),  # native Wan blocks: every step
    (tiny.tiny_lumina2_pipeline, lambda: dict(_IMAGE_CALL), STEPS - 1),
    (tiny.tiny_hunyuan_video_pipeline, tiny.hunyuan_video_call, STEPS - 1),
    (tiny.tiny_kandinsky5_pipeline, tiny.kandinsky5_call, STEPS - 1),
    (tiny.tiny_krea2_pipeline, tiny.krea2_call, STEPS - 1),
    (tiny.tiny_nucleusmoe_image_pipeline, tiny.nucleusmoe_image_call, STEPS - 1),
    # guidance truncated past half the steps (one call a step then): its calls run whole on both ranks
    (tiny.tiny_lumina2_pipeline, lambda: {**_IMAGE_CALL, "cfg_trunc_ratio": 0.5}, 0),
)


def _images(pipe, **call) -> torch.Tensor:
    call = {
        "prompt": "a cat",
        "num_inference_steps": STEPS,
        "height": 32,
        "width": 32,
        "output_type": "pt",
        **call,
    }
    return pipe(**call, generator=torch.Generator().manual_seed(0))[0]  # images, frames or latents


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    every = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(every, tensor.contiguous())
    return all(torch.equal(other, every[0]) for other in every)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _cfg2(pipe):
    """cfg=2, the VAE decoding whole (its split is tested elsewhere; its exchanges cost seconds on gloo)."""
    return omni_accel.accelerate(pipe, parallel=omni_accel.ParallelConfig(cfg=2), vae_parallel=False)


def _paired_over_two_ranks() -> None:
    for index, (build, call, paired) in enumerate(CASES):
        name = build.__name__
        plain = _images(build(), **call())
        pipe = _cfg2(build())
        got = _images(pipe, **call())
        assert _rel(got, plain) <= 1e-5 and _same_on_every_rank(got), name
        cfg = omni_accel.describe(pipe).components[0].cfg
        assert cfg.paired_calls == paired, f"{name}: {cfg.describe()}"
        if index == 0:  # once the output's shape is known, every step pairs
            again = _images(pipe, **call())
            assert cfg.paired_calls == paired + STEPS and torch.equal(again, got), f"{name}: {cfg.describe()}"
        omni_accel.restore(pipe)


def _guidance_off_midway() -> None:
    """A step-end callback that turns guidance off (Diffusers' dynamic-CFG example): the later steps make one
    call each, which runs whole, not waiting for a pair."""

    def off(pipe, step, timestep, kwargs):
        pipe._guidance_scale = 1.0
        return kwargs

    call = {**tiny.video_call(), "callback_on_step_end": off}
    plain = _images(tiny.tiny_skyreels_v2_pipeline(), **call)
    pipe = _cfg2(tiny.tiny_skyreels_v2_pipeline())
    got = _images(pipe, **call)
    assert _rel(got, plain) <= 1e-5 and _same_on_every_rank(got)
    omni_accel.restore(pipe)


_PIXART_CALL = {**_IMAGE_CALL, "use_resolution_binning": False, "clean_caption": False}


def _auto_picks_cfg() -> None:
    """``parallel="auto"``: a first call that runs both branches takes cfg=2 for these families, and for
    those whose calls each hold both (PixArt-Sigma, Sana, HunyuanDiT, CogVideoX, LTX-Video...: halved over the
    ranks, every call; without a rule, refused, or for LTX-Video's ``_cp_plan`` ulysses=2). HunyuanDiT's,
    CogVideoX's and Allegro's RoPE tuples, unbatched, stay whole on each rank beside the halves."""
    cases = (
        (tiny.tiny_cogview4_pipeline, {"guidance_scale": 5.0}, "paired_calls", STEPS - 1),
        (tiny.tiny_pixart_sigma_pipeline, _PIXART_CALL, "split_calls", STEPS),
        *((build, call, "split_calls", STEPS) for build, call in tiny.batched_calls()),
    )
    for build, call, counter, count in cases:
        plain = _images(build(), **call)
        pipe = omni_accel.accelerate(build(), parallel="auto", vae_parallel=False)
        got = _images(pipe, **call)
        assert _rel(got, plain) <= 1e-5 and _same_on_every_rank(got), build.__name__
        report = omni_accel.describe(pipe)
        assert "cfg=2) on 2 ranks" in str(report), f"{build.__name__}: {report}"
        cfg = report.components[0].cfg
        assert getattr(cfg, counter) == count, f"{build.__name__}: {cfg.describe()}"
        omni_accel.restore(pipe)


def _pag_calls_run_whole() -> None:
    """Perturbed-attention guidance: its processors cut each call's batch into uncond, cond and perturbed
    thirds, so half the batch on each rank would perturb the wrong samples; such calls run whole."""
    from diffusers import StableDiffusion3PAGPipeline

    from omni_accel.models.tiny_pipelines import tiny_sd3_pipeline

    def build():
        return StableDiffusion3PAGPipeline.from_pipe(tiny_sd3_pipeline(), pag_applied_layers=["blocks.1"])

    call = {"guidance_scale": 5.0, "pag_scale": 3.0, "num_images_per_prompt": 2}
    plain = _images(build(), **call)
    pipe = _cfg2(build())
    got = _images(pipe, **call)
    assert _rel(got, plain) <= 1e-5 and _same_on_every_rank(got)
    assert omni_accel.describe(pipe).components[0].cfg.replicated_calls == STEPS
    omni_accel.restore(pipe)


CHECKS = (_paired_over_two_ranks, _guidance_off_midway, _auto_picks_cfg, _pag_calls_run_whole)


@pytest.mark.multirank
def test_two_call_guidance_pairs_over_cfg_ranks():
    run_multirank(run_checks, 2, CHECKS, timeout=600)


def test_sana_sprint_runs_no_guidance_on_the_transformer_sana_guides_with():
    """Sana Sprint's ``guidance_scale`` (4.5 by default) is an input of its guidance-distilled model: its calls
    hold one branch, so ``parallel="auto"`` must not take cfg=2 for it, as it does for Sana's."""
    from diffusers import SanaSprintPipeline

    from omni_accel.models.registry import spec_for

    rule = spec_for(tiny.tiny_sana_pipeline().transformer).batched_guidance
    sprint = SanaSprintPipeline.__new__(SanaSprintPipeline)
    assert not rule({"self": sprint, "guidance_scale": 4.5})
    assert rule({"self": tiny.tiny_sana_pipeline(), "guidance_scale": 4.5})
