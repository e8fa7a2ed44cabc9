"""``describe`` says what is true now, and wrong input fails with an error that names the option, what was
given and the expected form: CUDA graphs on a machine without CUDA, a ``from_pipe`` sibling after its owner's
restore, malformed attention options, components that are not denoisers, modular pipelines (accelerated,
described, restored, and under zero-code), and zero-code never failing a pipeline plain Diffusers builds."""

import copy
import gc
import logging
import pickle
import weakref

import pytest
import torch
from conftest import flux_inputs, rel_err
from diffusers import FluxAutoBlocks, FluxImg2ImgPipeline, FluxPipeline

import omni_accel
from omni_accel import AccelConfig, ParallelConfig, cuda_graphs

CALL = dict(prompt="a cat", num_inference_steps=2, output_type="latent")


def _latents(pipe) -> torch.Tensor:
    return pipe(**CALL, generator=torch.Generator().manual_seed(0)).images


def _untouched(pipe) -> None:
    assert type(pipe.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    assert getattr(pipe, "_omni_accel_state", None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="what describe says where no step can run on CUDA")
def test_cuda_graphs_without_cuda_are_reported_as_they_ran():
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), cuda_graphs=True)
    _latents(pipe)
    report = str(omni_accel.describe(pipe))
    assert "captured as a CUDA graph" not in report and "replayed from CUDA graphs" not in report
    assert "cuda_graphs=True, but no step can run on CUDA here (this machine has no CUDA device)" in report
    assert "cuda graphs: 0 captured, 0 replays, 0 kept" in report
    assert "cuda graphs: 2 calls ran eagerly (arguments not all on one CUDA device)" in report


def test_a_from_pipe_sibling_is_described_as_it_is_after_its_owner_restores():
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    owner = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    sibling = omni_accel.accelerate(FluxImg2ImgPipeline.from_pipe(owner))
    assert omni_accel.describe(sibling).components[0].mode == "native (shared)"
    omni_accel.restore(owner)
    component = omni_accel.describe(sibling).components[0]
    assert component.mode == "untouched" and "has since restored it" in component.detail
    assert component.runtime is None and component.selector is None
    omni_accel.accelerate(sibling)  # it holds nothing any more: it may accelerate the module itself
    assert omni_accel.describe(sibling).components[0].mode == "native"
    sibling_call = dict(CALL, image=torch.rand(1, 3, 32, 32), strength=1.0)
    expected = FluxImg2ImgPipeline.from_pipe(plain)(
        **sibling_call, generator=torch.Generator().manual_seed(0)
    )
    got = sibling(**sibling_call, generator=torch.Generator().manual_seed(0))
    assert rel_err(got.images, expected.images) <= 1e-5


def test_a_from_pipe_chain_of_a_pipeline_accelerated_by_hand_is_described_and_not_half_restored():
    """``describe`` refused a sibling not accelerated itself ('This pipeline is not accelerated') though its
    transformer runs the owner's native blocks; it says so now, and ``restore`` of such a sibling names the
    pipeline to restore rather than claiming nothing runs accelerated. Steps as in plain Diffusers."""
    plain = FluxPipeline.from_pipe(FluxPipeline.from_pipe(omni_accel.tiny_flux_pipeline(seed=0)))
    owner = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    middle = FluxImg2ImgPipeline.from_pipe(owner)
    last = FluxPipeline.from_pipe(middle)
    for sibling in (middle, last):
        component = omni_accel.describe(sibling).components[0]
        assert component.mode == "native (shared)" and "restore that pipeline to undo" in component.detail
        with pytest.raises(
            ValueError, match=r"not accelerated itself: pipe.transformer .* omni_accel.restore\(\) that"
        ):
            omni_accel.restore(sibling)
    twin = copy.deepcopy(
        middle
    )  # owns a copy of the module that no pipeline set up: accelerate takes it over
    assert "which no pipeline owns" in omni_accel.describe(twin).components[0].detail
    with pytest.raises(
        ValueError, match=r"a deep or unpickled copy.*omni_accel.accelerate\(pipe\) takes it over"
    ):
        omni_accel.restore(twin)
    assert type(owner.transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
    assert rel_err(_latents(last), _latents(plain)) <= 1e-5
    omni_accel.restore(owner)
    _untouched(last)
    with pytest.raises(ValueError, match="not accelerated"):
        omni_accel.describe(last)  # it runs plain Diffusers now
    assert torch.equal(_latents(last), _latents(plain))


def test_a_sibling_not_accelerated_itself_is_described_with_its_own_transformer_as_plain():
    """Wan 2.2's sibling with a second expert of its own: the shared expert runs the owner's setup, its own
    runs as in Diffusers (the report named the shared one only, as if it were the whole pipeline)."""
    from diffusers import WanPipeline

    owner = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, two_experts=True))
    other = omni_accel.tiny_wan_pipeline(seed=1, two_experts=True).transformer_2
    sibling = WanPipeline.from_pipe(owner, transformer_2=other)
    report = omni_accel.describe(sibling)
    assert [(c.name, c.mode) for c in report.components] == [
        ("transformer", "native (shared)"),
        ("transformer_2", "untouched"),
    ]
    assert "not accelerated itself: it runs as in Diffusers" in report.components[1].detail
    omni_accel.accelerate(sibling)
    assert [c.mode for c in omni_accel.describe(sibling).components] == ["native (shared)", "native"]


