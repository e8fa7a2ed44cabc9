"""Transformers whose weights are not stored as they compute: layerwise casting (float8 storage), GGUF Q8_0,
torchao int8, offload (weights on ``meta`` with accelerate's hooks) and a model built on ``meta``.

``accelerate`` plans attention for the dtype and device the model computes in (as Diffusers finds them), not
for its first weight's; each accelerated pipeline matches plain Diffusers doing the same steps, and the
blocks whose linears the native math cannot read run Diffusers' forward, counted in ``describe``.
"""

from pathlib import Path

import pytest
import torch
from accelerate import cpu_offload, init_empty_weights
from diffusers import FluxPipeline, FluxTransformer2DModel
from multirank import run_multirank

import omni_accel
from omni_accel import ParallelConfig

CALL = dict(prompt="a cat", num_inference_steps=2, output_type="latent")


def _latents(pipe) -> torch.Tensor:
    return pipe(**CALL, generator=torch.Generator().manual_seed(0)).images


def _report(pipe) -> str:
    return str(omni_accel.describe(pipe))


def _assert_planned_for(report: str, request: str) -> None:
    """Every attention row of the report is planned for ``request`` and resolved to a provider."""
    rows = [line for line in report.splitlines() if line.startswith("  attention planned")]
    assert rows and all(f"[{request}]" in row and "-> error" not in row for row in rows), report


def _cast_layerwise(pipe) -> None:
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def _changed_before_or_after(change, when: str):
    """A plain tiny FLUX pipeline with ``change`` applied, and an accelerated one with ``change`` applied
    ``when`` ("before" or "after") ``accelerate``."""
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    change(plain)
    fast = omni_accel.tiny_flux_pipeline(seed=0)
    if when == "before":
        change(fast)
    omni_accel.accelerate(fast)
    if when == "after":
        change(fast)
    return plain, fast


@pytest.mark.parametrize("when", ["before", "after"])
def test_layerwise_casting_float8_storage_before_and_after_accelerate(when):
    plain, fast = _changed_before_or_after(_cast_layerwise, when)
    _assert_planned_for(_report(fast), "float32, cpu, head_dim=16")  # the compute dtype, not float8
    torch.testing.assert_close(_latents(fast), _latents(plain), rtol=0, atol=0)
    report = _report(fast)
    assert "block calls run by Diffusers' forward: 4 (hooks on" in report  # the casting hooks, per block
    assert "no block has run natively yet" in report


def test_sequential_offload_hooks_plan_for_the_execution_device():
    """``enable_sequential_cpu_offload`` puts every weight on ``meta`` with accelerate hooks that load it on
    the execution device: the plan is for that device (here CUDA, named by the hooks on a CPU machine)."""
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    cpu_offload(pipe.transformer, execution_device=torch.device("cuda"))
    omni_accel.accelerate(pipe)
    _assert_planned_for(_report(pipe), "float32, cuda, head_dim=16")
    omni_accel.restore(pipe)

    diffusers_way = omni_accel.tiny_flux_pipeline(seed=0)
    diffusers_way.enable_sequential_cpu_offload(device="cpu")
    omni_accel.accelerate(diffusers_way)
    _assert_planned_for(_report(diffusers_way), "float32, cpu, head_dim=16")


def test_sequential_offload_runs_like_diffusers():
    """Accelerate's sequential-offload hooks with the CPU as execution device (Diffusers'
    ``enable_sequential_cpu_offload(device="cpu")`` names ``cpu:0``, which accelerate 1.15 cannot load
    weights to, plain or accelerated; these are the hooks it installs, on the device this machine has)."""
    pipes = [omni_accel.tiny_flux_pipeline(seed=0) for _ in range(2)]
    for pipe in pipes:
        cpu_offload(pipe.transformer, execution_device=torch.device("cpu"))
    plain, fast = pipes
    omni_accel.accelerate(fast)
    assert fast.transformer.transformer_blocks[0].attn.to_q.weight.is_meta
    torch.testing.assert_close(_latents(fast), _latents(plain), rtol=0, atol=0)
    assert "block calls run by Diffusers' forward" in _report(fast)  # the hooks load each block's weights


def test_a_transformer_on_meta_is_accelerated_and_runs_once_loaded():
    """Built on ``meta`` (``init_empty_weights``): its device is not knowable before the first call, so the
    attention check waits for it; a call before the weights are loaded fails as in plain Diffusers."""
    reference = omni_accel.tiny_flux_pipeline(seed=0)
    weights = reference.transformer.state_dict()
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    with init_empty_weights():
        pipe.transformer = FluxTransformer2DModel.from_config(pipe.transformer.config)
    omni_accel.accelerate(pipe, attention="sdpa_math")
    assert "-> deferred (its weights are on the meta device" in _report(pipe)
    with pytest.raises(RuntimeError, match="meta"):
        _latents(pipe)
    pipe.transformer.load_state_dict(weights, assign=True)
    torch.testing.assert_close(_latents(pipe), _latents(reference), rtol=1e-5, atol=1e-6)
    assert "attention resolved: flux.joint [float32, cpu, head_dim=16] -> sdpa_math" in _report(pipe)


