"""Smoke runs of the one-GPU benchmarks on CPU (``--tiny``): every entry point still runs after a rename,
and what it measures is what a GPU run would measure (every variant built, warmed, timed, compared)."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.fixture(scope="module")
def step():
    import step

    return step


def test_step_runs_every_model_with_both_baselines(step):
    from harness.models import MODELS

    results = step.main(["--tiny", "--models", *MODELS, "--rounds", "1", "--calls", "1"])
    for name in MODELS:
        r = results[name]
        assert "error" not in r, (name, r.get("traceback"))
        assert {"diffusers", "diffusers_best", "omni"} <= set(r["median_ms"]), name
        assert all(ms > 0 and math.isfinite(ms) for ms in r["median_ms"].values()), name
        # fp32 on CPU: ours (either tier) computes what Diffusers computes
        lossless = {v: e for v, e in r["rel_err_vs_diffusers"].items() if v.startswith("omni")}
        assert lossless and all(e <= 1e-5 for e in lossless.values()), (name, lossless)
        assert r["speedup"]["diffusers_best/omni"] > 0 and r["first_call_s"]["omni"] >= 0


def test_step_extras_build_beside_the_baselines(step):
    extras = ["fp8", "fused_qkv", "no_graphs", "projection_cache", "first_block_cache", "taylorseer_cache"]
    extras.append("provider=sdpa_math")
    args = ["--tiny", "--models", "flux", "--rounds", "1", "--calls", "1", "--lora", "4", "--per-layer"]
    r = step.main([*args, "--extra", *extras])["flux"]
    assert "error" not in r, r.get("traceback")
    want = {
        "omni_fp8",
        "omni_fused_qkv",
        "omni_no_graphs",
        "omni_projection_cache",
        "omni_sdpa_math",
        "diffusers+first_block_cache",
        "omni+first_block_cache",
        "omni_fp8+first_block_cache",
        "omni+taylorseer_cache",
    }
    assert want <= set(r["median_ms"])
    errors = r["rel_err_vs_diffusers"]
    assert all(errors[v] <= 1e-5 for v in ("omni", "omni_no_graphs", "omni_projection_cache")), errors
    for cache in ("first_block_cache", "taylorseer_cache"):  # a cache that never skips computes every block
        assert errors[f"diffusers+{cache}"] == 0 and errors[f"omni+{cache}"] <= 1e-5, errors
    assert 0 < errors["omni_fp8"] < 0.1  # lossy, not broken
    per_layer = r["rel_err_after_each_block"]
    assert len(per_layer["omni"]) == 2 and max(per_layer["omni"]) <= 1e-5 and max(per_layer["omni_fp8"]) > 0
    assert r["speedup"]["omni/omni+first_block_cache"] > 0


def test_step_refuses_an_unknown_extra(step, capsys):
    with pytest.raises(SystemExit):
        step.main(["--tiny", "--extra", "fastest"])
    assert "one of fp8" in capsys.readouterr().err


def test_cold_start_smoke():
    import cold_start

    results = cold_start.main(["--tiny", "--options", "default"])
    for start in ("empty_cache", "warm_cache"):
        r = results[f"default_{start}"]
        assert r["warm_image_s"] > 0 and r["accelerate_to_first_image_s"] >= r["accelerate_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; on a GPU it measures instead")
def test_cold_start_first_launch_says_what_it_needs_on_the_cpu():
    import cold_start

    assert "needs CUDA and Triton" in cold_start.main(["--first-launch"])["skipped"]


def test_cold_start_first_steps_smoke():
    import cold_start

    results = cold_start.main(["--first-steps", "zimage", "--calls", "3", "--tiny", "--profile-first"])
    assert results["model"] == "zimage" and results["plain_warm_s"] > 0
    assert len(results["calls"]) == 3 and all(call["s"] > 0 for call in results["calls"])
    assert any("zimage_block" in line for line in results["calls"][0]["served"])  # what served each call
    top = results["first_call_profile"]["top"]
    assert top and all(row["own_s"] <= row["cumulative_s"] for row in top)
