"""compile=True: the native blocks trace without graph breaks and keep following the attention scope."""

import pytest
import torch

import omni_accel
from omni_accel import attention_scope

CALL = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="latent")


def _latents(pipe):
    return pipe(**CALL, generator=torch.Generator().manual_seed(0)).images


def test_compiled_blocks_match_eager_and_follow_the_scope():
    torch._dynamo.reset()
    eager = _latents(omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0)))
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), compile={"backend": "aot_eager", "fullgraph": True}
    )
    got = _latents(pipe)
    assert ((got - eager).abs().max() / eager.abs().max()).item() <= 1e-5
    report = omni_accel.describe(pipe)
    assert "repeated blocks compiled" in str(report)
    assert report.components[0].cache is None and "cache: off, because compiled" in str(report)
    with attention_scope(default="sdpa_math"):
        _latents(pipe)
    selector = omni_accel.describe(pipe).components[0].selector
    assert {row[2] for row in selector.decisions()} == {"sdpa", "sdpa_math"}  # decided at run time


def test_compile_needs_a_native_transformer():
    with pytest.raises(ValueError, match="compile_repeated_blocks"):
        omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0), compile=True)


def test_routed_attention_op_passes_opcheck():
    from omni_accel.attention.selection import default_selector

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    args = (q, k, v, default_selector().index, -1, "test", "self", 8**-0.5)
    torch.library.opcheck(torch.ops.omni_accel.routed_attention.default, args)


def test_blocks_of_one_class_share_one_compiled_graph():
    """Per-layer constants in the traced code would recompile every block (torch's limit is 8)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_layers=3, num_single_layers=3)
    omni_accel.accelerate(pipe, compile={"backend": "aot_eager"})
    _latents(pipe)
    assert counters["stats"]["unique_graphs"] == 2  # one per block class


def test_diffusers_compile_repeated_blocks_after_accelerate():
    """Diffusers' own switch compiles the native blocks: the host-side preparation stays eager (one graph
    break per call), the math compiles once per block class, the output matches."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    plain = omni_accel.tiny_flux_pipeline(seed=0, num_layers=3, num_single_layers=3)
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0, num_layers=3, num_single_layers=3))
    pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    got = _latents(pipe)
    assert ((got - _latents(plain)).abs().max() / _latents(plain).abs().max()).item() <= 1e-5
    assert counters["stats"]["unique_graphs"] <= 4  # per block class: the prologue and the math
    assert all("_prepare" in reason for reason in counters["graph_break"])
