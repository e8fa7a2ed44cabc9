"""Every subcommand of benchmarks/kernel_bench.py at ``--tiny``: on the CPU each runs its code end to end
and returns real timings, and names what it skipped for want of CUDA."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import kernel_bench  # noqa: E402


def tiny(*argv: str) -> dict:
    return kernel_bench.main([*argv, "--tiny"])


def positive(*values: float) -> None:
    for value in values:
        assert isinstance(value, float) and math.isfinite(value) and value > 0, value


def test_attention_shapes():
    results = tiny("attention-shapes")
    assert results["device"] == "cpu" and results["tiny"]
    row = results["tiny"]["sdpa"]
    positive(row["median_ms"], row["tflops"], row["first_call_ms"])
    ran = [r for r in results["tiny"].values() if "median_ms" in r]  # the first one that ran is the reference
    diffs = [{k: v for k, v in r.items() if k.startswith("max_abs_diff_vs_")} for r in ran]
    assert list(diffs[0].values()) == [0.0] and all(len(d) == 1 for d in diffs)
    assert all(v <= 1e-6 for d in diffs for v in d.values())
    assert results["tiny_ring2_block"]["sdpa"] == {"unavailable": "does not return the log-sum-exp"}
    assert "cuda" in results["skipped"]["sdpa_cudnn"]


def test_masked_attention():
    results = tiny("masked-attention")
    for name in ("dispatch, dense mask (plain Diffusers)", "flash, dense mask"):
        positive(results[name]["ms"])
        assert results[name]["max_err_vs_fp32"] < 1e-5
    assert "cudnn varlen, valid keys first (no sync)" in results["skipped"]
    assert isinstance(results["dispatch runs"], list)


def test_attention_beside_gemm():
    results = tiny("attention-beside-gemm")
    for shape in ("tiny_one_gpu", "tiny_ring2_rank"):
        positive(*(results[shape][v] for v in ("attention", "gemm", "one_after_the_other")))
    assert "CUDA-graph replays" in results["skipped"]


def test_gemm_shapes():
    results = tiny("gemm-shapes", "--autotune")
    assert len(results["rows"]) == (6 + 4) * 4  # every GEMM at every token count
    for row in results["rows"]:
        positive(row["cpu_ms"])
        assert row["cpu_tflops"] >= 0  # rounded to 0.1 TFLOP/s, as on a GPU
    assert "--autotune" in results["skipped"]


def test_gemm_gelu(tmp_path):
    out = tmp_path / "gemm_gelu.json"
    results = tiny("gemm-gelu", "--out", str(out))
    assert json.loads(out.read_text()) == results
    for name in ("tiny", "tiny rank"):
        assert set(results[name]) == {"GEMM alone", "GEMM + GELU kernel", "GELU epilogue"}
        positive(*results[name].values())
    assert len(results["FLUX blocks"]) == 4
    positive(*results["FLUX blocks"].values())


def test_fused_kernels():
    results = tiny("fused-kernels")
    cases = {k: v for k, v in results.items() if isinstance(v, dict) and "us" in v}
    assert len(cases) == 17 and "gated_residual" in cases and "norm_modulate_fp8" in cases
    for case in cases.values():
        positive(case["us"], case["gb_s"])
    assert "norm_modulate into two gather buffers" in results["skipped"]


def test_power_floor():
    results = tiny("power-floor")
    positive(results["gemm_tflop"], results["attention_tflop"])
    for name in ("gemms", "attention", "gemms + attention", "omni_accel step"):
        positive(results[name]["burst_ms"], results[name]["sustained_ms"])


def test_collectives():
    results = tiny("collectives")  # two forked processes over gloo
    assert results["backend"] == "gloo"
    for name in (
        "all_to_all_single (even)",
        "all_to_all_single (uneven splits)",
        "ring P2P of K/V (2x bytes)",
    ):
        positive(results[name]["eager_us"])
    positive(results["all_gather_into_tensor (same bytes sent)"]["eager_us"])
    positive(results["all_reduce (TP, full tokens)"]["eager_us"])
    assert "the exchanges through symmetric memory" in results["skipped"]


def test_overlap():
    results = tiny("overlap")
    for shape in ("wan", "flux"):
        positive(*results[shape]["sdpa"]["gloo"].values())
    assert "the exchange on a side stream" in results["skipped"]


def test_lossy_attention():
    results = tiny("lossy-attention")
    for keys in (64, 333):  # the lossless yardstick matches fp64 attention on the CPU
        row = results["sdpa"][keys]
        assert row["flat_cosine"] > 0.9999 and abs(row["flat_norm_ratio"] - 1) < 1e-4, row
        assert row["peaked_cosine"] > 0.9999 and "refused" not in row
    assert "cuda" in results["skipped"]["flashinfer_fp8"] and "cuda" in results["skipped"]["sage"]


def test_attention_plans_per_thread():
    results = tiny("attention-plans-per-thread")
    assert set(results) >= {"48 tokens", "96 tokens"}
    for row in (results["48 tokens"], results["96 tokens"]):
        assert len(row) == 4
        positive(*(ms for pair in row.values() for ms in pair))
    assert "CUDA" in results["skipped"]["cuDNN's plans"]