def test_options_a_from_pipe_sibling_asks_that_its_shared_module_does_not_run_are_refused():
    """They were silently ignored (an invalid provider, quantize, compile...): the module runs its owner's
    setup. The same options, or none, share it; after the owner restores, the sibling sets it up itself."""
    owner = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), attention="sdpa")
    sibling = FluxImg2ImgPipeline.from_pipe(owner)
    for options in ({"quantize": "fp8"}, {"attention": "sdpa_cudnn"}, {"config": AccelConfig(compile=True)}):
        with pytest.raises(
            ValueError, match=r"shared with another pipeline \(from_pipe\) that accelerated it"
        ):
            omni_accel.accelerate(sibling, **options)
        assert getattr(sibling, "_omni_accel_state", None) is None  # refused: the sibling is left as it was
    omni_accel.accelerate(sibling, attention="sdpa", components=("transformer",))
    assert omni_accel.describe(sibling).components[0].mode == "native (shared)"
    omni_accel.restore(sibling)
    omni_accel.restore(owner)
    omni_accel.accelerate(sibling, quantize="fp8")
    assert omni_accel.describe(sibling).components[0].mode == "native"


def test_a_module_its_owner_left_untouched_and_a_sibling_set_up_is_described_by_both():
    """A transformer the first pipeline left untouched (nothing to do on this machine), which a sibling
    holding it accelerates with options: both describe the sibling's setup, the owner's restore keeps the
    sibling's options, so a third pipeline asking others is refused as with any shared module."""
    from diffusers import ConfigMixin, ModelMixin
    from tiny_transformers import Holder

    class Plain(ModelMixin, ConfigMixin):  # nothing registered, routed or compiled: untouched on CPU
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, hidden_states):
            return self.proj(hidden_states)

    module = Plain()
    owner = omni_accel.accelerate(Holder(module), cuda_graphs=False)
    assert omni_accel.describe(owner).components[0].mode == "untouched"
    sibling = omni_accel.accelerate(Holder(module), cuda_graphs=True)
    assert omni_accel.describe(sibling).components[0].mode == "generic"
    component = omni_accel.describe(owner).components[0]
    assert component.mode == "generic (shared)" and "cuda_graphs=True" in component.detail
    assert component.graphs is not None
    omni_accel.restore(owner)
    with pytest.raises(ValueError, match="accelerated it with cuda_graphs=True"):
        omni_accel.accelerate(Holder(module), cuda_graphs=False)
    omni_accel.restore(sibling)
    assert "forward" not in module.__dict__


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda pipe: pickle.loads(pickle.dumps(pipe))])
def test_options_a_sibling_of_a_copied_pipeline_asks_that_its_module_does_not_run_are_refused(duplicate):
    """A copy's modules are copies, which the options record did not know: a sibling of the copy asking
    other options was accepted and described as sharing, its options silently ignored."""
    copied = duplicate(omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), native=False))
    sibling = FluxImg2ImgPipeline.from_pipe(copied)
    with pytest.raises(ValueError, match=r"shared with another pipeline \(from_pipe\) that accelerated it"):
        omni_accel.accelerate(sibling, attention="sdpa_math")
    omni_accel.restore(copied)  # forgets the copy's options: the sibling sets the module up itself
    assert omni_accel.describe(omni_accel.accelerate(sibling, attention="sdpa_math")).components[0].mode == (
        "native"
    )


