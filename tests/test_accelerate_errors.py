"""Bad input to accelerate/restore/describe: clear errors, and the pipeline is left untouched."""

import importlib.util

import omni_accel.patches as patches
import pytest
import torch

import omni_accel
from omni_accel import AccelConfig, AttentionProviderError


@pytest.fixture
def pipe():
    return omni_accel.tiny_flux_pipeline(seed=0)


def _untouched(pipe):
    assert type(pipe.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    with pytest.raises(ValueError, match="not accelerated"):
        omni_accel.describe(pipe)


def test_not_a_pipeline():
    with pytest.raises(TypeError, match="takes a Diffusers pipeline, got Linear"):
        omni_accel.accelerate(torch.nn.Linear(2, 2))


def test_unknown_option_is_refused_by_name(pipe):
    """accelerate's options are typed keywords (type checkers and IDEs see them); a misspelt one is named."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'atention'"):
        omni_accel.accelerate(pipe, atention="sdpa")
    _untouched(pipe)


def test_enable_lists_the_valid_options():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['atention'\]; valid options: \['attention'"):
        omni_accel.enable(atention="sdpa")


def test_config_of_the_wrong_type(pipe):
    with pytest.raises(TypeError, match="must be an omni_accel.AccelConfig"):
        omni_accel.accelerate(pipe, {"attention": "sdpa"})
    with pytest.raises(TypeError, match="native must be True or False"):
        AccelConfig(native="yes")
    with pytest.raises(TypeError, match="attention must be"):
        AccelConfig(attention=3)
    with pytest.raises(TypeError, match="components must be a tuple"):
        AccelConfig(components="transformer")
    with pytest.raises(TypeError, match="components must be a tuple of attribute names, got 5"):
        AccelConfig(components=5)
    assert AccelConfig(components=iter(["transformer"])).components == ("transformer",)
    # a name given twice was described as two components, the second "set up as pipe.transformer"
    with pytest.raises(ValueError, match=r"components names \['transformer'\] more than once"):
        omni_accel.accelerate(pipe, components=("transformer", "transformer"))
    _untouched(pipe)


def test_no_components_is_refused_not_reported_as_a_pipeline_without_transformer(pipe):
    """components=() did nothing and said the pipeline had no transformer."""
    with pytest.raises(ValueError, match=r"components=\(\) names no denoiser.*the default \['transformer'"):
        omni_accel.accelerate(pipe, components=())
    _untouched(pipe)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"bogus_kw": 1}, "unexpected keyword argument 'bogus_kw'"),
        ({"mode": "bogus-mode"}, "Unrecognized mode=bogus-mode"),
        ({"options": {"bogus_option": 1}}, "Unexpected optimization option bogus_option"),
    ],
)
def test_compile_arguments_torch_compile_refuses_are_named_at_accelerate(pipe, arguments, named):
    """Not at the first call (which left every later call failing before)."""
    with pytest.raises(ValueError, match=rf"(?s)is not what torch.compile takes.*{named}.*compile=True"):
        omni_accel.accelerate(pipe, compile=arguments)
    _untouched(pipe)


def test_compile_arguments_that_disable_the_compile_are_refused(pipe):
    """compile={"disable": True} compiled nothing while describe said the blocks were compiled."""
    with pytest.raises(ValueError, match=r"disable=True, which compiles nothing; pass compile=False"):
        omni_accel.accelerate(pipe, compile={"disable": True})
    _untouched(pipe)
    omni_accel.accelerate(pipe, compile={"disable": False, "dynamic": False})
    assert "repeated blocks compiled" in str(omni_accel.describe(pipe))


def test_background_compile_with_compile_off_is_refused(pipe):
    with pytest.raises(ValueError, match="compile_in_background=True asks for a compile that compile=False"):
        omni_accel.accelerate(pipe, compile=False, compile_in_background=True)
    _untouched(pipe)


def test_background_compile_with_nothing_to_compile_is_said(pipe):
    """Not silently ignored: native blocks that run eager, and generic blocks off CUDA, say so."""
    omni_accel.accelerate(pipe, compile_in_background=True)
    said = str(omni_accel.describe(pipe))
    assert "compile_in_background: nothing to compile here (native blocks run eager" in said
    generic = omni_accel.tiny_qwenimage_pipeline(seed=0)
    omni_accel.accelerate(generic, native=False, compile_in_background=True)
    assert "not compiled (no CUDA device here" in str(omni_accel.describe(generic))
    assert "compile_in_background has nothing to compile" in str(omni_accel.describe(generic))


def test_unknown_provider(pipe):
    with pytest.raises(ValueError, match="Unknown attention provider 'fa3'"):
        omni_accel.accelerate(pipe, attention="fa3")
    _untouched(pipe)


def test_explicit_provider_that_cannot_run_here_fails_before_swapping(pipe):
    with pytest.raises(AttentionProviderError, match="'sdpa_cudnn'.*runs on \\['cuda'\\], not cpu"):
        omni_accel.accelerate(pipe, attention="sdpa_cudnn")
    _untouched(pipe)


@pytest.mark.skipif(
    importlib.util.find_spec("sageattention") is not None, reason="checks the message without sageattention"
)
def test_missing_optional_package_names_the_install_command(pipe):
    with pytest.raises(AttentionProviderError, match="omni-accel\\[sage\\]"):
        omni_accel.accelerate(pipe, attention={"per_role": {"flux.single": "sage"}})
    _untouched(pipe)


def test_accelerating_twice_is_refused(pipe):
    omni_accel.accelerate(pipe)
    with pytest.raises(RuntimeError, match="already accelerated"):
        omni_accel.accelerate(pipe)


def test_restore_and_describe_need_an_accelerated_pipeline(pipe):
    with pytest.raises(ValueError, match="not accelerated"):
        omni_accel.restore(pipe)
    with pytest.raises(ValueError, match="not accelerated"):
        omni_accel.describe(pipe)


@pytest.mark.parametrize("function", ["restore", "describe"])
def test_restore_and_describe_of_a_module_name_the_pipeline_they_take(pipe, function):
    """They raised AttributeError ("'FluxTransformer2DModel' object has no attribute 'components'")."""
    omni_accel.accelerate(pipe)
    for wrong in (pipe.transformer, None):
        with pytest.raises(TypeError, match=rf"{function}\(\) takes a Diffusers pipeline, got .*pass a Diff"):
            getattr(omni_accel, function)(wrong)
    assert omni_accel.describe(pipe).components[0].mode == "native"


def test_pipeline_without_transformer_is_left_as_is_with_a_report(pipe):
    pipe.transformer = None
    assert omni_accel.accelerate(pipe) is pipe
    assert "no transformer component; nothing was accelerated" in str(omni_accel.describe(pipe))
    omni_accel.restore(pipe)


def test_a_unet_pipeline_is_told_how_to_accelerate_its_unet():
    """The default takes transformers only; the report named no way to take a pipeline's UNet."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(0)
    blocks = dict(
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D")
    )
    unet = UNet2DModel(
        sample_size=8, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, **blocks
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10))
    omni_accel.accelerate(pipe)
    assert "components=('unet',) accelerates its denoiser" in str(omni_accel.describe(pipe))
    omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, components=("unet",))
    assert omni_accel.describe(pipe).components[0].name == "unet"


