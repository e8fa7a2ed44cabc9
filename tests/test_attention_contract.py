"""The attention contract with Diffusers: routed calls compute what Diffusers' dispatch computes for every
mask it accepts, a backend chosen process-wide in Diffusers wins or is refused, our patches are invisible to
Dynamo outside our scope, and a kernel that refuses a call's tensors is never called (fp32, CPU)."""

import copy

import diffusers.models.attention_dispatch as dispatch
import diffusers.models.attention_processor as attention_processor
import diffusers.models.transformers.transformer_flux as transformer_flux
import diffusers.models.transformers.transformer_qwenimage as transformer_qwenimage
import omni_accel.patches as patches
import pytest
import torch
import torch.nn.functional as F
from conftest import flux_inputs, random_flux_transformer, random_qwenimage_transformer, randomized, rel_err
from diffusers import SD3Transformer2DModel
from native_contract import _Holder

import omni_accel
from omni_accel.attention import AttentionProviderError, attention_scope, diffusers_backend, routing
from omni_accel.attention.base import AttentionRequest, KernelRefusal
from omni_accel.attention.registry import get_provider
from omni_accel.attention.selection import AttentionConfig, AttentionSelector, resolve

REGISTRY = dispatch._AttentionBackendRegistry
DIFFUSERS_DISPATCH = dispatch.dispatch_attention_fn  # the function itself, never patched
CPU_FP32 = AttentionRequest(torch.float32, "cpu", 16)
MATH_REASON = "Diffusers attention backend '_native_math' (process-wide)"


@pytest.fixture(autouse=True)
def diffusers_global_restored():
    """Every test starts from Diffusers' default backend, whatever DIFFUSERS_ATTN_BACKEND says, and leaves
    the process-wide one as it found it (``set_attention_backend`` sets it and ``reset_attention_backend``
    does not undo that)."""
    active = REGISTRY._active_backend
    REGISTRY._active_backend = dispatch.AttentionBackendName.NATIVE
    yield
    REGISTRY._active_backend = active


def _bshd(batch, seq_q, seq_kv, heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, head_dim, generator=g)
    k, v = (torch.randn(batch, seq_kv, heads, head_dim, generator=g) for _ in range(2))
    return q, k, v


def _padding(batch, seq_q, seq_kv, heads=2):
    """Every mask shape Diffusers' dispatch accepts (``_check_shape``: the last dimension is the keys),
    with keys masked in the second sample; the values say which shape and kind each is."""
    rows = torch.ones(batch, seq_kv, dtype=torch.bool)
    rows[-1, seq_kv // 2 :] = False
    per_query = torch.rand(batch, heads, seq_q, seq_kv, generator=torch.Generator().manual_seed(3)) > 0.3
    per_query[..., 0] = True  # every query keeps a key

    def additive(mask):
        return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))

    return {
        "2d-rows-bool": rows,
        "2d-rows-float": additive(rows),
        "2d-query-bool": per_query[0, 0],  # [seq_q, kv]: SDPA's own 2-D meaning
        "3d-bool": per_query[:, 0],  # [B, seq_q, kv], handed to SDPA as is
        "3d-float": additive(per_query[:, 0]),
        "4d-keys-bool": rows[:, None, None, :],
        "4d-keys-float": additive(rows[:, None, None, :]),
        "4d-bool": per_query,
        "4d-float": additive(per_query),
    }


class _Routed:
    """A patched Diffusers transformer module with a selector active, as inside an accelerated forward."""

    def __init__(self, module, role="test.joint"):
        self.module, self.selector, self.role = module, AttentionSelector(), role

    def __enter__(self):
        patches.apply("dispatch_attention", self.module.__name__)
        self.tokens = routing.enter_selector(self.selector), routing.enter_role(self.role, "self")
        return self

    def __exit__(self, *exc):
        routing.leave_role(self.tokens[1])
        routing.leave_selector(self.tokens[0])
        patches.revert("dispatch_attention", self.module.__name__)

    def __call__(self, *args, **kwargs):
        return self.module.dispatch_attention_fn(*args, **kwargs)


# (5) masks: what Diffusers' native backend computes, for every shape it accepts.