def test_a_from_pipe_sibling_reports_the_step_graphs_under_a_hook_registered_since():
    """The sibling's report of a shared module lost its CUDA graph lines once a Diffusers hook registered
    after accelerate wrapped the module's step graphs; both pipelines report them."""
    from diffusers.hooks import HookRegistry, ModelHook

    owner = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), cuda_graphs=True)
    sibling = omni_accel.accelerate(FluxImg2ImgPipeline.from_pipe(owner))
    HookRegistry.check_if_exists_or_initialize(owner.transformer).register_hook(ModelHook(), "noop")
    with torch.no_grad():
        owner.transformer(**flux_inputs(owner.transformer))
    for pipe in (owner, sibling):
        assert "cuda graphs: 1 calls ran eagerly" in str(omni_accel.describe(pipe))


def test_a_diffusers_step_cache_is_reported_lossy_as_it_is_when_described():
    """The design's lossy options are marked in the report: a step cache the user enabled with Diffusers'
    ``enable_cache`` (before or after accelerate, on either tier) said nothing at all."""
    from diffusers import FirstBlockCacheConfig

    lossy = "Diffusers step cache (lossy): FirstBlockCacheConfig"
    for native in (True, False):
        pipe = omni_accel.tiny_flux_pipeline(seed=0)
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        omni_accel.accelerate(pipe, native=native)
        assert lossy in str(omni_accel.describe(pipe)), native
        pipe.transformer.disable_cache()
        assert "step cache" not in str(omni_accel.describe(pipe)), native
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        assert lossy in str(omni_accel.describe(pipe)), native


def test_a_replaced_transformer_is_described_as_plain():
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    pipe.transformer = omni_accel.tiny_flux_pipeline(seed=1).transformer
    component = omni_accel.describe(pipe).components[0]
    assert component.mode == "replaced" and "runs as in Diffusers" in component.detail


def test_vae_parallel_without_a_layout_is_said_not_ignored():
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), vae_parallel=True)
    vae = next(c for c in omni_accel.describe(pipe).components if c.name == "vae")
    assert vae.mode == "untouched" and "none runs here" in vae.detail
    twin = copy.deepcopy(pipe)  # holds its own copy of the VAE its report describes
    assert next(c for c in omni_accel.describe(twin).components if c.name == "vae").mode == "untouched"
    pipe.vae = omni_accel.tiny_flux_pipeline(seed=1).vae  # the line is about the VAE held now
    vae = next(c for c in omni_accel.describe(pipe).components if c.name == "vae")
    assert vae.mode == "replaced" and "runs as in Diffusers" in vae.detail


def test_swapped_accelerated_transformers_are_described_where_they_are_now():
    pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, two_experts=True))
    pipe.transformer, pipe.transformer_2 = pipe.transformer_2, pipe.transformer
    first, second = omni_accel.describe(pipe).components[:2]
    assert (first.name, first.mode) == ("transformer", "native")
    assert "set up as pipe.transformer_2, which pipe.transformer holds now" in first.detail
    assert (second.name, second.mode) == ("transformer_2", "native")
    assert first.planned_attention and first.runtime is pipe.transformer.blocks[0].omni_runtime
    other = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=1, two_experts=True))
    pipe.transformer = other.transformer  # accelerated by another pipeline: runs as that one set it up
    first = omni_accel.describe(pipe).components[0]
    assert first.mode == "replaced" and "accelerated by another pipeline" in first.detail