def test_a_compiled_transformer_is_refused_with_the_way_out(pipe):
    pipe.transformer = torch.compile(pipe.transformer)
    with pytest.raises(ValueError, match=r"_orig_mod\) and pass compile=True"):
        omni_accel.accelerate(pipe)


def test_patch_outside_its_checked_versions_is_refused(monkeypatch):
    import omni_accel.patches.dispatch_attention as patch

    monkeypatch.setattr(patch, "CHECKED_VERSIONS", ("0.1.0", "0.2.0"))
    pipe = omni_accel.tiny_qwenimage_pipeline(seed=0)
    applied_before = patches.applied()
    with pytest.raises(RuntimeError, match="checked against diffusers 0.1.0 to < 0.2.0"):
        omni_accel.accelerate(pipe, native=False)  # the routed path applies the patch
    assert not pipe.transformer._forward_pre_hooks
    assert patches.applied() == applied_before


@pytest.mark.parametrize("builder", ["tiny_flux_pipeline", "tiny_wan_pipeline"])
def test_unknown_role_lists_the_roles_of_the_pipeline(builder):
    pipe = getattr(omni_accel, builder)(seed=0)
    with pytest.raises(
        ValueError,
        match=r"per_role names \['flux.jiont'\], which no transformer of .*Its attention sites: pipe.transformer "
        r"\(\w+\): roles \[.*Use one of those roles or categories .* or leave the key out",
    ):
        omni_accel.accelerate(pipe, attention={"per_role": {"flux.jiont": "sdpa_math"}})
    with pytest.raises(ValueError, match="not accelerated"):
        omni_accel.describe(pipe)


