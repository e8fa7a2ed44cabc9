"""Pipelines without a native transformer: Diffusers' modules kept, attention routed through providers."""

import omni_accel.patches as patches
import pytest
import torch
from conftest import rel_err

import omni_accel
from omni_accel.attention.base import AttentionProvider, Capabilities

# Wan and Qwen-Image have native blocks; routed with native=False (what a model without them gets).
CASES = {
    "wan": (omni_accel.tiny_wan_pipeline, dict(height=32, width=32, num_frames=5), {"wan.self", "wan.cross"}),
    "sd3": (omni_accel.tiny_sd3_pipeline, dict(height=32, width=32), {"sd3.joint"}),
    "qwenimage": (omni_accel.tiny_qwenimage_pipeline, dict(height=32, width=32), {"qwenimage.joint"}),
}


def _latents(pipe, call):
    return pipe(
        prompt="a cat",
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **call,
    )


def _out(result):
    return result.frames if hasattr(result, "frames") else result.images


@pytest.mark.parametrize("family", sorted(CASES))
def test_routed_pipeline_matches_and_restores(family):
    build, call, roles = CASES[family]
    pipe = build(seed=0)
    module = type(pipe.transformer)
    expected = _out(_latents(pipe, call))
    applied_before = patches.applied()  # other tests' pipelines may still hold the same patch

    native = {"native": False} if family in ("wan", "qwenimage") else {}
    omni_accel.accelerate(pipe, attention={"default": "auto", "per_role": {"cross": "sdpa_math"}}, **native)
    assert type(pipe.transformer) is module  # not swapped
    got = _out(_latents(pipe, call))
    assert rel_err(got, expected) <= 1e-5

    report = omni_accel.describe(pipe)
    component = report.components[0]
    assert component.mode == "routed"
    seen = {role for role, *_ in component.selector.decisions()}
    assert seen == roles
    if family == "wan":
        providers = {role: provider for role, _, provider, _ in component.selector.decisions()}
        assert providers == {"wan.self": "sdpa", "wan.cross": "sdpa_math"}
    assert ("native acceleration disabled" if family in ("wan", "qwenimage") else "no native blocks") in str(
        report
    )
    assert patches.applied() != applied_before

    omni_accel.restore(pipe)
    assert patches.applied() == applied_before
    assert not pipe.transformer._forward_pre_hooks and not pipe.transformer._forward_hooks
    assert torch.equal(_out(_latents(pipe, call)), expected)


def test_routing_is_scoped_to_the_accelerated_pipeline():
    """A second, plain pipeline of the same class keeps Diffusers' kernel while the patch is applied."""
    build, call, _ = CASES["wan"]
    plain = build(seed=0)
    reference = _out(_latents(plain, call))
    fast = omni_accel.accelerate(build(seed=0), attention="sdpa_math")
    assert not torch.equal(_out(_latents(fast, call)), reference)  # the math kernel rounds differently
    assert torch.equal(_out(_latents(plain, call)), reference)
    omni_accel.restore(fast)