def _write_q8_0(transformer: FluxTransformer2DModel, directory: Path) -> Path:
    """``transformer`` as a GGUF file (Diffusers' names, so no key conversion): every matrix whose rows
    split into Q8_0's blocks of 32 quantized, the rest float32; its config beside it."""
    gguf = pytest.importorskip("gguf")
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    transformer.save_config(directory)
    path = directory / "transformer-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "flux")
    for name, tensor in transformer.state_dict().items():
        array = tensor.detach().float().numpy()
        if array.ndim == 2 and array.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_pipeline(path: Path) -> FluxPipeline:
    """The tiny FLUX pipeline with its transformer loaded from ``path`` as Diffusers loads a GGUF file."""
    from diffusers import GGUFQuantizationConfig

    transformer = FluxTransformer2DModel.from_single_file(
        str(path),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        config=str(path.parent),
    )
    assert type(transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "GGUFParameter"
    pipe = FluxPipeline(**{**omni_accel.tiny_flux_pipeline(seed=0).components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return _write_q8_0(omni_accel.tiny_flux_pipeline(seed=0).transformer, tmp_path_factory.mktemp("gguf"))


def test_gguf_q8_0_transformer_matches_diffusers(gguf_file):
    plain, fast = _gguf_pipeline(gguf_file), _gguf_pipeline(gguf_file)
    omni_accel.accelerate(fast)
    _assert_planned_for(_report(fast), "float32, cpu, head_dim=16")  # the compute dtype, not uint8
    torch.testing.assert_close(_latents(fast), _latents(plain), rtol=0, atol=0)
    # the reason names what the native math cannot read, by Diffusers' name: each block's 2 calls
    assert "block calls run by Diffusers' forward: 8 (attn.to_q is a GGUFLinear" in _report(fast)


def test_zero_code_builds_and_runs_a_gguf_pipeline(gguf_file):
    """Under ``enable()`` the GGUF pipeline's constructor used to raise (no provider for uint8)."""
    plain = _gguf_pipeline(gguf_file)
    omni_accel.enable()
    try:
        fast = _gguf_pipeline(gguf_file)
    finally:
        omni_accel.disable()
    assert omni_accel.describe(fast).components[0].mode == "native"
    torch.testing.assert_close(_latents(fast), _latents(plain), rtol=0, atol=0)


@pytest.mark.parametrize("when", ["before", "after"])
def test_torchao_int8_weight_only_matches_diffusers(when):
    quantization = pytest.importorskip("torchao.quantization")

    def quantize(pipe):
        quantization.quantize_(pipe.transformer, quantization.Int8WeightOnlyConfig())

    plain, fast = _changed_before_or_after(quantize, when)
    torch.testing.assert_close(_latents(fast), _latents(plain), rtol=0, atol=0)
    report = _report(fast)
    # the reason names the linear as Diffusers does (not our packed projection): each block's 2 calls
    assert "block calls run by Diffusers' forward: 8 (attn.to_q.weight is a Int8Tensor" in report, report
    _assert_planned_for(report, "float32, cpu, head_dim=16")


def _int8_mlps(pipe) -> None:
    """torchao int8 weights for the blocks' MLP linears only: their attention linears stay plain."""
    quantization = pytest.importorskip("torchao.quantization")
    quantization.quantize_(
        pipe.transformer,
        quantization.Int8WeightOnlyConfig(),
        filter_fn=lambda module, name: isinstance(module, torch.nn.Linear) and ".ff." in f".{name}",
    )


def _torchao_under_layouts(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    _int8_mlps(plain)
    expected = _latents(plain)
    weights = {k: v.clone() for k, v in plain.transformer.state_dict().items()}
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    _int8_mlps(pipe)
    # tp cannot slice a quantized weight: refused before any linear is split (it used to fail in torchao's
    # cat with the attention linears split already)
    with pytest.raises(ValueError, match=r"tp=2 cannot split ff\.net\.0\.proj\.weight: it is a Int8Tensor"):
        omni_accel.accelerate(pipe, parallel=ParallelConfig(tp=2))
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights if "ff." not in k)
    assert type(pipe.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    torch.testing.assert_close(_latents(pipe), expected, rtol=0, atol=0)
    # cfg keeps every weight whole: the quantized blocks run as Diffusers computes them, on both ranks
    omni_accel.accelerate(pipe, parallel=ParallelConfig(cfg=2))
    torch.testing.assert_close(_latents(pipe), expected, rtol=0, atol=0)
    omni_accel.restore(pipe)
    # parallel="auto" chose ulysses=2 for a call without guidance, whose first block then raised "cannot run
    # natively"; it says at once what works instead, and with true CFG it takes cfg=2
    omni_accel.accelerate(pipe, parallel="auto")
    with pytest.raises(
        ValueError, match=r"found no layout .*ff\.net\.0\.proj\.weight is a Int8Tensor.*native=False"
    ):
        _latents(pipe)
    guided = dict(CALL, negative_prompt="a dog", true_cfg_scale=3.0)
    plain_guided = plain(**guided, generator=torch.Generator().manual_seed(0)).images
    got = pipe(**guided, generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(got, plain_guided, rtol=0, atol=0)
    assert "parallel='auto': ParallelConfig(tp=1, ulysses=1, ring=1, cfg=2)" in _report(pipe), _report(pipe)


@pytest.mark.multirank
def test_torchao_weights_under_tensor_parallel_are_refused_clearly():
    pytest.importorskip("torchao.quantization")
    run_multirank(_torchao_under_layouts, 2, timeout=240)