@pytest.mark.parametrize("seq_q", [7, 2])  # 7 queries crashed, 2 gave a relative error of 0.12
@pytest.mark.parametrize("kind", list(_padding(2, 7, 7)))
def test_routed_masks_compute_what_diffusers_native_backend_computes(kind, seq_q):
    q, k, v = _bshd(2, seq_q, 9)
    mask = _padding(2, seq_q, 9)[kind]
    expected = DIFFUSERS_DISPATCH(q, k, v, attn_mask=mask)
    with _Routed(transformer_flux) as routed:
        # The same tensor three times, as a model passing one mask to every block: from the second call on
        # a key-padding mask's padded keys are dropped (key_padding), the first runs the dense mask.
        outputs = [routed(q, k, v, attn_mask=mask) for _ in range(3)]
    for got in outputs:
        assert rel_err(got, expected) <= 1e-6
    assert not routed.selector.unrouted and routed.selector.decisions()  # ours served every call
    # Diffusers reads a [seq_q, kv] mask as key rows too when seq_q is the batch size.
    keys_only = kind in ("2d-rows-bool", "4d-keys-bool") or (kind == "2d-query-bool" and seq_q == 2)
    assert routed.selector.served_without_mask == ({"test.joint": 2} if keys_only else {})


def test_under_a_pinned_diffusers_backend_masks_go_to_sdpa_as_diffusers_hands_them():
    """``_native_math`` (like the other ``_native_*`` backends) passes a 2-D mask to SDPA unchanged, where
    it means ``[seq_q, kv]``: the routed call does the same, even where that differs from ``native``."""
    q, k, v = _bshd(2, 2, 9)
    rows = _padding(2, 2, 9)["2d-rows-float"]
    with dispatch.attention_backend("_native_math"):
        expected = DIFFUSERS_DISPATCH(q, k, v, attn_mask=rows)
        with _Routed(transformer_flux) as routed:
            got = routed(q, k, v, attn_mask=rows)
    assert torch.equal(got, expected)
    assert rel_err(got, DIFFUSERS_DISPATCH(q, k, v, attn_mask=rows)) > 1e-3  # not what "native" computes


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_routed_flux_with_a_2d_key_mask_matches_diffusers(mask_kind):
    """A real routed transformer: FLUX with ``native=False`` and a ``[batch, text + image]`` mask through
    ``joint_attention_kwargs``, which Diffusers' processor passes to ``dispatch_attention_fn`` as is."""
    plain = random_flux_transformer(seed=0)
    routed = copy.deepcopy(plain)
    inputs = flux_inputs(plain, batch=2, image_tokens=12, text_tokens=5)
    keys = torch.ones(2, 17, dtype=torch.bool)
    keys[1, 3:5] = False  # the second prompt's padded text tokens
    mask = keys if mask_kind == "bool" else torch.zeros(2, 17).masked_fill(~keys, float("-inf"))
    with torch.no_grad():
        expected = plain(**inputs, joint_attention_kwargs={"attention_mask": mask}).sample
        holder = omni_accel.accelerate(_Holder(routed), native=False)
        got = routed(**inputs, joint_attention_kwargs={"attention_mask": mask}).sample
    component = omni_accel.describe(holder).components[0]
    omni_accel.restore(holder)
    assert component.mode == "routed"
    assert rel_err(got, expected) <= 1e-5
    assert {role for role, *_ in component.selector.decisions()} == {"flux.joint", "flux.single"}
    assert not component.selector.unrouted


# (6) Diffusers' process-wide backend: honoured with the same kernel, or Diffusers' code runs it.


def test_explicit_choice_reads_every_way_diffusers_sets_its_global():
    assert diffusers_backend.explicit_choice() is None  # the registry's default, "native"
    with dispatch.attention_backend("_native_math"):
        assert diffusers_backend.explicit_choice() == "_native_math"
    assert diffusers_backend.explicit_choice() is None
    # DIFFUSERS_ATTN_BACKEND is read into the same attribute at import.
    REGISTRY._active_backend = dispatch.AttentionBackendName("_native_efficient")
    assert diffusers_backend.explicit_choice() == "_native_efficient"
    REGISTRY._active_backend = dispatch.AttentionBackendName.NATIVE
    other = random_flux_transformer(seed=1)
    other.set_attention_backend("_native_math")  # on another model: the global follows
    other.reset_attention_backend()  # resets that model's processors, not the global
    assert diffusers_backend.explicit_choice() == "_native_math"


def test_each_mapped_backend_is_the_same_kernel():
    assert dict(diffusers_backend.PROVIDER_FOR) == {
        "native": "sdpa",
        "_native_cudnn": "sdpa_cudnn",
        "_native_flash": "sdpa_flash",
        "_native_efficient": "sdpa_efficient",
        "_native_math": "sdpa_math",
        "sage": "sage",
    }
    for backend in diffusers_backend.PROVIDER_FOR:
        assert dispatch.AttentionBackendName(backend) in REGISTRY._backends
    with dispatch.attention_backend("flex"):
        assert "'flex' (process-wide) has no omni_accel provider" in diffusers_backend.unserved_reason()
    with dispatch.attention_backend("_native_math"):
        assert diffusers_backend.unserved_reason() is None


