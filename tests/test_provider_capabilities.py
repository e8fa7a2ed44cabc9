"""CPU checks of the optional FlashInfer (bf16 and FP8) and SageAttention providers: they import without their packages, say
why they cannot run, judge requests by the installed version, and their custom ops trace with the right
shapes. No GPU and no kernel package is needed; the packages are hidden or stubbed per test.
"""

from __future__ import annotations

import importlib.metadata
import math
import subprocess
import sys
import types

import pytest
import torch
from packaging.version import Version
from torch._subclasses.fake_tensor import FakeTensorMode

from omni_accel.attention.base import AttentionRequest
from omni_accel.attention.providers import flashinfer as flashinfer_module
from omni_accel.attention.providers import sage as sage_module
from omni_accel.attention.providers.flashinfer import FlashInferProvider, flashinfer_attention
from omni_accel.attention.providers.flashinfer_fp8 import FlashInferFp8Provider, flashinfer_fp8_attention
from omni_accel.attention.providers.sage import SageProvider, sage_attention
from omni_accel.attention.registry import get_provider

_DISTRIBUTIONS = {"flashinfer": "flashinfer-python", "sageattention": "sageattention"}
_CACHED_PROBES = (flashinfer_module._unavailable, sage_module._unavailable, sage_module.installed_version)


def cuda_request(head_dim: int = 128, *, needs_lse: bool = False, capability=(9, 0)) -> AttentionRequest:
    return AttentionRequest(
        torch.bfloat16, "cuda", head_dim, needs_lse=needs_lse, compute_capability=capability
    )


@pytest.fixture(autouse=True)
def fresh_probes():
    """Availability is probed once per process; each test starts and ends with the probes forgotten."""
    for probe in _CACHED_PROBES:
        probe.cache_clear()
    yield
    for probe in _CACHED_PROBES:
        probe.cache_clear()


def _hide_distributions(monkeypatch, *names: str) -> None:
    real_version = importlib.metadata.version

    def version(distribution: str) -> str:
        if distribution in names:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return real_version(distribution)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.fixture
def packages_absent(monkeypatch):
    """Neither kernel package importable nor installed, whatever this machine has."""
    for module in _DISTRIBUTIONS:
        monkeypatch.setitem(sys.modules, module, None)
    _hide_distributions(monkeypatch, *_DISTRIBUTIONS.values())


def _stub_flashinfer(monkeypatch, version: str) -> None:
    """An importable ``flashinfer`` of ``version`` known only by its ``__version__`` (as a source build)."""
    stub = types.ModuleType("flashinfer")
    stub.__version__ = version
    monkeypatch.setitem(sys.modules, "flashinfer", stub)
    _hide_distributions(monkeypatch, "flashinfer-python")


def _stub_sage(monkeypatch, version: str) -> None:
    monkeypatch.setitem(sys.modules, "sageattention", types.ModuleType("sageattention"))
    monkeypatch.setattr(sage_module, "installed_version", lambda: Version(version))


def test_provider_modules_import_without_their_packages():
    # A fresh interpreter: another test may already have imported a kernel package into this one.
    code = (
        "import sys\n"
        "import omni_accel.attention.providers.flashinfer, omni_accel.attention.providers.sage\n"
        "import omni_accel.attention.providers.flashinfer_fp8\n"
        "from omni_accel.attention.registry import get_provider\n"
        "get_provider('flashinfer'), get_provider('sage'), get_provider('flashinfer_fp8')\n"
        "eager = [m for m in ('flashinfer', 'sageattention') if m in sys.modules]\n"
        "assert not eager, f'imported at module import: {eager}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "name, package, extra",
    [
        ("flashinfer", "flashinfer", "omni-accel[flashinfer]"),
        ("flashinfer_fp8", "flashinfer", "omni-accel[flashinfer]"),
        ("sage", "sageattention", "omni-accel[sage]"),
    ],
)
def test_cpu_request_names_the_device_and_the_missing_package(packages_absent, name, package, extra):
    provider = get_provider(name)
    reasons = provider.reasons_against(AttentionRequest(torch.bfloat16, "cpu", 128))
    assert any("not cpu" in reason for reason in reasons), reasons
    missing = provider.unavailable_reason()
    assert missing is not None and package in missing and f"pip install '{extra}'" in missing, missing
    assert missing in reasons


def test_flashinfer_version_gate_is_numeric_and_bounded():
    assert flashinfer_module.version_problem(Version("0.6.1")) is None
    assert flashinfer_module.version_problem(Version("0.6.10")) is None
    for refused in ("0.6.0", "0.7.4", "1.0.0"):
        problem = flashinfer_module.version_problem(Version(refused))
        assert problem is not None and refused in problem and "pip install" in problem
    assert "unknown version" in flashinfer_module.version_problem(None)