def test_one_module_held_under_two_names_is_accelerated_once():
    """Plain Diffusers runs ``pipe.transformer_2 = pipe.transformer``; accelerate swapped its blocks twice
    (and refused it as holding blocks it did not know)."""
    pipe = omni_accel.tiny_wan_pipeline(seed=0, two_experts=True)
    pipe.transformer_2 = pipe.transformer
    call = dict(prompt="a cat", num_inference_steps=4, height=16, width=16, num_frames=1, output_type="pt")
    before = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    omni_accel.accelerate(pipe)
    first, second = omni_accel.describe(pipe).components[:2]
    assert (first.mode, second.mode) == ("native", "native")
    assert "set up as pipe.transformer, which pipe.transformer_2 holds now" in second.detail
    fast = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    assert rel_err(fast, before) < 1e-5
    omni_accel.restore(pipe)
    assert type(pipe.transformer.blocks[0]).__name__ == "WanTransformerBlock"
    assert torch.equal(pipe(**call, generator=torch.Generator().manual_seed(0)).frames, before)


@pytest.mark.parametrize(
    ("attention", "message"),
    [
        (
            {"per_role": ["flux.single", "sdpa"]},
            r"attention\['per_role'\] must map role or category names.*got a list",
        ),
        ({"per_role": "sdpa"}, r"attention\['per_role'\] must map .*got a str: 'sdpa'.*attention='NAME'"),
        (
            {"per_role": {"flux.single": ["sdpa"]}},
            r"to one provider name \(a str\).*'flux.single': \['sdpa'\]",
        ),
        ({"default": ["sdpa"]}, r"attention\['default'\] must be one provider name.*got \['sdpa'\]"),
    ],
)
def test_malformed_attention_options_name_the_option_and_the_form(attention, message):
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    with pytest.raises(TypeError, match=message):
        omni_accel.accelerate(pipe, attention=attention)
    _untouched(pipe)


def test_attention_config_and_scope_check_their_forms_too():
    """The same forms checked where users build the config themselves (``AttentionConfig``,
    ``attention_scope``), with the option named as they wrote it."""
    with pytest.raises(TypeError, match=r"AttentionConfig.per_role must map .*got a list"):
        omni_accel.AttentionConfig(per_role=["flux.single", "sdpa"])
    with (
        pytest.raises(TypeError, match=r"got a str: 'sdpa'.*default='NAME'"),
        omni_accel.attention_scope(per_role="sdpa"),
    ):
        pass
    with pytest.raises(TypeError, match=r"AttentionConfig.default must be one provider name"):
        omni_accel.AttentionConfig(default=["sdpa"])


@pytest.mark.parametrize(
    ("components", "message"),
    [
        (("vae",), r"pipe.vae \(AutoencoderKL\), not a denoiser.*this pipeline's are \['transformer'\]"),
        (("transformer", "text_encoder"), r"names pipe.text_encoder \(CLIPTextModel\), not a denoiser"),
        (
            ("transformer_3",),
            r"\['transformer_3'\], which FluxPipeline does not hold.*denoisers are \['transformer'\]",
        ),
    ],
)
def test_components_must_name_denoisers_of_the_pipeline(components, message):
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    with pytest.raises(ValueError, match=message):
        omni_accel.accelerate(pipe, components=components)
    _untouched(pipe)
    assert omni_accel.describe(omni_accel.accelerate(pipe, components=("transformer",))).components[
        0
    ].mode == ("native")


def test_an_error_while_committing_leaves_the_pipeline_as_it_was(monkeypatch):
    def refuse(self):
        raise RuntimeError("no graphs today")

    monkeypatch.setattr(cuda_graphs.StepGraphs, "install", refuse)
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    with pytest.raises(RuntimeError, match="no graphs today"):
        omni_accel.accelerate(pipe, cuda_graphs=True)
    _untouched(pipe)


