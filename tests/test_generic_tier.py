"""The generic tier (models without native blocks): repeated blocks compiled regionally with our attention
op inside the graph, in the background or at the first call, beside everything a Diffusers user does with
the model (LoRA, step caches, gradients, deepcopy, a compile of another model of the same class), and
``restore`` leaving nothing behind. On CPU with a CPU-cheap backend; the GPU side is
tests/test_gpu_generic.py."""

import copy
import threading

import omni_accel.patches as patches
import pytest
import torch
from conftest import first_counts_meet, random_lora, rel_err
from diffusers import ConfigMixin, ModelMixin
from tiny_transformers import Holder

import omni_accel
from omni_accel.attention.routing import diffusers_attention


def _generic(pipe, **options):
    """``accelerate`` in the generic tier: Qwen-Image (and FLUX.1, Wan) have native blocks, and these tests
    take them as models without."""
    return omni_accel.accelerate(pipe, **{"native": False, **options})


# (pipeline, block class, graphs: one per distinct block; SD3's last block is context_pre_only)
CASES = {
    "qwenimage": (omni_accel.tiny_qwenimage_pipeline, "QwenImageTransformerBlock", 1),
    "sd3": (omni_accel.tiny_sd3_pipeline, "JointTransformerBlock", 2),  # the classic processors' F.sdpa site
}
CALL = dict(prompt="a cat", height=32, width=32, num_inference_steps=3, output_type="latent")
OP = "omni_accel.diffusers_attention"


def _latents(pipe, **call):
    return pipe(**{**CALL, **call}, generator=torch.Generator().manual_seed(0)).images


def _compiled_qwenimage():
    """A tiny Qwen-Image pipeline with its blocks compiled at the first call (Dynamo's eager backend)."""
    return _generic(
        omni_accel.tiny_qwenimage_pipeline(seed=0), compile={"backend": "eager"}, compile_in_background=False
    )


class _Graphs:
    """A torch.compile backend that runs each graph as traced and records the ops each one calls."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def ops(self, name: str) -> list[int]:
        return [sum(name in target for target in graph) for graph in self.graphs]


@pytest.mark.parametrize("family", sorted(CASES))
def test_compiled_blocks_attend_through_our_op_in_one_graph_per_class(family):
    build, block, graphs = CASES[family]
    torch._dynamo.reset()
    expected = _latents(build(seed=0))
    backend = _Graphs()
    pipe = _generic(build(seed=0), compile={"backend": backend}, compile_in_background=False)
    got = _latents(pipe)
    assert rel_err(got, expected) <= 1e-6
    # Blocks alike share one graph (fullgraph: no break), and its attention is our op, not Diffusers' kernel.
    assert len(backend.graphs) == graphs and backend.ops(OP) == [1] * graphs
    assert backend.ops("scaled_dot_product_attention") == [0] * graphs
    report = omni_accel.describe(pipe)
    component = report.components[0]
    assert component.mode == "generic"
    assert f"2 repeated blocks ({block}) compiled" in component.detail
    assert {row[2] for row in component.selector.decisions()} == {"sdpa"}  # the op resolved at run time
    assert f"{block}.forward: compiled at its first call per input shape" in str(report)
    assert not component.runtime.fallbacks


def test_the_op_follows_the_scope_at_run_time():
    torch._dynamo.reset()
    pipe = _compiled_qwenimage()
    _latents(pipe)
    with omni_accel.attention_scope(default="sdpa_math"):
        _latents(pipe)
    decisions = omni_accel.describe(pipe).components[0].selector.decisions()
    assert {row[2] for row in decisions} == {"sdpa", "sdpa_math"}


def test_background_compile_serves_eagerly_then_switches_in():
    torch._dynamo.reset()
    expected = _latents(omni_accel.tiny_qwenimage_pipeline(seed=0))
    pipe = _generic(
        omni_accel.tiny_qwenimage_pipeline(seed=0), compile={"backend": "eager"}, compile_in_background=True
    )
    runtime = omni_accel.describe(pipe).components[0].runtime
    first = _latents(pipe)  # eager steps queue the compile; the next step boundary starts it
    runtime.compiler.wait(120)
    second = _latents(pipe)
    for got in (first, second):
        assert rel_err(got, expected) <= 1e-6
    ((eager, compiled),) = runtime.compiler.calls().values()
    assert eager >= 2 and compiled >= 2  # two blocks per step: the first steps eager, the last ones compiled
    assert "compiled in the background" in omni_accel.describe(pipe).components[0].detail


def test_blocks_of_one_class_that_compile_apart_all_compile_in_the_background():
    """SD3's last block (``context_pre_only``: other submodules) compiles a graph of its own. Its calls
    looked like the other blocks' (one module type), so the worker compiled one graph and the first
    compiled step compiled the other in the call, the wait the background compile is there to spare."""
    torch._dynamo.reset()
    compiled_in = []

    def backend(gm, example_inputs):
        compiled_in.append(threading.current_thread().name)
        return gm.forward

    pipe = omni_accel.accelerate(
        omni_accel.tiny_sd3_pipeline(seed=0), compile={"backend": backend}, compile_in_background=True
    )
    _latents(pipe)
    compiler = omni_accel.describe(pipe).components[0].runtime.compiler
    compiler.wait(120)
    _latents(pipe)
    assert compiler.calls()["JointTransformerBlock.forward"][1] > 0  # the second image ran compiled code
    assert compiled_in == ["omni_accel-compile-JointTransformerBlock.forward"] * 2, compiled_in


def test_a_plain_model_of_the_same_class_compiled_elsewhere_keeps_diffusers_attention():
    """A user's fullgraph compile of another Diffusers model of the same class, in the same process as an
    accelerated one: Diffusers' attention in its graph, never our op or our compiled code."""
    torch._dynamo.reset()
    pipe = _compiled_qwenimage()
    _latents(pipe)
    other = omni_accel.tiny_qwenimage_pipeline(seed=1)
    expected = _latents(other)
    backend = _Graphs()
    other.transformer.compile_repeated_blocks(fullgraph=True, backend=backend)
    got = _latents(other)
    assert torch.equal(got, expected)
    assert backend.graphs and backend.ops(OP) == [0] * len(backend.graphs)
    assert all(n > 0 for n in backend.ops("scaled_dot_product_attention"))
    assert _latents(pipe).shape == got.shape  # ours keeps running its own code