def test_flashinfer_version_falls_back_to_the_module_when_metadata_is_missing(monkeypatch):
    _hide_distributions(monkeypatch, "flashinfer-python")
    module = types.SimpleNamespace(__version__="0.6.1")
    assert flashinfer_module.installed_version(module) == Version("0.6.1")
    assert flashinfer_module.installed_version(types.SimpleNamespace()) is None


def test_flashinfer_refuses_an_unsupported_installed_version(monkeypatch):
    _stub_flashinfer(monkeypatch, "0.7.4")
    reason = FlashInferProvider().unavailable_reason()
    assert reason is not None and "0.7.4" in reason


def test_flashinfer_capabilities_with_the_package_present(monkeypatch):
    _stub_flashinfer(monkeypatch, "0.6.1")
    provider = FlashInferProvider()
    assert provider.unavailable_reason() is None
    for head_dim in (64, 128, 256):
        assert provider.reasons_against(cuda_request(head_dim, needs_lse=True)) == []
    for head_dim in (96, 192, 512):
        assert provider.reasons_against(cuda_request(head_dim)), head_dim
    assert provider.reasons_against(cuda_request(capability=(7, 5)))
    masked = AttentionRequest(torch.bfloat16, "cuda", 128, has_mask=True, compute_capability=(9, 0))
    assert provider.reasons_against(masked)
    assert provider.capabilities.lossless and provider.capabilities.returns_lse


def test_flashinfer_fp8_is_lossy_and_hopper_only(monkeypatch):
    _stub_flashinfer(monkeypatch, "0.6.1")
    provider = FlashInferFp8Provider()
    assert not provider.capabilities.lossless and provider.capabilities.returns_lse
    for head_dim in (64, 128, 256):
        assert provider.reasons_against(cuda_request(head_dim, needs_lse=True)) == []
    assert provider.reasons_against(cuda_request(96))
    assert any("8.0" in reason for reason in provider.reasons_against(cuda_request(capability=(8, 0))))
    blackwell = provider.reasons_against(cuda_request(capability=(10, 0)))
    assert any("FA3" in reason and "10.0" in reason for reason in blackwell), blackwell
    masked = AttentionRequest(torch.bfloat16, "cuda", 128, has_mask=True, compute_capability=(9, 0))
    assert provider.reasons_against(masked)
    # over few keys its output runs low (measured on a GPU): refused, saying so
    for keys, refused in ((333, True), (2047, True), (2048, False), (32760, False)):
        request = AttentionRequest(torch.bfloat16, "cuda", 128, compute_capability=(9, 0), kv_len=keys)
        reasons = provider.reasons_against(request)
        assert bool(reasons) is refused and all(f"not {keys}" in r for r in reasons), reasons


@pytest.mark.parametrize(
    "version, expected",
    [
        ("1.0.6", sage_module.CAPABILITIES_V1),
        ("1.0.10", sage_module.CAPABILITIES_V1),
        ("2.0.1", sage_module.CAPABILITIES_V2),
        ("2.1.1", sage_module.CAPABILITIES_V2_LSE),
        ("2.2.0+cu128torch2.8", sage_module.CAPABILITIES_V2_LSE),
        ("10.0", sage_module.CAPABILITIES_V2_LSE),
    ],
)
def test_sage_capabilities_follow_the_version_numerically(version, expected):
    assert sage_module.capabilities_for(Version(version)) is expected


def test_sage_uniform_capabilities_hold_for_every_version():
    uniform = SageProvider.capabilities
    assert uniform is sage_module.capabilities_for(None)
    assert not uniform.lossless and not uniform.returns_lse and not uniform.supports_mask


@pytest.mark.parametrize("version", ["1.0.6", "1.0.10"])
def test_sage_1x_refuses_the_lse_and_head_size_32(monkeypatch, version):
    _stub_sage(monkeypatch, version)
    provider = SageProvider()
    assert provider.unavailable_reason() is None  # 1.0.10 is newer than 1.0.6, whatever strings say
    assert provider.reasons_against(cuda_request(96)) == []
    assert any("log-sum-exp" in reason for reason in provider.reasons_against(cuda_request(needs_lse=True)))
    assert provider.reasons_against(cuda_request(32))


def test_sage_2x_serves_the_lse_and_small_head_sizes(monkeypatch):
    _stub_sage(monkeypatch, "2.2.0")
    provider = SageProvider()
    assert provider.reasons_against(cuda_request(needs_lse=True)) == []
    assert provider.reasons_against(cuda_request(32)) == []
    assert provider.reasons_against(cuda_request(256))


def test_sage_refuses_versions_before_1_0_6(monkeypatch):
    _stub_sage(monkeypatch, "1.0.5")
    reason = SageProvider().unavailable_reason()
    assert reason is not None and "1.0.5" in reason and "pip install 'omni-accel[sage]'" in reason


_OPS = pytest.mark.parametrize(
    "op",
    [flashinfer_attention, flashinfer_fp8_attention, sage_attention],
    ids=["flashinfer", "flashinfer_fp8", "sage"],
)
_SHAPES = pytest.mark.parametrize(
    "batch, seq_q, seq_kv, heads, kv_heads, head_dim",
    [(2, 333, 333, 24, 24, 128), (3, 64, 77, 8, 2, 64)],
)


