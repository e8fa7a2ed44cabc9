"""Pipelines with the projection cache on and off give bitwise-equal outputs; hits land where expected."""

import gc
import weakref

import pytest
import torch

import omni_accel

STEPS = 3


def _flux(pipe, **kwargs):
    return pipe(
        prompt="a cat",
        height=32,
        width=32,
        num_inference_steps=STEPS,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    ).images


def _wan(pipe, **prompt):
    """A short Wan call: "a cat" with a negative prompt and CFG, unless ``prompt`` says otherwise."""
    prompt = prompt or {"prompt": "a cat", "negative_prompt": "blurry", "guidance_scale": 5.0}
    return pipe(
        **prompt,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=STEPS,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).frames


def _cache(pipe):
    return omni_accel.describe(pipe).components[0].cache


@pytest.mark.parametrize(
    "guidance_embeds, kwargs",
    [
        (False, {}),
        (True, {"guidance_scale": 4.0}),
        (False, {"negative_prompt": "dark", "true_cfg_scale": 3.0}),
    ],
)
def test_flux_cache_on_equals_off_bitwise(guidance_embeds, kwargs):
    off = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0, guidance_embeds=guidance_embeds), projection_cache_bytes=0
    )
    on = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0, guidance_embeds=guidance_embeds))
    assert _cache(off) is None
    calls = 2 if "true_cfg_scale" in kwargs else 1
    per_forward = 2 * 2 + 2  # two double blocks (image + text modulation), two single blocks
    first_off, first_on = _flux(off, **kwargs), _flux(on, **kwargs)
    assert torch.equal(first_on, first_off)
    cache = _cache(on)
    assert (cache.hits, cache.misses) == (0, STEPS * calls * per_forward)
    second = _flux(on, **kwargs)  # a second request with the same prompt: every modulation is reused
    assert torch.equal(second, first_off)
    assert (cache.hits, cache.misses) == (STEPS * calls * per_forward, STEPS * calls * per_forward)
    assert f"exact projection cache: {cache.hits} hits, {cache.misses} misses" in str(omni_accel.describe(on))


def test_wan_cache_on_equals_off_bitwise_with_cfg():
    # Wan routed (its cache sites wrap Diffusers' modules); native Wan blocks have no cache sites yet.
    off = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), projection_cache_bytes=0, native=False)
    on = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), native=False)
    reference = _wan(off)
    assert torch.equal(_wan(on), reference)
    cache = _cache(on)
    # text_embedder: one miss per branch, then hits; 2 blocks x to_k/to_v follow it; the timestep MLP and its
    # projection miss on the conditional call and hit on the unconditional one of the same step.
    assert (cache.misses, cache.hits) == (2 + 8 + 3 + 3, 4 + 16 + 3 + 3)
    assert torch.equal(_wan(on), reference)
    assert (cache.misses, cache.hits) == (16, 26 + 42)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_model_offload_hooks_keep_the_entries_of_a_resident_model(family):
    """Model CPU offload's hook (accelerate's ``cpu_offload_with_hook``, as ``enable_model_cpu_offload``
    installs it) moves the transformer to where it is and offloads it after the call, here both on the
    CPU: the weights stay the same tensors, and the second request reuses every projection, bitwise as
    plain Diffusers with the same hooks computes (the no-op moves wrote every weight before)."""
    from accelerate import cpu_offload_with_hook

    build, run, options = {
        "flux": (omni_accel.tiny_flux_pipeline, _flux, {}),
        "wan": (omni_accel.tiny_wan_pipeline, _wan, {"native": False}),
    }[family]
    plain, fast = build(seed=0), build(seed=0)
    hooks = [cpu_offload_with_hook(pipe.transformer, torch.device("cpu"))[1] for pipe in (plain, fast)]
    omni_accel.accelerate(fast, **options)
    expected = run(plain)
    assert torch.equal(run(fast), expected)
    cache = _cache(fast)
    misses = cache.misses
    for hook in hooks:
        hook.offload()  # maybe_free_model_hooks' offload after a pipeline call
    fast.to("cpu")
    assert torch.equal(run(fast), expected) and torch.equal(run(plain), expected)
    assert cache.misses == misses and cache.hits >= misses


_CPU = torch.device("cpu")
_DROPPED = "stored outputs dropped: its module's weights or code changed since it was stored (offload"
_BYPASSED = "calls bypassed it: a hook on the projection's module or below it (sequential or leaf-level"


def _group_offload(pipe):
    pipe.transformer.enable_group_offload(_CPU, _CPU, offload_type="block_level", num_blocks_per_group=1)


def _leaf_offload(pipe):
    pipe.transformer.enable_group_offload(_CPU, _CPU, offload_type="leaf_level")


def _sequential_offload(pipe):
    from accelerate import cpu_offload

    cpu_offload(pipe.transformer, execution_device=_CPU)  # enable_sequential_cpu_offload's hooks


def _layerwise_casting(pipe):
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)


@pytest.mark.parametrize(
    ("family", "offload", "said"),
    [
        ("wan", _group_offload, _DROPPED),
        ("wan", _leaf_offload, _BYPASSED),
        ("wan", _sequential_offload, _BYPASSED),
        ("wan", _layerwise_casting, _BYPASSED),
        ("flux", _group_offload, _DROPPED),
        ("flux", _leaf_offload, "not consulted yet (no block has run natively"),
    ],
)
def test_under_offload_describe_says_why_the_cache_reuses_nothing(family, offload, said):
    """Offload and layerwise casting load or cast the weights anew at each call, or hook the projections:
    the outputs are bitwise plain Diffusers' with the same offload, and ``describe`` says why nothing (or
    little) was reused, instead of bare miss and bypass counts."""
    build, run, options = {
        "flux": (omni_accel.tiny_flux_pipeline, _flux, {}),
        "wan": (omni_accel.tiny_wan_pipeline, _wan, {"native": False}),
    }[family]
    plain, fast = build(seed=0), build(seed=0)
    offload(plain)
    offload(fast)
    omni_accel.accelerate(fast, **options)
    expected = run(plain)
    assert torch.equal(run(fast), expected) and torch.equal(run(fast), expected)
    assert said in str(omni_accel.describe(fast))