def test_a_role_of_another_component_is_taken():
    """One attention config serves every component: a role that only pipe.transformer_2 has was refused as
    unknown to pipe.transformer; it applies to the component that has it, and leaves the other alone."""
    from conftest import random_wan_transformer

    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    pipe.transformer_2 = random_wan_transformer()
    omni_accel.accelerate(pipe, attention={"per_role": {"wan.cross": "sdpa_math"}})
    report = omni_accel.describe(pipe)
    rows = {c.name: {row[0]: row[2] for row in c.planned_attention} for c in report.components}
    assert rows["transformer_2"]["wan.cross"] == "sdpa_math"
    assert set(rows["transformer"].values()) == {"sdpa"}
    omni_accel.restore(pipe)
    with pytest.raises(ValueError, match=r"per_role names \['wan.crosss'\].*pipe.transformer_2 \(Wan"):
        omni_accel.accelerate(pipe, attention={"per_role": {"wan.crosss": "sdpa_math"}})
    _untouched(pipe)


def test_an_attention_scope_naming_no_role_of_any_model_is_refused_at_its_first_call(pipe):
    """attention_scope(per_role=...) with a misspelt role changed nothing, silently."""
    omni_accel.accelerate(pipe)
    call = dict(prompt="a", height=16, width=16, num_inference_steps=1, output_type="latent")
    with (
        pytest.raises(
            ValueError,
            match=r"attention_scope's per_role names \['flux.jiont'\], which no accel.*"
            r"pipe.transformer \(FluxTransformer2DModel\): roles \['flux.joint', 'flux.single'\]",
        ),
        omni_accel.attention_scope(per_role={"flux.jiont": "sdpa_math"}),
    ):
        pipe(**call)
    with omni_accel.attention_scope(per_role={"flux.joint": "sdpa_math", "cross": "sdpa"}):
        pipe(**call)
    decisions = {row[0]: row[2] for row in omni_accel.describe(pipe).components[0].selector.decisions()}
    assert decisions == {"flux.joint": "sdpa_math", "flux.single": "sdpa"}


def test_routed_model_checks_an_explicit_provider_at_accelerate():
    pipe = omni_accel.tiny_wan_pipeline(seed=0)
    with pytest.raises(AttentionProviderError, match="flashinfer"):
        omni_accel.accelerate(pipe, attention={"per_role": {"wan.self": "flashinfer"}})
    assert not pipe.transformer._forward_pre_hooks


def test_accelerate_takes_every_option_of_accel_config_by_keyword():
    """The typed keywords of ``accelerate`` are exactly AccelConfig's fields: a field added to one only would
    be an option that cannot be given, or a keyword that sets nothing."""
    import dataclasses
    import inspect

    keywords = [
        name
        for name, parameter in inspect.signature(omni_accel.accelerate).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert keywords == [field.name for field in dataclasses.fields(omni_accel.AccelConfig)]


def test_an_error_halfway_through_the_block_swap_leaves_no_block_native(pipe, monkeypatch):
    """Packing allocates (an out-of-memory error may come at any block): the blocks swapped before it go back,
    and a later accelerate does its own swap rather than taking the leftovers for another pipeline's."""
    from omni_accel.models.base import NativeBlock

    prepack, calls = NativeBlock.prepack, []

    def fails_at_the_third(block):
        calls.append(block)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected")
        prepack(block)

    monkeypatch.setattr(NativeBlock, "prepack", fails_at_the_third)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        omni_accel.accelerate(pipe)
    monkeypatch.undo()
    blocks = [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]
    assert len(calls) == 3 and all(type(b).__module__.startswith("diffusers.") for b in blocks)
    assert not any("omni_runtime" in vars(b) for b in blocks)
    assert "_repeated_blocks" not in vars(pipe.transformer)
    _untouched(pipe)
    omni_accel.accelerate(pipe)
    assert omni_accel.describe(pipe).components[0].mode == "native"