def test_a_users_compile_of_the_accelerated_model_routes_through_the_op():
    torch._dynamo.reset()
    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(seed=0), compile=False)
    expected = _latents(pipe)
    backend = _Graphs()
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=backend)
    assert rel_err(_latents(pipe), expected) <= 1e-6
    assert backend.ops(OP) == [1]


def test_the_generic_tier_compiles_at_the_first_call_unless_asked():
    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(seed=0), compile={"backend": "eager"})
    assert "compiled at the first call per input shape" in omni_accel.describe(pipe).components[0].detail
    assert not omni_accel.describe(pipe).components[0].runtime.compiler.background


def test_compile_false_and_no_cuda_leave_the_blocks_eager():
    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(seed=0))  # compile=None: CUDA only
    component = omni_accel.describe(pipe).components[0]
    assert component.mode == "routed" and component.runtime is None
    assert "no CUDA device here; compile=True compiles on CPU" in str(omni_accel.describe(pipe))
    assert all("forward" not in b.__dict__ for b in pipe.transformer.transformer_blocks)
    omni_accel.restore(pipe)
    pipe = _generic(pipe, compile=False)
    assert "repeated blocks: not compiled (compile=False)" in str(omni_accel.describe(pipe))


def test_restore_leaves_no_patch_attribute_or_forward():
    from diffusers.models.attention_processor import Attention

    target = ("attention_roles", "diffusers.models.attention_processor:Attention")
    before = patches.applied()  # other tests' pipelines may still hold the same patch
    forward_before = Attention.forward
    pipe = omni_accel.tiny_qwenimage_pipeline(seed=0)
    _generic(pipe, compile={"backend": "eager"}, compile_in_background=False)
    _latents(pipe)
    assert patches.applied()[target] == before.get(target, 0) + 1
    omni_accel.restore(pipe)
    assert patches.applied() == before and Attention.forward is forward_before
    if target not in before:
        assert "_omni_accel_original_forward" not in vars(Attention) and "forward" in vars(Attention)
    for module in pipe.transformer.modules():
        assert not any(name.startswith(("_omni", "omni_")) for name in vars(module))
        assert "forward" not in module.__dict__
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_gradients_run_diffusers_forward_and_equal_plain():
    torch._dynamo.reset()
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0).transformer
    pipe = _compiled_qwenimage()
    model = pipe.transformer
    g = torch.Generator().manual_seed(3)
    x = dict(
        hidden_states=torch.randn(1, 16, model.config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 7, model.config.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=torch.ones(1, 7, dtype=torch.long),
        timestep=torch.tensor([0.5]),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )
    for m in (plain, model):
        m(**x)[0].square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
    assert "gradients enabled for parameters that require them" in str(omni_accel.describe(pipe))


def test_lora_and_a_step_cache_behave_as_in_plain_diffusers():
    from diffusers.hooks import FirstBlockCacheConfig

    torch._dynamo.reset()
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    pipe = _compiled_qwenimage()
    _latents(pipe)
    lora = random_lora(plain.transformer, ["to_q", "to_k", "to_v", "to_out.0"], seed=5)
    for p in (plain, pipe):
        p.load_lora_weights(copy.deepcopy(lora), adapter_name="style")
    assert rel_err(_latents(pipe), _latents(plain)) <= 1e-5
    for p in (plain, pipe):
        p.set_adapters("style", 0.5)
    assert rel_err(_latents(pipe), _latents(plain)) <= 1e-5
    for p in (plain, pipe):
        p.unload_lora_weights()
        p.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    assert rel_err(_latents(pipe), _latents(plain)) <= 1e-5
    for p in (plain, pipe):
        p.transformer.disable_cache()
    assert rel_err(_latents(pipe), _latents(plain)) <= 1e-5


def test_deepcopy_of_an_accelerated_pipeline_runs_its_own_compiled_blocks():
    torch._dynamo.reset()
    pipe = _compiled_qwenimage()
    expected = _latents(pipe)
    twin = copy.deepcopy(pipe)
    assert rel_err(_latents(twin), expected) <= 1e-6
    twin_runtime = twin.transformer.transformer_blocks[0].forward.runtime
    assert twin_runtime is not pipe.transformer.transformer_blocks[0].forward.runtime
    assert twin.transformer.transformer_blocks[0].forward.block is twin.transformer.transformer_blocks[0]
    omni_accel.restore(pipe)
    assert rel_err(_latents(twin), expected) <= 1e-6  # the copy is still accelerated


class _NoBlocksTransformer(ModelMixin, ConfigMixin):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states):
        return self.proj(hidden_states)


