"""The generic tier on a GPU, as a user gets it by default: repeated blocks compiled by inductor at the
first call, steps replayed from CUDA graphs, against plain Diffusers; the same with the compile in the
background (eager steps until the code is ready); and a user's own inductor compile of another model of the
same class in the same process."""

import copy

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import rel_err
from tiny_transformers import Holder, build, outputs

import omni_accel


def _generic(pipe, **options):
    """``accelerate`` in the generic tier: Qwen-Image (and FLUX.1, Wan) have native blocks, and these tests
    take them as models without."""
    return omni_accel.accelerate(pipe, **{"native": False, **options})


pytestmark = pytest.mark.gpu

_BUILDERS = {"qwenimage": omni_accel.tiny_qwenimage_pipeline, "sd3": omni_accel.tiny_sd3_pipeline}
# float32 images: inductor's fused order differs from eager's in rounding only. Diffusers' own
# compile_repeated_blocks() of the tiny Qwen-Image was 2.4e-4 from its eager images on an H200.
_COMPILED = 1e-3


def _images(pipe, steps: int = 2):
    call = dict(prompt="a cat", height=32, width=32, num_inference_steps=steps, output_type="pt")
    return pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).images


@pytest.mark.parametrize("background", [False, True], ids=["first-call", "background"])
@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_generic_tier_compiles_then_replays(name, background):
    torch._dynamo.reset()
    plain = _BUILDERS[name](device="cuda")
    pipe = _generic(_BUILDERS[name](device="cuda"), compile_in_background=background)
    expected = _images(plain)
    component = omni_accel.describe(pipe).components[0]
    assert component.mode == "generic" and component.runtime is not None and component.graphs is not None
    first = _images(pipe)  # background: eager (the compile starts at the next step), then a capture
    component.runtime.compiler.wait(300)
    later = [_images(pipe) for _ in range(3)]  # compiled code switched in, captured again, replayed
    for got in (first, *later):
        assert rel_err(got, expected) <= _COMPILED
    if background:
        (calls,) = component.runtime.compiler.calls().values()
        assert calls[0] > 0 and calls[1] > 0, calls  # eager calls before, compiled ones after
    stats = component.graphs.stats()
    assert stats["captures"] >= 1 and stats["replays"] >= 1, stats
    assert not component.runtime.fallbacks
    report = str(omni_accel.describe(pipe))
    assert ("in the background" if background else "at the first call") in report and "-> error" not in report


def test_half_precision_generic_tier_matches_plain_as_closely_as_float32_plain_does():
    torch._dynamo.reset()
    reference = _images(omni_accel.tiny_qwenimage_pipeline(device="cuda"))
    plain = omni_accel.tiny_qwenimage_pipeline(device="cuda", dtype=torch.bfloat16)
    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(device="cuda", dtype=torch.bfloat16))
    _images(pipe)
    omni_accel.describe(pipe).components[0].runtime.compiler.wait(300)
    for _ in range(2):
        got = _images(pipe)
    assert rel_err(got, reference) <= 2 * rel_err(_images(plain), reference) + 1e-3


def test_a_users_inductor_compile_of_another_model_in_the_same_process():
    torch._dynamo.reset()
    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(device="cuda"), compile_in_background=False)
    _images(pipe)
    other = omni_accel.tiny_qwenimage_pipeline(seed=1, device="cuda")
    expected = _images(other)
    other.transformer.compile_repeated_blocks(fullgraph=True)
    assert rel_err(_images(other), expected) <= _COMPILED
    assert rel_err(_images(pipe), _images(omni_accel.tiny_qwenimage_pipeline(device="cuda"))) <= _COMPILED


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["QwenImageTransformer2DModel", "LTX2VideoTransformer3DModel"])
def test_steps_that_make_host_values_on_the_gpu_are_captured_and_replayed(name, compiled):
    """Qwen-Image's text length (``torch.as_tensor``) and LTX-2's patch sizes and scale factors
    (``torch.tensor``) are made on the host inside the forward; their steps now capture, those values served
    from pinned memory, and the compiled blocks run without compiling again inside the capture."""
    torch._dynamo.reset()
    model, inputs = build(name)
    inputs = pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, inputs)
    if "encoder_hidden_states_mask" in inputs:
        inputs["encoder_hidden_states_mask"][:, -2:] = 0  # padded text: the length is made from it
    plain = copy.deepcopy(model).cuda()
    pipe = _generic(Holder(model.cuda()), compile=None if compiled else False)
    expected = outputs(plain, inputs)
    first = outputs(pipe.transformer, inputs)  # eager, or compiled at this first call
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    later = [outputs(pipe.transformer, inputs) for _ in range(3)]  # captured, then replayed
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before
    stats = omni_accel.describe(pipe).components[0].graphs.stats()
    assert stats["captures"] == 1 and stats["replays"] + stats["early_replays"] >= 2, stats
    assert not any("capture" in reason for reason in stats["eager"]), stats
    for got in later:  # a replay is the step it recorded
        for a, b in zip(got, first, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(first, expected, strict=True):
        assert rel_err(a, b) <= (_COMPILED if compiled else 1e-5)


def test_hunyuan_video15_drops_its_padded_keys_inside_inductor_compiled_blocks():
    """The key mask built once per forward reaches our attention op inside the inductor-compiled blocks as
    the very tensor every block gets, so the padded keys are dropped there too."""
    from test_key_padding import _Holder, _tiny_hunyuan_video15

    torch._dynamo.reset()
    plain, accelerated, inputs = _tiny_hunyuan_video15()
    inputs = pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, inputs)
    pipe = _generic(_Holder(accelerated.cuda()), compile_in_background=False)
    with torch.no_grad():
        expected = plain.cuda()(**inputs)[0]
        got = pipe.transformer(**inputs)[0]
    assert rel_err(got, expected) <= _COMPILED
    component = omni_accel.describe(pipe).components[0]
    assert component.selector.served_without_mask == {"generic.attn": 2}
    assert component.runtime.compiler.summary() and not component.runtime.fallbacks