def test_precedence_scope_then_pipeline_choice_then_diffusers_then_auto():
    selector = AttentionSelector(AttentionConfig(per_role={"pinned": "sdpa"}))
    assert selector.resolve("free", "self", CPU_FP32).name == "sdpa"  # auto
    with dispatch.attention_backend("_native_math"):
        found = selector.resolve("free", "self", CPU_FP32)  # the cache is keyed by Diffusers' choice too
        assert (found.name, found.reason) == ("sdpa_math", MATH_REASON)
        assert selector.resolve("pinned", "self", CPU_FP32).name == "sdpa"  # the pipeline's explicit choice
        with attention_scope(default="sdpa"):
            assert selector.resolve("free", "self", CPU_FP32).name == "sdpa"
        with attention_scope(per_role={"other": "sdpa"}):  # "auto" for this role: Diffusers' choice
            assert selector.resolve("free", "self", CPU_FP32).name == "sdpa_math"
        assert ("free", "float32, cpu, head_dim=16", "sdpa_math", MATH_REASON) in selector.decisions()
    assert selector.resolve("free", "self", CPU_FP32).name == "sdpa"


def test_a_mapped_backend_that_cannot_serve_the_call_is_refused_with_the_fix():
    masked = AttentionRequest(
        torch.float32, "cpu", 16, has_mask=True
    )  # Diffusers' _native_flash refuses it too
    with pytest.raises(AttentionProviderError) as error:
        resolve(AttentionConfig(), "flux.joint", "self", masked, "_native_flash")
    message = str(error.value)
    assert "Diffusers attention backend '_native_flash' (process-wide) runs provider 'sdpa_flash'" in message
    assert "cannot apply an attention mask" in message and "set_attention_backend('native')" in message
    assert "AttentionConfig or attention_scope" in message


def test_an_unmapped_backend_is_left_to_diffusers_or_refused_where_it_cannot_be():
    selector = AttentionSelector(AttentionConfig(per_role={"pinned": "sdpa"}))
    with dispatch.attention_backend("flex"):
        assert "'flex'" in selector.unserved_reason("free", "self")
        assert selector.unserved_reason("pinned", "self") is None  # omni_accel's explicit choice wins
        with pytest.raises(AttentionProviderError, match="'flex' .*own blocks here, which cannot run it"):
            selector.resolve("free", "self", CPU_FP32)


def _qwen(seed=0):
    return random_qwenimage_transformer(seed)


