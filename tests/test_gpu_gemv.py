"""The GEMV kernel behind projections of one or two rows (``layers.gemv_kernels``): as accurate as cuBLAS's
product against float64, at FLUX.1's modulation widths and at ragged ones, and what native blocks' AdaLN
modulation runs through on a GPU; with an e4m3 weight (``quantize="fp8"``), the float64 product of the
dequantized weight within the output's rounding."""

import pytest
import torch
import torch.nn.functional as F

from omni_accel.layers import fp8, projection

pytestmark = pytest.mark.gpu


def _error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows, n, k, bias",
    [(1, 18432, 3072, True), (2, 9216, 3072, False), (3, 1000, 700, True), (5, 40, 24, True)],
)
def test_few_rows_linear_is_as_accurate_as_cublas(dtype, rows, n, k, bias):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    ours = torch.ops.omni_accel.few_rows_linear(x, w, None, b)
    assert ours.dtype == dtype and ours.shape == (rows, n)
    # within one rounding of the output dtype of cuBLAS's error (both accumulate in float32)
    assert _error(ours, exact) <= _error(F.linear(x, w, b), exact) + torch.finfo(dtype).eps


def test_few_rows_linear_takes_strided_rows_and_sliced_weights():
    """Rows of a wider tensor, and a weight's output rows (a tensor-parallel slice)."""
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(2, 3072 + 64, device="cuda", generator=g).bfloat16()[:, :3072]
    w = (torch.randn(4096, 3072, device="cuda", generator=g) * 0.02).bfloat16()[1024:3072]
    exact = F.linear(x.double(), w.double())
    assert (
        _error(torch.ops.omni_accel.few_rows_linear(x, w, None, None), exact)
        <= 2 * torch.finfo(torch.bfloat16).eps
    )


def test_a_modulation_goes_through_the_kernel_and_a_token_projection_does_not(monkeypatch):
    chosen = []
    real = projection._few_rows
    monkeypatch.setattr(projection, "_few_rows", lambda x, w: chosen.append(real(x, w)) or chosen[-1])
    linear = torch.nn.Linear(3072, 9216, device="cuda", dtype=torch.bfloat16)
    weights = projection.read_linear(linear, "norm.linear")
    conditioning = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        exact = F.linear(conditioning.double(), linear.weight.double(), linear.bias.double())
        assert _error(projection.apply_one(conditioning, weights), exact) < 1e-2
        projection.apply_one(torch.randn(1, 64, 3072, device="cuda", dtype=torch.bfloat16), weights)
    assert chosen == [True, False]


@pytest.mark.parametrize(
    "rows, n, k, bias", [(1, 18432, 3072, True), (2, 9216, 3072, False), (3, 1000, 700, True)]
)
def test_an_e4m3_weight_is_dequantized_by_its_channel_scales(rows, n, k, bias):
    g = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = fp8.quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    exact = F.linear(x.double(), w.data.double() * w.scale.t().double(), None if b is None else b.double())
    ours = fp8.weight_only_linear(x, w, b)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    assert _error(ours, exact) <= 2 * torch.finfo(torch.bfloat16).eps
    assert torch.equal(ours, torch.ops.omni_accel.few_rows_linear(x, w.data, w.scale, b))  # the kernel ran


def test_an_fp8_modulation_reads_its_weight_in_e4m3_and_its_rows_unquantized():
    linear = torch.nn.Linear(3072, 9216, device="cuda", dtype=torch.bfloat16)
    store = fp8.Fp8Weights()
    weights = projection.with_fp8(projection.read_linear(linear, "norm.linear"), store, weight_only=True)
    assert not projection.takes_fp8_rows(weights)
    conditioning = torch.randn(2, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ours = projection.apply_one(conditioning, weights)
        exact = F.linear(conditioning.double(), linear.weight.double(), linear.bias.double())
    assert torch.equal(ours, fp8.weight_only_linear(conditioning, weights.fp8, linear.bias))
    assert 1e-3 < _error(ours, exact) < 5e-2  # the weight's e4m3 rounding, not the rows'
