"""An accelerated pipeline is still a Diffusers pipeline: every step a Diffusers user takes gives what
plain Diffusers gives on the same weights (fp32, CPU)."""

import copy
import pickle
import threading

import pytest
import torch
from conftest import flux_inputs, random_ip_adapter_state, random_lora, rel_err

import omni_accel

CALL = dict(prompt="a cat", height=32, width=32, num_inference_steps=3, output_type="latent")
LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "proj_mlp",
    "norm1.linear",
    "ff.net.2",
]


def _latents(pipe, **kwargs):
    return pipe(**{**CALL, **kwargs}, generator=torch.Generator().manual_seed(0)).images


def _pair(seed=0, **overrides):
    """Plain and accelerated; the CUDA-graph hook is installed as on a GPU (on CPU it passes calls on), so
    every Diffusers operation below also runs through it."""
    plain = omni_accel.tiny_flux_pipeline(seed=seed, **overrides)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=seed, **overrides), cuda_graphs=True)
    return plain, fast


def _same(plain, fast, **kwargs):
    expected, got = _latents(plain, **kwargs), _latents(fast, **kwargs)
    assert rel_err(got, expected) <= 1e-5
    return got


def _native_calls_only(pipe):
    assert not omni_accel.describe(pipe).components[0].runtime.fallbacks


def _lora(seed: int) -> dict:
    return random_lora(omni_accel.tiny_flux_pipeline(seed=0).transformer, LORA_TARGETS, seed)


def test_lora_lifecycle_matches_plain_diffusers():
    plain, fast = _pair()
    base = _latents(fast)
    first, second = _lora(1), _lora(2)
    steps = [
        lambda p: p.load_lora_weights(dict(first), adapter_name="a"),
        lambda p: p.load_lora_weights(dict(second), adapter_name="b"),
        lambda p: p.set_adapters(["a", "b"], [0.7, -0.4]),
        lambda p: p.transformer.set_adapters(["a"], [0.0]),
        lambda p: p.set_adapters(["a", "b"], [1.0, 0.5]),
        lambda p: p.disable_lora(),
        lambda p: p.enable_lora(),
        lambda p: p.fuse_lora(lora_scale=0.8),
        lambda p: p.unfuse_lora(),
        lambda p: p.delete_adapters("a"),
        lambda p: p.unload_lora_weights(),
    ]
    outputs = []
    for step in steps:
        step(plain)
        step(fast)
        outputs.append(_same(plain, fast))
    _same(plain, fast, joint_attention_kwargs={"scale": 0.3})
    assert not torch.equal(outputs[0], base)  # the adapters really act
    assert torch.equal(outputs[-1], _latents(fast)) and rel_err(outputs[-1], base) <= 1e-6
    _native_calls_only(fast)  # unfused adapters ran inside the native packed GEMMs


def test_lora_loaded_before_accelerate_and_hotswap():
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    fast = omni_accel.tiny_flux_pipeline(seed=0)
    for pipe in (plain, fast):
        pipe.load_lora_weights(_lora(1), adapter_name="a")
    omni_accel.accelerate(fast)
    _same(plain, fast)
    for pipe in (plain, fast):
        pipe.load_lora_weights(_lora(3), adapter_name="a", hotswap=True)
    _same(plain, fast)
    _native_calls_only(fast)