def test_wan_cache_sites_are_unwrapped_on_restore():
    pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), native=False)
    to_k = pipe.transformer.blocks[0].attn2.to_k
    assert "forward" in vars(to_k)
    omni_accel.restore(pipe)
    assert "forward" not in vars(to_k)


def test_a_diffusers_hook_registered_after_accelerate_outlives_restore():
    """A hook a user adds to a cache site after ``accelerate`` wraps our forward: ``restore`` steps ours
    aside, and the hook keeps running on the module's own forward."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Spy(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Spy.calls += 1
            return args, kwargs

    pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), native=False)
    to_k = pipe.transformer.blocks[0].attn2.to_k
    HookRegistry.check_if_exists_or_initialize(to_k).register_hook(Spy(), "spy")
    omni_accel.restore(pipe)
    x = torch.randn(1, 3, to_k.in_features)
    assert torch.equal(to_k(x), torch.nn.functional.linear(x, to_k.weight, to_k.bias))
    assert Spy.calls == 1
    omni_accel.restore(omni_accel.accelerate(pipe, native=False))
    assert to_k(x).shape == (1, 3, to_k.out_features) and Spy.calls == 2


def test_conditioning_written_behind_the_version_counter_is_compared_again():
    """Prompt embeddings sharing memory with a NumPy array the caller refills between calls: torch's
    version counter does not move, and the generic tier's cached text projection was the old prompt's
    (1.3e-2 off). Each forward compares its conditioning again."""
    plain = omni_accel.tiny_wan_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), native=False)
    with torch.no_grad():
        embeds = plain.encode_prompt("a cat", do_classifier_free_guidance=False)[0]
    buffer = embeds.numpy().copy()
    shared = torch.from_numpy(buffer)

    def run(pipe):
        return _wan(pipe, prompt_embeds=shared, guidance_scale=1.0)

    assert torch.equal(run(fast), run(plain))
    buffer *= 1.3
    assert torch.equal(run(fast), run(plain))
    assert _cache(fast).stats()["hits"] > 0  # the cache is on, and hits within each call


def test_a_cache_site_whose_code_or_submodules_change_computes_again(monkeypatch):
    """The stored projection belongs to the site's code as well as its weights: its class's forward
    patched, or a submodule of it replaced, after outputs were stored, and the output is plain Diffusers'
    with the same change (the stored one was served before)."""
    from diffusers.models.embeddings import TimestepEmbedding

    plain = omni_accel.tiny_wan_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), native=False)
    assert torch.equal(_wan(fast), _wan(plain)) and _cache(fast).stats()["hits"] > 0
    original = TimestepEmbedding.forward
    monkeypatch.setattr(TimestepEmbedding, "forward", lambda self, *a, **k: original(self, *a, **k) * 2)
    assert torch.equal(_wan(fast), _wan(plain))
    monkeypatch.undo()
    for pipe in (plain, fast):
        pipe.transformer.condition_embedder.time_embedder.act = torch.nn.Identity()
    assert torch.equal(_wan(fast), _wan(plain))


def test_pipe_to_another_dtype_hits_as_a_pipeline_made_in_it():
    """The outputs stored under the fp32 weights can never be reused after ``pipe.to(torch.bfloat16)``: they
    leave their room in the budget to the bf16 ones (they kept it, and the cache never hit again)."""
    budget = 8000  # one 3-step call's conditionings and modulations in fp32, with no room to spare
    moved = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), projection_cache_bytes=budget)
    _flux(moved)
    made = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0).to(torch.bfloat16), projection_cache_bytes=budget
    )
    moved.to(torch.bfloat16)
    assert torch.equal(_flux(moved), _flux(made))  # the first frees the room as it stores
    assert _cache(moved).hits == _cache(made).hits == 0
    assert torch.equal(_flux(moved), _flux(made))
    assert _cache(moved).hits == _cache(made).hits > 0


def test_pipe_to_another_dtype_lets_go_of_the_outputs_at_once():
    """``pipe.to`` another dtype or device frees what the cache stored under the old weights at the move,
    as plain Diffusers frees everything there (they stayed, on the GPU they were made on, until the next
    call); a call after it and one moved back give what plain Diffusers gives."""
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    assert torch.equal(_flux(fast), _flux(plain))
    cache = _cache(fast)
    stored = [weakref.ref(entry.output) for entry in cache._entries.values()]
    assert stored and cache.bytes_used > 0
    fast.to("cpu")  # where the weights are: nothing is dropped
    assert cache.bytes_used > 0 and all(ref() is not None for ref in stored)
    for pipe in (plain, fast):
        pipe.to(torch.float64)
    gc.collect()
    assert cache.bytes_used == 0 and cache.stats()["entries"] == 0
    assert all(ref() is None for ref in stored)
    want, got = _flux(plain), _flux(fast)
    assert got.dtype == torch.float64 and ((got - want).abs().max() / want.abs().max()) < 1e-12
    for pipe in (plain, fast):
        pipe.to(torch.float32)
    hits = cache.hits
    assert torch.equal(_flux(fast), _flux(plain)) and cache.hits == hits  # nothing from before came back
    assert torch.equal(_flux(fast), _flux(plain)) and cache.hits > hits