def _modular(components: dict):
    """A FLUX modular pipeline (the blocks Diffusers ships) holding the tiny pipeline's components."""
    pipe = FluxAutoBlocks().init_pipeline()
    pipe.update_components(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _modular_latents(pipe) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe(
        prompt="a cat", num_inference_steps=2, height=32, width=32, generator=generator, output="latents"
    )


def _tiny_components(seed: int = 0) -> dict:
    pipe = omni_accel.tiny_flux_pipeline(seed=seed)
    return {name: component for name, component in pipe.components.items() if component is not None}


def test_a_modular_pipeline_is_accelerated_described_and_restored():
    plain, fast = _modular(_tiny_components()), _modular(_tiny_components())
    expected = _modular_latents(plain)
    omni_accel.accelerate(fast)
    assert type(fast.transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
    assert rel_err(_modular_latents(fast), expected) <= 1e-5
    report = omni_accel.describe(fast)
    assert report.pipeline_class == "FluxModularPipeline" and report.components[0].mode == "native"
    assert "attention resolved: flux.joint [float32, cpu, head_dim=16] -> sdpa" in str(report)
    omni_accel.restore(fast)
    assert type(fast.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    assert torch.equal(_modular_latents(fast), _modular_latents(plain))
    with pytest.raises(ValueError, match="is a modular pipeline"):
        omni_accel.accelerate(fast, parallel=ParallelConfig(tp=2))
    assert getattr(fast, "_omni_accel_state", None) is None


def test_a_modular_pipeline_lets_go_of_the_transformer_it_unloads_or_replaces():
    """``unload_components`` frees the transformer as in Diffusers (the accelerated state kept it alive), and
    one replaced by ``update_components`` leaves the pipeline as Diffusers made it."""
    pipe = omni_accel.accelerate(_modular(_tiny_components()))
    first = weakref.ref(pipe.transformer)
    pipe.unload_components("transformer")
    gc.collect()
    assert first() is None
    assert omni_accel.describe(pipe).components[0].mode == "replaced"
    pipe = omni_accel.accelerate(_modular(_tiny_components()))
    old = pipe.transformer
    pipe.update_components(transformer=_tiny_components(seed=1)["transformer"])
    assert type(old.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    assert "it held a FluxTransformer2DModel" in omni_accel.describe(pipe).components[0].detail
    omni_accel.restore(pipe)
    assert "register_components" not in vars(pipe)


def test_zero_code_accelerates_a_modular_pipeline_when_its_components_arrive():
    components, replacement = _tiny_components(), _tiny_components(seed=1)["transformer"]
    expected = _modular_latents(_modular(_tiny_components()))
    omni_accel.enable(attention="sdpa_math")
    try:
        pipe = FluxAutoBlocks().init_pipeline()
        assert getattr(pipe, "_omni_accel_state", None) is None  # no transformer yet: nothing to do
        pipe.update_components(**components)
        pipe.set_progress_bar_config(disable=True)
        assert omni_accel.describe(pipe).components[0].mode == "native"
        assert rel_err(_modular_latents(pipe), expected) <= 1e-5
        assert "-> sdpa_math" in str(omni_accel.describe(pipe))
        first = pipe.transformer
        pipe.update_components(
            transformer=replacement
        )  # a new transformer: accelerated with the same options
        assert type(first.transformer_blocks[0]).__name__ == "FluxTransformerBlock"  # restored
        assert omni_accel.describe(pipe).components[0].mode == "native"
        assert type(pipe.transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
    finally:
        omni_accel.disable()
    from diffusers import ModularPipeline

    assert "omni_accel" not in ModularPipeline.register_components.__module__  # disable() unwrapped it


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs an explicit provider this machine cannot run")
def test_zero_code_leaves_a_refused_pipeline_plain_with_a_warning(caplog):
    expected = _latents(omni_accel.tiny_flux_pipeline(seed=0))
    omni_accel.enable(attention="sdpa_cudnn")  # a CUDA-only kernel, on a machine without CUDA
    try:
        with caplog.at_level(logging.WARNING, logger="omni_accel"):
            pipe = omni_accel.tiny_flux_pipeline(seed=0)  # the constructor does not raise
    finally:
        omni_accel.disable()
    _untouched(pipe)
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert (
        "zero-code acceleration left FluxPipeline as plain Diffusers" in warning and "sdpa_cudnn" in warning
    )
    assert torch.equal(_latents(pipe), expected)


def test_accelerate_still_refuses_what_is_not_a_pipeline():
    with pytest.raises(TypeError, match="takes a Diffusers pipeline, got Linear.*ModularPipeline"):
        omni_accel.accelerate(torch.nn.Linear(2, 2))
    assert (
        AccelConfig(attention={"per_role": {"flux.single": "sdpa"}}).attention.per_role["flux.single"]
        == "sdpa"
    )


def test_describe_before_any_call_says_so_instead_of_zero_counters():
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    text = str(omni_accel.describe(pipe))
    assert "exact projection cache: on (268435456 bytes), not consulted yet" in text
    assert "0 hits" not in text and "not accelerated: IP-adapter" not in text