@pytest.mark.parametrize("kind", ["first_block", "taylorseer", "mag", "faster", "pab"])
def test_diffusers_step_caches(kind):
    from diffusers import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )

    def config(pipe):
        timestep = lambda: pipe.current_timestep  # noqa: E731
        return {
            "first_block": lambda: FirstBlockCacheConfig(threshold=0.5),
            "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
            "mag": lambda: MagCacheConfig(threshold=0.5, num_inference_steps=3, mag_ratios=[1.0, 0.95, 0.9]),
            "faster": lambda: FasterCacheConfig(
                spatial_attention_block_skip_range=2,
                current_timestep_callback=timestep,
                is_guidance_distilled=True,
            ),
            "pab": lambda: PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=2, current_timestep_callback=timestep
            ),
        }[kind]()

    plain, fast = _pair()
    for pipe in (plain, fast):
        pipe.transformer.enable_cache(config(pipe))
    _same(plain, fast)
    for pipe in (plain, fast):
        pipe.transformer.disable_cache()
    _same(plain, fast)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_fuse_and_unfuse_qkv_projections(family):
    """Fused, the blocks run Diffusers' forward (its fused weights) and ``describe`` says that is why;
    unfused, the native math again."""
    build = {"flux": omni_accel.tiny_flux_pipeline, "wan": omni_accel.tiny_wan_pipeline}[family]
    call = dict(CALL, num_frames=5) if family == "wan" else CALL
    plain, fast = build(seed=0), omni_accel.accelerate(build(seed=0))

    def same():
        expected, got = (p(**call, generator=torch.Generator().manual_seed(0)) for p in (plain, fast))
        name = "frames" if family == "wan" else "images"
        assert rel_err(getattr(got, name), getattr(expected, name)) <= 1e-5

    runtime = omni_accel.describe(fast).components[0].runtime
    for pipe in (plain, fast):
        pipe.transformer.fuse_qkv_projections()
    same()
    assert runtime.fallbacks and all("fuse_qkv_projections() is active" in r for r in runtime.fallbacks)
    for pipe in (plain, fast):
        pipe.transformer.unfuse_qkv_projections()
    before = dict(runtime.fallbacks)
    same()
    assert runtime.fallbacks == before


@torch.no_grad()
def test_qkv_projections_fused_before_accelerate_then_unfused_run_native():
    """A transformer fused before ``accelerate`` runs Diffusers' forward; unfused (the fused linears
    deleted, the flag False where it was unset), the native math again, as after a fuse made later."""
    from conftest import flux_inputs, random_flux_transformer
    from diffusers import FluxPipeline

    plain, fast = random_flux_transformer(), random_flux_transformer()
    inputs = flux_inputs(plain)
    for model in (plain, fast):
        model.fuse_qkv_projections()
    pipe = omni_accel.accelerate(FluxPipeline(None, None, None, None, None, None, fast))
    runtime = omni_accel.describe(pipe).components[0].runtime
    assert torch.equal(fast(**inputs)[0], plain(**inputs)[0])
    assert runtime.fallbacks and all("fuse_qkv_projections() is active" in r for r in runtime.fallbacks)
    for model in (plain, fast):
        model.unfuse_qkv_projections()
    before = dict(runtime.fallbacks)
    assert rel_err(fast(**inputs)[0], plain(**inputs)[0]) <= 1e-5
    assert runtime.fallbacks == before


def test_state_dict_save_and_load_with_diffusers_names(tmp_path):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    plain, fast = _pair()
    expected = plain.transformer.state_dict()
    got = fast.transformer.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    other = omni_accel.tiny_flux_pipeline(seed=7)
    for pipe in (plain, fast):
        pipe.transformer.load_state_dict(other.transformer.state_dict())
    _same(plain, fast)
    fast.save_pretrained(tmp_path / "pipe")
    loaded = FluxTransformer2DModel.from_pretrained(tmp_path / "pipe" / "transformer")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in other.transformer.state_dict().items())
    reloaded = FluxPipeline.from_pretrained(tmp_path / "pipe")
    assert rel_err(_latents(reloaded), _latents(plain)) <= 1e-6


def test_savers_of_packed_weights(tmp_path):
    """docs/troubleshooting.md ("Saving the weights with other libraries' savers"): the workaround keeps every
    tensor; savers that take a shared storage for tied weights refuse the packed views, and take the module
    once restored."""
    from safetensors.torch import load_file, save_file, save_model

    plain, fast = _pair()
    expected = plain.transformer.state_dict()
    save_file(fast.transformer.state_dict(), tmp_path / "t.safetensors")
    saved = load_file(tmp_path / "t.safetensors")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        save_model(fast.transformer, tmp_path / "m.safetensors")
    omni_accel.restore(fast)  # each parameter its own storage again: the saver takes the restored module
    save_model(fast.transformer, tmp_path / "m.safetensors")
    saved = load_file(tmp_path / "m.safetensors")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)