def _qwen_inputs(masked=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    text_mask = torch.ones(2, 5, dtype=torch.bool)
    text_mask[1, 3:] = False
    return dict(
        hidden_states=torch.randn(2, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        encoder_hidden_states_mask=text_mask if masked else None,
        timestep=torch.tensor([0.5, 0.5]),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )


def _accelerated(model, **config):
    holder = omni_accel.accelerate(_Holder(model), **config)
    return holder, omni_accel.describe(holder).components[0]


def test_native_flash_set_process_wide_on_the_cpu_runs_as_in_diffusers():
    """Diffusers' ``_native_flash`` runs PyTorch's CPU flash kernel on a CPU: an accelerated model serves it
    with the same kernel (it was refused as a CUDA-only provider, where plain Diffusers ran)."""
    plain = random_flux_transformer(seed=0)
    inputs = flux_inputs(plain)
    model = copy.deepcopy(plain)
    holder, component = _accelerated(model)
    with dispatch.attention_backend("_native_flash"), torch.no_grad():
        expected = plain(**copy.copy(inputs))[0]
        got = model(**copy.copy(inputs))[0]
    omni_accel.restore(holder)
    assert torch.equal(got, expected)
    assert {provider for _, _, provider, _ in component.selector.decisions()} == {"sdpa_flash"}


@pytest.mark.parametrize("family", ["qwenimage", "flux-native"])
def test_a_mapped_diffusers_backend_serves_every_role(family):
    """Under ``attention_backend("_native_math")`` every role, routed or native, runs sdpa_math (the same
    kernel), recorded as Diffusers' choice, and computes what plain Diffusers computes there."""
    if family == "qwenimage":
        plain, inputs, roles = _qwen(), _qwen_inputs(), {"qwenimage.joint"}
    else:
        plain = random_flux_transformer(seed=0)
        inputs, roles = flux_inputs(plain), {"flux.joint", "flux.single"}
    model = copy.deepcopy(plain)
    holder, component = _accelerated(model, **({"native": False} if family == "qwenimage" else {}))
    with dispatch.attention_backend("_native_math"), torch.no_grad():
        expected = plain(**copy.copy(inputs))[0]
        got = model(**copy.copy(inputs))[0]
    omni_accel.restore(holder)
    assert component.mode == ("routed" if family == "qwenimage" else "native")
    assert rel_err(got, expected) <= 1e-5
    decisions = component.selector.decisions()
    assert {role for role, *_ in decisions} == roles
    assert {(provider, reason) for _, _, provider, reason in decisions} == {("sdpa_math", MATH_REASON)}


@pytest.mark.parametrize("family", ["qwenimage", "flux-native"])
def test_an_unmapped_diffusers_backend_runs_diffusers_code(family, monkeypatch):
    """``flex`` has no provider of ours: every attention call of a routed model, and every native block
    (through Diffusers' forward of the block), runs Diffusers' own flex function; the report counts them."""
    flex = dispatch.AttentionBackendName.FLEX
    calls = []
    real = REGISTRY._backends[flex]
    monkeypatch.setitem(REGISTRY._backends, flex, lambda **kw: calls.append(1) or real(**kw))
    if family == "qwenimage":
        plain, inputs, roles = _qwen(), _qwen_inputs(masked=False), {"qwenimage.joint"}
    else:
        plain = random_flux_transformer(seed=0)
        inputs, roles = flux_inputs(plain), {"flux.joint", "flux.single"}
    model = copy.deepcopy(plain)
    holder, component = _accelerated(model, **({"native": False} if family == "qwenimage" else {}))
    with dispatch.attention_backend("flex"), torch.no_grad():
        expected = plain(**copy.copy(inputs))[0]
        runs_in_plain = len(calls)
        got = model(**copy.copy(inputs))[0]
    report = str(omni_accel.describe(holder))
    omni_accel.restore(holder)
    assert torch.equal(got, expected)
    assert runs_in_plain and len(calls) == 2 * runs_in_plain  # every attention call, in both models
    assert not component.selector.decisions()
    assert "'flex' (process-wide)" in report
    if family == "qwenimage":  # routed: each call left to Diffusers is counted per role
        assert {role for role, _ in component.selector.unrouted} == roles
        assert all("'flex' (process-wide)" in reason for _, reason in component.selector.unrouted)
    else:  # native: every block ran Diffusers' forward, counted with the reason
        assert f"run by Diffusers' forward: 5 ({diffusers_backend.no_provider('flex')}" in report


def test_a_pipelines_explicit_provider_outranks_an_unmapped_diffusers_backend():
    """The pipeline's own explicit choice is more specific than Diffusers' process-wide one: the native
    blocks keep running it under ``flex`` (and match plain Diffusers under flex, the same math in fp32)."""
    plain = random_flux_transformer(seed=0)
    model = copy.deepcopy(plain)
    holder, component = _accelerated(model, attention="sdpa_math")
    inputs = flux_inputs(plain)
    with dispatch.attention_backend("flex"), torch.no_grad():
        expected, got = plain(**copy.copy(inputs))[0], model(**copy.copy(inputs))[0]
    omni_accel.restore(holder)
    assert rel_err(got, expected) <= 1e-5
    assert not component.runtime.fallbacks
    assert {provider for _, _, provider, _ in component.selector.decisions()} == {"sdpa_math"}


# (8) The patches are invisible to Dynamo outside our scope.


def _sd3(seed=0):
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
    ).eval()
    return randomized(model)


def _sd3_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g),
        timestep=torch.tensor([500.0]),
        return_dict=False,
    )


def test_a_users_fullgraph_compile_of_another_model_works_while_a_pipeline_is_routed():
    """Two routed pipelines (Qwen-Image through ``dispatch_attention_fn``, SD3 through ``F``) accelerated;
    the user compiles other models of the same classes with ``fullgraph=True``: they trace Diffusers'
    functions, and match their eager outputs. ``restore`` then leaves the modules' originals."""
    applied = patches.applied()
    holders = [_accelerated(_qwen(), native=False)[0], _accelerated(_sd3())[0]]
    assert transformer_qwenimage.dispatch_attention_fn is not DIFFUSERS_DISPATCH
    assert attention_processor.F is not F
    torch._dynamo.reset()
    try:
        qwen, sd3 = _qwen(seed=2), _sd3(seed=2)
        with torch.no_grad():
            eager = qwen(**_qwen_inputs())[0], sd3(**_sd3_inputs())[0]
            qwen.compile_repeated_blocks(fullgraph=True, backend="eager")
            for block in sd3.transformer_blocks:  # SD3 declares no _repeated_blocks
                block.compile(fullgraph=True, backend="eager")
            compiled = qwen(**_qwen_inputs())[0], sd3(**_sd3_inputs())[0]
    finally:
        torch._dynamo.reset()
        for holder in holders:
            omni_accel.restore(holder)
    for got, expected in zip(compiled, eager, strict=True):
        assert rel_err(got, expected) <= 1e-6
    assert patches.applied() == applied
    if not applied:  # no other pipeline holds the patches: the originals are back
        assert transformer_qwenimage.dispatch_attention_fn is DIFFUSERS_DISPATCH
        assert attention_processor.F is F
        assert not hasattr(transformer_qwenimage, "_omni_accel_original_dispatch_attention_fn")


