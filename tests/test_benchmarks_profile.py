"""Smoke runs of benchmarks/step_profile.py on CPU (``--tiny``): every variant is built, timed and profiled
into the same tables a GPU run gives (CPU ops standing in for kernels), with and without a layout."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

FAST = ["--tiny", "--rounds", "1", "--calls", "1"]
GAPS_KEYS = {
    "kernels_per_step",
    "busy_ms_per_step",
    "span_ms_per_step",
    "idle_ms_per_step",
    "gaps_under_20us_ms_per_step",
    "median_gap_us",
    "largest_gaps",
    "family_ms_per_step",
    "top_kernels",
}


@pytest.fixture(scope="module")
def step_profile():
    import step_profile

    return step_profile


def _positive(*values: float) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def _check_profiled(variant: str, r: dict) -> None:
    p = r["profile"]
    assert GAPS_KEYS | {"communication_exposed_ms_per_step"} <= set(p), variant
    assert _positive(r["median_ms"], r["host_launch_ms"], p["kernels_per_step"], p["busy_ms_per_step"]), (
        variant
    )
    assert p["busy_ms_per_step"] <= p["span_ms_per_step"] + 1e-9 and p["idle_ms_per_step"] >= 0, variant
    assert _positive(*p["family_ms_per_step"].values()) and "gemm" in p["family_ms_per_step"], variant
    assert p["top_kernels"] and all(count >= 1 for _, _, count in p["top_kernels"]), variant


def test_every_variant_is_profiled(step_profile):
    r = step_profile.main(FAST)
    assert set(r["variants"]) == {"diffusers", "diffusers_best", "omni", "omni_graphs"}
    for variant, result in r["variants"].items():
        _check_profiled(variant, result)
    assert _positive(r["omni_ready_s"], *r["first_call_s"].values())
    assert any("no CUDA graphs on cpu" in line for line in r["not_covered"])


def test_layouts_without_torchrun_run_on_one_process(step_profile):
    r = step_profile.main([*FAST, "--layout", "ulysses2+one_stage", "--variants", "omni_graphs"])
    layout = r["layouts"]["ulysses2+one_stage"]
    _check_profiled("omni_graphs", layout["variants"]["omni_graphs"])
    assert len(layout["per_rank"]) == 1
    assert any("without torchrun" in line for line in r["not_covered"])


def test_baselines_are_refused_under_a_layout(step_profile):
    with pytest.raises(SystemExit):
        step_profile.main([*FAST, "--layout", "tp2", "--variants", "diffusers"])


def test_gaps_keeps_its_keys():
    from harness.profiling import gaps

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(4, 32)
    with torch.no_grad():
        g = gaps(lambda: model(x), steps=2, device="cpu")
    assert set(g) == GAPS_KEYS
    assert g["kernels_per_step"] == 3 and _positive(g["busy_ms_per_step"], g["family_ms_per_step"]["gemm"])


@pytest.mark.multirank
def test_layouts_on_two_gloo_ranks_write_each_ranks_trace(tmp_path):
    out, traces = tmp_path / "parallel.json", tmp_path / "traces"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["benchmarks/step_profile.py", *FAST, "--layout", "ulysses2", "--variants", "omni"]
    command += ["--trace-dir", str(traces), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    layout = json.loads(out.read_text())["layouts"]["ulysses2"]
    _check_profiled("omni", layout["variants"]["omni"])
    assert len(layout["per_rank"]) == 2
    assert all(rank["omni"]["family_ms_per_step"]["communication"] > 0 for rank in layout["per_rank"])
    for rank in (0, 1):
        assert json.loads((traces / f"flux_ulysses2_rank{rank}_omni.json").read_text())["traceEvents"]