def test_from_pipe_both_ways():
    from diffusers import FluxImg2ImgPipeline

    plain, fast = _pair()
    sibling_before = FluxImg2ImgPipeline.from_pipe(plain)  # a sibling of a pipeline accelerated later
    omni_accel.accelerate(plain)
    sibling_after = FluxImg2ImgPipeline.from_pipe(fast)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    kwargs = dict(image=image, strength=0.9, prompt="a cat", height=32, width=32, num_inference_steps=3)
    a = sibling_before(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    b = sibling_after(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    assert rel_err(b, a) <= 1e-5


@pytest.mark.parametrize("accelerated", [True, False])
def test_a_copy_of_a_from_pipe_sibling_owns_its_transformer(accelerated):
    """A deep or unpickled copy of a sibling holds a copy of the module no other pipeline holds: restoring
    the copy gives Diffusers' blocks back and leaves the original pipelines accelerated."""
    from diffusers import FluxPipeline

    plain, fast = _pair()
    sibling = FluxPipeline.from_pipe(fast)
    if accelerated:
        omni_accel.accelerate(sibling)
    for twin in (copy.deepcopy(sibling), pickle.loads(pickle.dumps(sibling))):
        if not accelerated:
            omni_accel.accelerate(twin)
        _same(plain, twin)
        assert omni_accel.describe(twin).components[0].mode == "native"
        omni_accel.restore(twin)
        assert type(twin.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
        _same(plain, twin)
    for pipe in (fast, sibling):
        assert type(pipe.transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
        _same(plain, pipe)
    both = copy.deepcopy([fast, sibling])  # copied with its owner: the owner's copy restores it
    if accelerated:
        omni_accel.restore(both[1])  # a sibling's restore leaves the module as its owner set it up
    assert type(both[1].transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
    omni_accel.restore(both[0])
    assert type(both[1].transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"


def test_deepcopy_and_pickle():
    plain, fast = _pair()
    twin = copy.deepcopy(fast)
    _same(plain, twin)
    _native_calls_only(twin)
    # The copy's report reads the attention choices of the copy's calls, and the original's of its own.
    assert omni_accel.describe(twin).components[0].selector.decisions()
    assert not omni_accel.describe(fast).components[0].selector.decisions()
    assert twin.transformer.transformer_blocks[0].attn.to_q.weight.data_ptr() != (
        fast.transformer.transformer_blocks[0].attn.to_q.weight.data_ptr()
    )
    runtime = twin.transformer.transformer_blocks[0].omni_runtime
    assert omni_accel.describe(twin).components[0].cache is runtime.cache
    omni_accel.restore(twin)  # restoring the copy leaves the original accelerated
    assert type(twin.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    assert type(fast.transformer.transformer_blocks[0]).__name__ == "NativeFluxTransformerBlock"
    restored = pickle.loads(pickle.dumps(fast.transformer))
    expected = plain.transformer.state_dict()
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize("native", [True, False])
def test_a_copy_of_the_transformer_alone_holds_no_patch(native):
    """A deep copy of an accelerated transformer alone (an EMA copy) computes as the original; restoring the
    pipeline leaves no patch behind for it (no pipeline would ever restore the copy), and the copy then
    computes as plain Diffusers."""
    from omni_accel import patches

    before = patches.applied()  # other tests' pipelines may still hold the same patches
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), native=native, compile=False)
    lone = copy.deepcopy(pipe.transformer)
    inputs = flux_inputs(pipe.transformer)
    expected = omni_accel.tiny_flux_pipeline(seed=0).transformer(**inputs).sample
    assert rel_err(lone(**inputs).sample, expected) <= 1e-5
    omni_accel.restore(pipe)
    assert patches.applied() == before
    assert rel_err(lone(**inputs).sample, expected) <= 1e-5


def test_pickled_qwenimage_pipeline_runs_as_plain_diffusers():
    """The registry's spec for Qwen-Image (its true-CFG rule) travels with the pipeline's state: it pickles."""
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    twin = pickle.loads(pickle.dumps(omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0))))
    call = dict(CALL, negative_prompt="a dog", true_cfg_scale=4.0)
    expected, got = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (plain, twin))
    assert rel_err(got, expected) <= 1e-5
    _native_calls_only(twin)


def test_offload_and_layerwise_casting_before_and_after():
    plain, fast = _pair()
    for pipe in (plain, fast):
        pipe.transformer.enable_group_offload(
            torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
        )
    _same(plain, fast)
    plain, fast = _pair()
    before = omni_accel.tiny_flux_pipeline(seed=0)
    for pipe in (plain, fast, before):
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    omni_accel.accelerate(before)
    expected = _latents(plain)
    assert rel_err(_latents(fast), expected) <= 1e-5
    assert rel_err(_latents(before), expected) <= 1e-5


def test_forward_hooks_before_and_after_accelerate():
    seen = {"plain": [], "fast": []}
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    fast = omni_accel.tiny_flux_pipeline(seed=0)
    plain.transformer.transformer_blocks[0].register_forward_hook(
        lambda m, a, o: seen["plain"].append(o[1].sum())
    )
    fast.transformer.transformer_blocks[0].register_forward_hook(
        lambda m, a, o: seen["fast"].append(o[1].sum())
    )
    omni_accel.accelerate(fast)
    to_k = fast.transformer.single_transformer_blocks[1].attn.to_k
    to_k.register_forward_hook(lambda m, a, o: o * 2)  # a hook that changes a projection must take effect
    plain.transformer.single_transformer_blocks[1].attn.to_k.register_forward_hook(lambda m, a, o: o * 2)
    _same(plain, fast)
    assert len(seen["fast"]) == len(seen["plain"]) == 3
    assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(seen["fast"], seen["plain"], strict=True))


def test_train_mode_and_requires_grad_survive_accelerate_and_restore():
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    pipe.transformer.train()
    pipe.transformer.x_embedder.weight.requires_grad_(False)
    omni_accel.accelerate(pipe)
    assert pipe.transformer.training and pipe.transformer.transformer_blocks[0].training
    assert not pipe.transformer.x_embedder.weight.requires_grad
    assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.requires_grad
    omni_accel.restore(pipe)
    assert pipe.transformer.training and not pipe.transformer.x_embedder.weight.requires_grad


def test_restore_leaves_a_reassigned_transformer_alone():
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    old = pipe.transformer
    new = omni_accel.tiny_flux_pipeline(seed=9).transformer
    pipe.transformer = new
    omni_accel.restore(pipe)
    assert pipe.transformer is new
    assert type(old.transformer_blocks[0]).__name__ == "FluxTransformerBlock"


def test_concurrent_calls_give_the_serial_results():
    """Several accelerated pipelines (native and routed) called at once from their own threads."""

    def flux():
        return omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))

    def wan():
        return omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))

    def run(pipe):
        if type(pipe).__name__ == "WanPipeline":
            kwargs = dict(num_frames=5, num_inference_steps=2, height=32, width=32)
            out = pipe(
                prompt="a cat", output_type="latent", generator=torch.Generator().manual_seed(0), **kwargs
            )
            return out.frames
        return _latents(pipe)

    pipes = [flux(), wan(), flux(), wan()]
    serial = [run(pipe) for pipe in pipes]
    results, errors = {}, []

    def work(i):
        try:
            results[i] = run(pipes[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pipes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(results[i], serial[i]) for i in range(len(pipes)))


def _modulation_weight(pipe):
    return pipe.transformer.transformer_blocks[0].norm1.linear.weight


_WEIGHT_EDITS = {
    "in-place": lambda p: torch.no_grad()(lambda: _modulation_weight(p).mul_(1.5))(),
    "through-data": lambda p: _modulation_weight(p).data.mul_(0.9).add_(0.01),
    "data-swap": lambda p: setattr(_modulation_weight(p), "data", _modulation_weight(p) * 2),
    "load_state_dict": lambda p: p.transformer.load_state_dict(
        omni_accel.tiny_flux_pipeline(seed=5).transformer.state_dict()
    ),
    "adapter-added": lambda p: p.load_lora_weights(_lora(1), adapter_name="a"),
    "adapter-scaled": lambda p: p.transformer.set_adapters(["a"], [0.0]),
    "adapter-disabled": lambda p: p.disable_lora(),
    "adapter-deleted": lambda p: p.delete_adapters("a"),
    "hook": lambda p: p.transformer.transformer_blocks[0].norm1.linear.register_forward_hook(
        lambda m, a, o: o + 1
    ),
}


@pytest.mark.parametrize("edit", list(_WEIGHT_EDITS))
def test_projection_cache_is_exact_whatever_changes_a_weight(edit):
    """A second identical request hits the modulation cache; after each way of changing a weight (or its
    effective value) the output is plain Diffusers' with the same change, never a stale projection."""
    plain, fast = _pair()
    if edit.startswith("adapter-") and edit != "adapter-added":
        for pipe in (plain, fast):
            pipe.load_lora_weights(_lora(1), adapter_name="a")
    before = _same(plain, fast)
    cache = omni_accel.describe(fast).components[0].cache
    _same(plain, fast)
    assert cache.hits > 0
    for pipe in (plain, fast):
        _WEIGHT_EDITS[edit](pipe)
    after = _same(plain, fast)
    assert not torch.equal(after, before)


def test_reading_data_between_forward_and_backward_trains_as_plain_diffusers():
    """The cache watches ``.data`` use of the weights it depends on, apart from the version counter that
    autograd checks: a weight norm logged between a training forward and its backward is no write there.
    A deep copy's and a pickled copy's parameters are plain ones (their stores start empty)."""
    plain, fast = _pair()
    _same(plain, fast)  # the cache stores, and watches the modulation weights
    results = []
    for pipe in (plain, fast):
        loss = pipe.transformer(**flux_inputs(pipe.transformer))[0].square().mean()
        norms = [p.data.norm() for p in pipe.transformer.parameters()]
        loss.backward()
        results.append((loss.detach(), norms[0], _modulation_weight(pipe).grad))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert type(_modulation_weight(fast)).__name__ == "WatchedParameter"
    for copied in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert {type(p) for p in copied.transformer.parameters()} == {torch.nn.Parameter}


def test_compiled_blocks_take_new_lora_scales_and_hotswaps_without_recompiling():
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    fast = omni_accel.tiny_flux_pipeline(seed=0)
    for pipe in (plain, fast):
        pipe.load_lora_weights(_lora(1), adapter_name="a")
    omni_accel.accelerate(fast, compile={"backend": "aot_eager"}, compile_in_background=False)
    _same(plain, fast)
    counters.clear()
    steps = [
        lambda p: p.set_adapters(["a"], [0.3]),
        lambda p: p.transformer.set_adapters(["a"], [-1.5]),
        lambda p: p.load_lora_weights(_lora(3), adapter_name="a", hotswap=True),
    ]
    for step in steps:
        step(plain)
        step(fast)
        _same(plain, fast)
    assert counters["stats"]["unique_graphs"] == 0, "a scale change or a same-rank hotswap recompiled"


def test_flux_ip_adapter_matches_plain_diffusers():
    """IP-Adapter processors run Diffusers' forward of the double blocks (the single blocks stay native)."""
    from conftest import flux_inputs, random_flux_transformer

    plain, fast = random_flux_transformer(), random_flux_transformer()
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    pipe.transformer = fast
    omni_accel.accelerate(pipe)
    state = random_ip_adapter_state(plain)
    for model in (plain, fast):
        model._load_ip_adapter_weights(copy.deepcopy(state), low_cpu_mem_usage=False)
    inputs = flux_inputs(plain)
    image = torch.randn(2, 1, 12, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, got = (
            m(**inputs, joint_attention_kwargs={"ip_adapter_image_embeds": [image]}, return_dict=False)[0]
            for m in (plain, fast)
        )
        without = random_flux_transformer()(**inputs, return_dict=False)[0]
    assert rel_err(got, expected) <= 1e-5 and not torch.equal(expected, without)
    fallbacks = omni_accel.describe(pipe).components[0].runtime.fallbacks
    assert sum(fallbacks.values()) == plain.config.num_layers  # the double blocks, once each
    assert all("FluxIPAdapterAttnProcessor" in reason for reason in fallbacks)


@pytest.mark.gpu
@pytest.mark.parametrize("when", ["before", "after"])
def test_model_cpu_offload_before_or_after_accelerate(when):
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    plain.enable_model_cpu_offload()
    fast = omni_accel.tiny_flux_pipeline(seed=0)
    if when == "before":
        fast.enable_model_cpu_offload()
    omni_accel.accelerate(fast)
    if when == "after":
        fast.enable_model_cpu_offload()
    _same(plain, fast)
    _native_calls_only(fast)
    assert fast.transformer.device.type == "cpu"  # offloaded again after the call


@pytest.mark.gpu
@torch.no_grad()
def test_lora_on_the_gpu_is_as_accurate_as_peft():
    """On CUDA the low-rank term accumulates into the projection in the GEMM's epilogue (rounded once):
    not bitwise peft's three roundings, but no farther from the float32 result than peft is."""
    from conftest import flux_inputs, random_flux_transformer
    from diffusers import FluxPipeline

    lora = random_lora(random_flux_transformer(), ["to_q", "to_k", "to_v", "to_out.0", "proj_out"], seed=4)
    pipes = []
    for dtype in (torch.float32, torch.bfloat16, torch.bfloat16):
        pipe = FluxPipeline(None, None, None, None, None, None, random_flux_transformer().to("cuda", dtype))
        pipe.load_lora_weights({k: v.to("cuda", dtype) for k, v in lora.items()}, adapter_name="a")
        pipe.set_adapters("a", 0.8)
        pipes.append(pipe)
    reference, plain, fast = pipes
    omni_accel.accelerate(fast)
    x = flux_inputs(reference.transformer)
    outputs = [
        p.transformer(**{k: v.to("cuda", p.transformer.dtype) for k, v in x.items()})[0].float()
        for p in pipes
    ]
    assert rel_err(outputs[2], outputs[0]) <= 1.5 * rel_err(outputs[1], outputs[0]) + 1e-3


@pytest.mark.parametrize("native", [True, False])
def test_an_interrupt_mid_forward_leaves_no_scope_entered(native):
    """A KeyboardInterrupt (a notebook's interrupt) raised inside the accelerated transformer's call: torch's
    always-called hooks do not run for it, yet the forward's runtime and the routing selector are left, so
    a plain pipeline run next in the same thread computes as plain Diffusers, untouched by our providers."""
    from omni_accel.attention import routing
    from omni_accel.layers.attention import forward_in_flight

    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), native=native, compile=False)
    inputs = flux_inputs(pipe.transformer)

    def interrupt(*_):
        raise KeyboardInterrupt

    handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        pipe.transformer(**inputs)
    handle.remove()
    assert routing._ACTIVE.get() is None and forward_in_flight() is None
    expected = omni_accel.tiny_flux_pipeline(seed=0).transformer(**inputs).sample
    assert rel_err(pipe.transformer(**inputs).sample, expected) <= 1e-5