def test_compile_true_needs_repeated_blocks():
    with pytest.raises(ValueError, match="declares none"):
        _generic(Holder(_NoBlocksTransformer()), compile=True)
    report = omni_accel.describe(_generic(Holder(_NoBlocksTransformer())))
    assert report.components[0].mode == "untouched"


def test_the_op_passes_opcheck():
    """Inside an accelerated forward (a selector active) and outside one (the call site's own function)."""
    from omni_accel.attention import routing
    from omni_accel.attention.selection import default_selector

    routing.register_call_site("test.site", lambda q, k, v, attn_mask, scale: q * 2, lambda: True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 5, dtype=torch.bool)
    try:
        for active in (True, False):
            token = routing.enter_selector(default_selector()) if active else None
            try:
                for attn_mask in (None, mask):
                    args = (q, k, v, attn_mask, "r", "self", None, "test.site")
                    torch.library.opcheck(diffusers_attention, args)
            finally:
                if token is not None:
                    routing.leave_selector(token)
    finally:
        routing.unregister_call_site("test.site")


def test_from_pipe_shares_the_compiled_transformer_and_pickles():
    import pickle

    from diffusers import QwenImageImg2ImgPipeline

    torch._dynamo.reset()
    pipe = _compiled_qwenimage()
    expected = _latents(pipe)
    sibling = QwenImageImg2ImgPipeline.from_pipe(pipe)
    _generic(sibling, compile={"backend": "eager"}, compile_in_background=False)
    assert omni_accel.describe(sibling).components[0].mode == "generic (shared)"
    assert all(type(b.forward).__name__ == "RegionForward" for b in pipe.transformer.transformer_blocks)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    sibling(image=image, strength=0.9, **CALL, generator=torch.Generator().manual_seed(0))
    assert rel_err(_latents(pipe), expected) <= 1e-6
    restored = pickle.loads(pickle.dumps(pipe.transformer))
    assert type(restored.transformer_blocks[0].forward).__name__ == "RegionForward"
    assert restored.transformer_blocks[0].forward.block is restored.transformer_blocks[0]
    omni_accel.restore(pipe)
    assert all("forward" not in vars(b) for b in pipe.transformer.transformer_blocks)


def test_our_scope_is_not_a_hook_to_the_graphs_and_a_users_is():
    """CUDA graphs and the compiled blocks skip modules whose hooks may decide per call; the selector
    scope accelerate puts on the transformer decides nothing, so it must not count (the key is read on CPU
    too: the rule is the same)."""
    from omni_accel.patches import scoped_calls

    from omni_accel.cuda_graphs import _module_state
    from omni_accel.forward_hooks import is_hooked

    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(seed=0))
    transformer = pipe.transformer
    assert vars(transformer)[scoped_calls.SCOPES] and not is_hooked(transformer)
    assert _module_state(transformer) is not None
    handle = transformer.register_forward_pre_hook(lambda module, args: None)
    assert is_hooked(transformer) and _module_state(transformer) is None
    handle.remove()