@_OPS
@_SHAPES
@pytest.mark.parametrize("return_lse", [True, False])
def test_fake_implementation_shapes(op, batch, seq_q, seq_kv, heads, kv_heads, head_dim, return_lse):
    with FakeTensorMode():
        query = torch.empty(batch, seq_q, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        key = torch.empty(batch, seq_kv, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        out, lse = op(query, key, torch.empty_like(key), head_dim**-0.5, return_lse)
    assert out.shape == query.shape and out.dtype == torch.bfloat16 and out.device == query.device
    assert out.is_contiguous()
    assert lse.shape == ((batch, heads, seq_q) if return_lse else (0,))
    assert lse.dtype == torch.float32 and lse.device == query.device and lse.is_contiguous()


@_OPS
def test_fake_implementation_serves_meta_tensors(op):
    query = torch.empty(2, 40, 4, 64, dtype=torch.float16, device="meta")
    out, lse = op(query, query, query, 0.125, True)
    assert out.shape == query.shape and out.dtype == torch.float16 and lse.shape == (2, 4, 40)


@pytest.mark.parametrize("provider_class", [FlashInferProvider, FlashInferFp8Provider, SageProvider])
@pytest.mark.parametrize("return_lse", [True, False])
def test_forward_traces_to_one_custom_op_without_graph_breaks(provider_class, return_lse):
    provider = provider_class()

    class Attend(torch.nn.Module):
        def forward(self, query, key, value):
            return provider.forward(query, key, value, return_lse=return_lse)

    query = torch.randn(2, 33, 4, 64, dtype=torch.bfloat16)
    # strict export is dynamo's fullgraph trace on fake tensors: nothing runs, so no GPU is needed.
    program = torch.export.export(Attend(), (query, query, query), strict=True)
    ops = [node.target for node in program.graph.nodes if node.op == "call_function"]
    custom = [op for op in ops if getattr(op, "namespace", None) == "omni_accel"]
    assert len(custom) == 1 and custom[0].name().endswith("_attention"), ops
    outputs = next(node for node in program.graph.nodes if node.op == "output").args[0]
    shapes = [tuple(node.meta["val"].shape) for node in outputs]
    assert shapes == ([(2, 33, 4, 64), (2, 4, 33)] if return_lse else [(2, 33, 4, 64)])


@_OPS
def test_custom_ops_have_no_cpu_kernel(op):
    query = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        op(query, query, query, 0.125, False)


@pytest.mark.parametrize("provider_class", [FlashInferProvider, FlashInferFp8Provider, SageProvider])
def test_forward_refuses_a_mask_instead_of_ignoring_it(provider_class):
    query = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mask"):
        provider_class().forward(query, query, query, attn_mask=torch.ones(8, 8, dtype=torch.bool))


def test_flashinfer_lse_becomes_natural_log_batch_heads_seq():
    batch, seq, heads = 3, 5, 7
    lse = torch.randn(batch, heads, seq)
    # FlashInfer's layout: one row per token of the flattened batch, one column per head, in base 2.
    rows = lse.transpose(1, 2).reshape(batch * seq, heads) / math.log(2.0)
    converted = flashinfer_module.natural_lse(rows, batch)
    assert converted.shape == (batch, heads, seq) and converted.is_contiguous()
    torch.testing.assert_close(converted, lse)


def test_flashinfer_indptr_marks_each_sequence():
    indptr = flashinfer_module.ragged_indptr(3, 5)
    assert indptr.dtype == torch.int32 and indptr.device.type == "cpu"
    assert indptr.tolist() == [0, 5, 10, 15]


def test_fp8_heads_quantize_each_batch_element_and_head_on_its_own():
    from omni_accel.attention.providers.flashinfer_fp8 import quantize_heads

    x = torch.randn(2, 37, 3, 64, dtype=torch.bfloat16)
    x[1, :, 2] *= 1000  # one head of one element far larger: it must not coarsen the others
    x[0, :, 1] = 0  # an all-zero head stays zero (the amax floor), not NaN
    data, scale = quantize_heads(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and scale.shape == (2, 3)
    amax = x.float().abs().amax(dim=(1, 3))
    assert torch.equal(scale[amax > 0], amax[amax > 0] * (1 / 448))
    assert data.float().abs().amax(dim=(1, 3))[amax > 0].eq(448).all() and data[0, :, 1].float().eq(0).all()
    back = data.float() * scale[:, None, :, None]
    assert ((back - x.float()).abs() <= x.float().abs() * 2**-4 + scale[:, None, :, None] * 2**-9).all()
    alone, alone_scale = quantize_heads(x[:1])
    assert torch.equal(alone.view(torch.uint8), data[:1].view(torch.uint8)) and torch.equal(
        alone_scale, scale[:1]
    )