def test_diffusers_fullgraph_compile_of_the_routed_model_itself():
    """The message for ``compile=True`` on a routed model sends users to ``compile_repeated_blocks()``: on
    the accelerated model itself it traces whole (Diffusers' attention inside the graph) and matches."""
    holder, _ = _accelerated(_qwen())
    model = holder.transformer
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model(**_qwen_inputs())[0]
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
            compiled = model(**_qwen_inputs())[0]
    finally:
        torch._dynamo.reset()
        omni_accel.restore(holder)
    assert rel_err(compiled, eager) <= 1e-6


# (7) A kernel that refuses a call's tensors is never called: auto falls back, an explicit choice raises.


@pytest.fixture
def refuse_single_queries(monkeypatch):
    """Makes a provider's kernel refuse one-query calls, as cuDNN refuses length-1 sequences: ``refusal``
    says so and ``forward`` raises ``KernelRefusal`` without running the kernel."""

    def refuse(name):
        provider = get_provider(name)
        forward = provider.forward

        def refusal(query, key, value, attn_mask=None):
            return "these tensors (one query)" if query.shape[1] == 1 else None

        def checked_forward(query, key, value, **kwargs):
            if refusal(query, key, value) is not None:
                raise KernelRefusal(name, refusal(query, key, value))
            return forward(query, key, value, **kwargs)

        monkeypatch.setattr(provider, "refusal", refusal)
        monkeypatch.setattr(provider, "forward", checked_forward)

    return refuse


def _reference(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def test_auto_serves_a_refused_call_with_the_next_provider_and_records_why(refuse_single_queries):
    refuse_single_queries("sdpa")
    selector = AttentionSelector()
    for seq_q in (1, 4, 1):
        q, k, v = _bshd(2, seq_q, 9)
        assert rel_err(selector.attend("r", "self", q, k, v), _reference(q, k, v)) <= 1e-6
    rows = {(provider, reason) for _, _, provider, reason in selector.decisions()}
    assert rows == {
        ("sdpa", "auto: best lossless provider for cpu"),
        ("sdpa_math", "auto: best lossless provider for cpu; sdpa refused these tensors (one query)"),
    }


def test_a_routed_call_refused_by_its_kernel_falls_back_too(refuse_single_queries):
    refuse_single_queries("sdpa")
    q, k, v = _bshd(2, 1, 9)
    with _Routed(transformer_flux) as routed:
        got = routed(q, k, v)
    assert rel_err(got, DIFFUSERS_DISPATCH(q, k, v)) <= 1e-6
    assert [row[2] for row in routed.selector.decisions()] == ["sdpa_math"]


def test_an_explicit_choice_whose_kernel_refuses_the_call_raises_naming_what_would_serve(
    refuse_single_queries,
):
    refuse_single_queries("sdpa")
    q, k, v = _bshd(2, 1, 9)
    with pytest.raises(AttentionProviderError) as error:
        AttentionSelector(AttentionConfig(default="sdpa")).attend("r", "self", q, k, v)
    message = str(error.value)
    assert "Attention provider 'sdpa' (default = 'sdpa') cannot serve role 'r' here" in message
    assert "refused these tensors (one query)" in message
    assert "Providers that can serve these tensors: 'sdpa_math'" in message and "'auto'" in message


def test_a_diffusers_choice_whose_kernel_refuses_the_call_raises_naming_the_diffusers_fix(
    refuse_single_queries,
):
    refuse_single_queries("sdpa_math")
    q, k, v = _bshd(2, 1, 9)
    with dispatch.attention_backend("_native_math"), pytest.raises(AttentionProviderError) as error:
        AttentionSelector().attend("r", "self", q, k, v)
    message = str(error.value)
    assert f"Attention provider 'sdpa_math' ({MATH_REASON}) cannot serve role 'r' here" in message
    assert "Providers that can serve these tensors: 'sdpa'" in message
    assert "set_attention_backend('native')" in message