@pytest.mark.parametrize("backend", ["_native_math", "_native_cudnn"])
def test_a_processor_calling_torch_sdpa_ignores_diffusers_process_wide_backend(backend):
    """SD3's processors call torch's SDPA themselves, which Diffusers' process-wide backend never reaches:
    routed, they ignore it too (it changed the kernel, or raised where no provider of it runs: cuDNN on
    the CPU), for the ``attention_backend`` block and for another model's ``set_attention_backend``."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, attention_backend

    build, call, _ = CASES["sd3"]
    plain, fast = build(seed=0), omni_accel.accelerate(build(seed=0))
    expected = _out(_latents(plain, call))
    with attention_backend(backend):
        assert torch.equal(_out(_latents(plain, call)), expected)  # Diffusers' own code ignores it here
        assert torch.equal(_out(_latents(fast, call)), expected)
    before = _AttentionBackendRegistry._active_backend
    try:
        omni_accel.tiny_flux_pipeline(seed=1).transformer.set_attention_backend(backend)
        assert torch.equal(_out(_latents(fast, call)), expected)
    finally:
        _AttentionBackendRegistry._active_backend = before
    reasons = {reason for *_, reason in omni_accel.describe(fast).components[0].selector.decisions()}
    assert not any("process-wide" in reason for reason in reasons), reasons


def test_native_false_routes_flux_instead_of_swapping():
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), native=False)
    assert type(pipe.transformer).__name__ == "FluxTransformer2DModel"
    pipe("x", height=32, width=32, num_inference_steps=1, output_type="latent")
    component = omni_accel.describe(pipe).components[0]
    assert component.mode == "routed"
    assert {role for role, *_ in component.selector.decisions()} == {"flux.joint", "flux.single"}
    omni_accel.restore(pipe)


def test_calls_our_providers_do_not_model_are_left_to_diffusers_and_counted():
    import diffusers.models.transformers.transformer_wan as wan

    from omni_accel.attention import routing
    from omni_accel.attention.selection import AttentionSelector

    original = wan.dispatch_attention_fn  # may already be patched by another test's pipeline: refcounted
    q = torch.randn(1, 5, 2, 8, generator=torch.Generator().manual_seed(0))
    expected = original(q, q, q, is_causal=True)  # outside any accelerated forward: Diffusers' kernel
    patches.apply("dispatch_attention", wan.__name__)
    selector = AttentionSelector()
    tokens = routing.enter_selector(selector), routing.enter_role("wan.self", "self")
    try:
        assert torch.equal(wan.dispatch_attention_fn(q, q, q, is_causal=True), expected)
        assert selector.unrouted == {("wan.self", "causal attention"): 1}
        assert not selector.decisions()
        wan.dispatch_attention_fn(q, q, q)
        assert [row[2] for row in selector.decisions()] == ["sdpa"]
    finally:
        routing.leave_role(tokens[1])
        routing.leave_selector(tokens[0])
        patches.revert("dispatch_attention", wan.__name__)
    assert wan.dispatch_attention_fn is original


@torch.library.custom_op("omni_accel_tests::attention_without_backward", mutates_args=())
def _attention_without_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    bhsd = (t.transpose(1, 2) for t in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(*bhsd).transpose(1, 2).contiguous()


class WithoutBackward(AttentionProvider):
    """A provider whose kernel, like FlashInfer's and SageAttention's custom ops, has no backward."""

    name = "without_backward"
    capabilities = Capabilities(dtypes=frozenset({torch.float32}), devices=frozenset({"cpu"}))

    def forward(self, query, key, value, *, attn_mask=None, scale=None, return_lse=False):
        return _attention_without_backward(query, key, value)


def test_gradients_through_routed_attention_run_diffusers_kernel(monkeypatch):
    """A training step of a routed model computes Diffusers' gradients whatever provider serves its
    inference calls (one without a backward made ``backward()`` raise); calls without autograd stay ours."""
    from conftest import flux_inputs, random_flux_transformer
    from native_contract import _Holder

    from omni_accel.attention import registry

    monkeypatch.setitem(registry._TARGETS, "without_backward", f"{__name__}:WithoutBackward")
    plain, routed = random_flux_transformer(), random_flux_transformer()
    holder = omni_accel.accelerate(_Holder(routed), native=False, attention="without_backward")
    inputs = flux_inputs(plain)
    for model in (plain, routed):
        model(**inputs).sample.square().mean().backward()
    for name, param in plain.named_parameters():
        assert rel_err(routed.get_parameter(name).grad, param.grad) <= 1e-5, name
    selector = omni_accel.describe(holder).components[0].selector
    assert {reason for _, reason in selector.unrouted} == {
        "gradients flow through it (training or input gradients)"
    }
    with torch.no_grad():
        assert rel_err(routed(**inputs).sample, plain(**inputs).sample) <= 1e-5
    assert {row[2] for row in selector.decisions()} == {"without_backward"}
    assert sum(selector.unrouted.values()) == 5  # the blocks of the training step only
    omni_accel.restore(holder)


def test_restore_leaves_a_users_patch_made_after_accelerate():
    """A user who patches ``dispatch_attention_fn`` or an attention class's ``forward`` after ``accelerate``
    keeps the patch through ``restore`` (ours, inside it, then passes every call through)."""
    import diffusers.models.transformers.transformer_flux as transformer_flux
    from diffusers.models.transformers.transformer_flux import FluxAttention

    originals = (transformer_flux.dispatch_attention_fn, FluxAttention.__dict__["forward"])
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), native=False)
    ours = (transformer_flux.dispatch_attention_fn, FluxAttention.forward)
    calls = []

    def dispatch(*args, **kwargs):
        calls.append("dispatch")
        return ours[0](*args, **kwargs) * 1.01

    def forward(self, *args, **kwargs):
        calls.append("forward")
        return ours[1](self, *args, **kwargs)

    try:
        transformer_flux.dispatch_attention_fn, FluxAttention.forward = dispatch, forward
        omni_accel.restore(pipe)
        assert transformer_flux.dispatch_attention_fn is dispatch and FluxAttention.forward is forward
        plain = omni_accel.tiny_flux_pipeline(seed=0)

        def call():
            generator = torch.Generator().manual_seed(0)
            return plain(
                "a cat", num_inference_steps=1, height=32, width=32, output_type="latent", generator=generator
            )

        patched = call().images
        assert {"dispatch", "forward"} <= set(calls)
        transformer_flux.dispatch_attention_fn, FluxAttention.forward = originals
        assert not torch.equal(patched, call().images)
    finally:
        transformer_flux.dispatch_attention_fn, FluxAttention.forward = originals


def test_copies_of_a_routed_pipeline_hold_their_own_routes_and_patches():
    """A deep copy and an unpickled copy route their own modules and hold their own reference to each patch:
    restoring a copy leaves the original routed, and every pipeline restores once each."""
    import copy
    import pickle

    from omni_accel.patches import attention_roles

    build, call, _ = CASES["sd3"]
    expected = _out(_latents(build(seed=0), call))
    applied_before = patches.applied()
    pipe = omni_accel.accelerate(build(seed=0))

    def routed(p):
        return [attention_roles.ROUTE in vars(m) for m in p.transformer.modules() if hasattr(m, "processor")]

    # Pickled first: once run, transformers' output-capturing hooks (local functions) make a text encoder
    # unpicklable, with or without omni_accel.
    for make_copy in (lambda p: pickle.loads(pickle.dumps(p)), copy.deepcopy):
        twin = make_copy(pipe)
        assert torch.equal(_out(_latents(twin, call)), expected)
        omni_accel.restore(twin)
        assert not any(routed(twin)) and all(routed(pipe))
        assert torch.equal(_out(_latents(pipe, call)), expected)
    omni_accel.restore(pipe)
    assert patches.applied() == applied_before


@pytest.mark.parametrize("graphs", [False, True], ids=["routed", "step-graphs"])
def test_a_from_pipe_sibling_shares_a_routed_transformer_set_up_once(graphs):
    """The sibling set the module up a second time: a second selector scope (the two scopes left in the
    order they were entered, so the first pipeline's selector stayed active after each call), step graphs
    over the first ones, options of its own silently overriding the owner's, and a report of routes its
    owner's restore had removed. It shares the owner's setup now, as a native one does."""
    from diffusers import StableDiffusion3Img2ImgPipeline
    from omni_accel.patches import attention_roles

    from omni_accel.attention import routing
    from omni_accel.cuda_graphs import StepGraphs

    build, call, _ = CASES["sd3"]
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    sibling_call = dict(call, image=image, strength=0.9)
    plain = build(seed=0)
    expected = _out(_latents(plain, call))
    expected_sibling = _out(_latents(StableDiffusion3Img2ImgPipeline.from_pipe(plain), sibling_call))
    options = {"cuda_graphs": True} if graphs else {}
    owner = omni_accel.accelerate(build(seed=0), **options)
    module = owner.transformer
    hooks = (dict(module._forward_pre_hooks), dict(module._forward_hooks), module.__dict__.get("forward"))
    sibling = StableDiffusion3Img2ImgPipeline.from_pipe(owner)
    with pytest.raises(ValueError, match=r"shared with another pipeline \(from_pipe\)"):
        omni_accel.accelerate(sibling, attention="sdpa_math", **options)
    omni_accel.accelerate(sibling, **options)
    assert (
        dict(module._forward_pre_hooks),
        dict(module._forward_hooks),
        module.__dict__.get("forward"),
    ) == hooks
    if graphs:
        assert isinstance(module.forward, StepGraphs) and module.forward.inner is None
    component = omni_accel.describe(sibling).components[0]
    tier = "generic" if graphs else "routed"
    assert component.mode == f"{tier} (shared)" and f"as that pipeline set it up ({tier})" in component.detail
    assert torch.equal(_out(_latents(owner, call)), expected)
    assert routing._ACTIVE.get() is None  # no selector left active outside the transformer's call
    assert rel_err(_out(_latents(sibling, sibling_call)), expected_sibling) <= 1e-6
    assert {role for role, *_ in component.selector.decisions()} == {"sd3.joint"}

    omni_accel.restore(owner)
    component = omni_accel.describe(sibling).components[0]
    assert component.mode == "untouched" and "has since restored it" in component.detail
    omni_accel.accelerate(sibling, **options)  # it holds nothing any more: it sets the module up itself
    assert omni_accel.describe(sibling).components[0].mode == tier
    assert rel_err(_out(_latents(sibling, sibling_call)), expected_sibling) <= 1e-6
    omni_accel.restore(sibling)
    assert not module._forward_pre_hooks and not module._forward_hooks
    assert not any(k.startswith("_omni_accel") or k == "forward" for k in vars(module))
    assert not any(attention_roles.ROUTE in vars(m) for m in module.modules())