def test_scopes_nest_and_a_raising_pre_hook_gives_its_error_alone():
    """Two scopes on one context variable (two pipelines routing one module) leave it as they found it: a
    token resets only in the reverse order of entering. A user's pre-hook, registered before accelerate,
    that refuses a call raises its error alone, as in Diffusers (our scope's hook, always called, warned)."""
    import contextvars
    import functools
    import warnings

    from omni_accel.patches import scoped_calls

    from omni_accel.forward_hooks import add_scope

    class Scoped(torch.nn.Linear):
        pass

    var = contextvars.ContextVar("omni_accel_test_scope", default="outside")
    module, seen = Scoped(2, 2), []
    module.register_forward_hook(lambda *_: seen.append(var.get()))
    scoped_calls.apply(Scoped)
    try:
        undo = [
            add_scope(module, functools.partial(var.set, value), var.reset) for value in ("first", "second")
        ]
        module(torch.zeros(1, 2))
        assert seen == ["second"] and var.get() == "outside"
        for step in undo:
            step()
        assert scoped_calls.SCOPES not in vars(module)
    finally:
        scoped_calls.revert(Scoped)
    assert "__call__" not in vars(Scoped)

    class Derived(Scoped):  # patched beside its base: the scopes are still entered once a call
        pass

    entered = []
    scoped_calls.apply(Scoped)
    scoped_calls.apply(Derived)
    try:
        module = Derived(2, 2)
        undo = add_scope(module, lambda: entered.append(1), lambda _: None)
        module(torch.zeros(1, 2))
        assert entered == [1]
        undo()
    finally:
        scoped_calls.revert(Derived)
        scoped_calls.revert(Scoped)

    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    refuse = [True]

    def check(module, args, kwargs):
        if refuse[0]:
            raise ValueError("refused by the user's hook")

    pipe.transformer.register_forward_pre_hook(check, with_kwargs=True)
    omni_accel.accelerate(pipe)
    inputs = flux_inputs(pipe.transformer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="refused by the user's hook"):
            pipe.transformer(**inputs)
    assert not [str(w.message) for w in caught]
    refuse[0] = False
    expected = omni_accel.tiny_flux_pipeline(seed=0).transformer(**inputs).sample
    assert rel_err(pipe.transformer(**inputs).sample, expected) <= 1e-5