def test_a_call_our_providers_cannot_split_is_not_compiled_while_a_model_is_split(monkeypatch):
    """Compiled code of a block class serves every model of that class: while any model of the process is
    split over ranks, a call our providers do not model must not compile as Diffusers' attention over one
    rank's tokens. How many split models live is read through Dynamo's guards, so the code compiled before
    a split is compiled again, and that trace refuses the call."""
    from omni_accel.attention.routing import traced_unsupported
    from omni_accel.parallel import routed_attention

    def block(x: torch.Tensor) -> torch.Tensor:
        traced_unsupported("causal attention")
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    monkeypatch.setattr(routed_attention, "LIVE_SPLITS", 1)
    with pytest.raises(
        Exception, match="causal attention cannot run split over the ranks through our providers"
    ):
        compiled(torch.ones(3))
    monkeypatch.setattr(routed_attention, "LIVE_SPLITS", 0)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))


def test_a_compiled_call_gradients_flow_through_while_a_model_is_split_is_plain_diffusers(monkeypatch):
    """While a model of the process is split, a compiled call a gradient flows through traces Diffusers'
    function behind a check that refuses it under a split forward only: a model that is not split computes
    plain Diffusers' outputs and gradients through it."""
    from tiny_transformers import build

    from omni_accel.parallel import routed_attention

    model, inputs = build("FluxTransformer2DModel")
    plain = copy.deepcopy(model)
    omni_accel.accelerate(Holder(model), native=False)
    monkeypatch.setattr(routed_attention, "LIVE_SPLITS", 1)
    torch._dynamo.reset()
    got = torch.compile(model, backend="eager")(**inputs, return_dict=False)[0]
    want = plain(**inputs, return_dict=False)[0]
    assert torch.equal(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    grads = dict(model.named_parameters())
    assert all(torch.equal(grads[name].grad, p.grad) for name, p in plain.named_parameters())


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("HunyuanVideo15Transformer3DModel", {}),  # its key mask is made per forward: an inference tensor
        ("WanTransformer3DModel", {"native": False}),  # the projection cache's outputs: inference tensors
    ],
)
def test_forwards_under_inference_mode_with_inputs_made_outside_it(family, options):
    from tiny_transformers import build

    model, inputs = build(family)
    plain = copy.deepcopy(model)
    with torch.inference_mode():
        want = plain(**inputs, return_dict=False)[0]
    omni_accel.accelerate(Holder(model), **options)
    for _ in range(2):  # the second: what the first stored (nothing made in inference mode) is reused
        with torch.inference_mode():
            got = model(**inputs, return_dict=False)[0]
        assert rel_err(got, want) <= 1e-6
    with torch.no_grad():  # and a call outside inference mode after them
        assert rel_err(model(**inputs, return_dict=False)[0], want) <= 1e-6


def test_a_backend_set_on_processors_of_compiled_blocks_is_described():
    """``set_attention_backend`` after ``accelerate``: those calls run Diffusers' function, counted by the
    eager path; compiled blocks trace that function in, where nothing counts, so ``describe`` names them
    from the processors (and still equals plain Diffusers doing the same)."""
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    pipe = _compiled_qwenimage()
    _latents(pipe, num_inference_steps=1)
    for p in (plain, pipe):
        p.transformer.set_attention_backend("_native_math")
    assert torch.equal(_latents(pipe), _latents(plain))
    text = str(omni_accel.describe(pipe))
    assert "attention left to Diffusers: qwenimage." in text, text
    assert (
        "Diffusers backend _native_math set on the processor (2 attention modules; their calls inside" in text
    )
    pipe.transformer.reset_attention_backend()
    assert "attention left to Diffusers" not in str(omni_accel.describe(pipe))


def test_two_threads_counting_a_new_reason_count_twice_and_log_it_once(monkeypatch):
    """Blocks that run their own forward, counted by reason from two threads at once (a pipeline called
    from several): neither count is lost, and the reason is logged once."""
    from omni_accel.models import generic
    from omni_accel.models.generic import GenericRuntime

    runtime = GenericRuntime(None, None)
    logged = []
    monkeypatch.setattr(generic.logger, "info", lambda *args: logged.append(args))
    first_counts_meet(monkeypatch, runtime.fallbacks)
    threads = [threading.Thread(target=runtime.note_eager, args=("a hook",)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runtime.fallbacks == {"a hook": 2}
    assert len(logged) == 1
