"""Under parallel layouts the accelerated pipeline is still a Diffusers pipeline: LoRA (loaded before or
after accelerate, scaled, disabled, unloaded), state_dict/load_state_dict with Diffusers names and full
shapes, save_pretrained, compile, deepcopy, against plain Diffusers doing the same steps in the same process."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from conftest import random_lora, rel_err
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from multirank import run_multirank

import omni_accel
from omni_accel import ParallelConfig

CALL = dict(prompt=["a cat", "a dog"], height=24, width=40, num_inference_steps=2, output_type="latent")
# Every kind of TP split: packed column (QKV, QKV+MLP), row (out, ff down), row over two input parts
# (the single block's proj_out), replicated (modulation).
TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_v_proj",
    "proj_mlp",
    "proj_out",
    "norm1.linear",
    "ff.net.2",
]


def _latents(pipe, **kwargs):
    return pipe(**{**CALL, **kwargs}, generator=torch.Generator().manual_seed(0)).images


def _same(plain, fast, **kwargs):
    expected, got = _latents(plain, **kwargs), _latents(fast, **kwargs)
    err = rel_err(got, expected)
    assert err <= 1e-5, f"relative error {err:.2e} against plain Diffusers"
    gathered = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, got)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks disagree"


def _lora(seed: int) -> dict:
    return random_lora(omni_accel.tiny_flux_pipeline(seed=0).transformer, TARGETS, seed)


class _CustomProcessor(FluxAttnProcessor):
    pass


def _lora_under_tp(tmp_path: str) -> None:
    plain, fast = omni_accel.tiny_flux_pipeline(seed=0), omni_accel.tiny_flux_pipeline(seed=0)
    first, second = _lora(1), _lora(2)
    for pipe in (plain, fast):
        pipe.load_lora_weights(dict(first), adapter_name="a")  # before accelerate
    omni_accel.accelerate(fast, parallel=ParallelConfig(tp=2))
    to_q = fast.transformer.transformer_blocks[0].attn.to_q
    assert to_q.base_layer.weight.shape == (16, 32) and to_q.lora_B["a"].weight.shape == (
        32,
        2,
    )  # sliced when read
    _same(plain, fast)
    steps = [
        lambda p: p.load_lora_weights(dict(second), adapter_name="b"),  # after accelerate
        lambda p: p.set_adapters(["a", "b"], [0.7, -0.4]),
        lambda p: p.transformer.set_adapters(["a"], [0.0]),
        lambda p: p.set_adapters(["a", "b"], [1.0, 0.5]),
        lambda p: p.disable_lora(),
        lambda p: p.enable_lora(),
        lambda p: p.fuse_lora(lora_scale=0.8),  # peft merges this rank's slice of each delta
        lambda p: p.unfuse_lora(),
        lambda p: p.delete_adapters("a"),
    ]
    for step in steps:
        step(plain)
        step(fast)
        _same(plain, fast)
    _same(plain, fast, joint_attention_kwargs={"scale": 0.3})
    assert not omni_accel.describe(fast).components[0].runtime.fallbacks

    # state_dict: Diffusers names and full tensors (a collective); load_state_dict takes full tensors
    got, expected = fast.transformer.state_dict(), plain.transformer.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    for pipe in (plain, fast):
        pipe.unload_lora_weights()
    edited = {k: v * 1.01 for k, v in plain.transformer.state_dict().items()}
    for pipe in (plain, fast):
        pipe.transformer.load_state_dict(edited)
    _same(plain, fast)

    # save_pretrained writes the Diffusers layout, on the main process only
    fast.transformer.save_pretrained(tmp_path, is_main_process=omni_accel.is_main_process())
    dist.barrier()
    saved = FluxTransformer2DModel.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(saved[k], edited[k]) for k in edited)

    # what the native blocks cannot run is an error under TP, never Diffusers' forward on a shard
    block = fast.transformer.transformer_blocks[0]
    block.attn.set_processor(_CustomProcessor())
    with pytest.raises(RuntimeError, match="transformer_blocks.0 cannot run natively"):
        _latents(fast)
    block.attn.set_processor(FluxAttnProcessor())

    omni_accel.restore(fast)
    restored = fast.transformer.state_dict()
    assert all(torch.equal(restored[k], edited[k]) for k in edited)
    assert all(not hasattr(m, "omni_tp") for m in fast.transformer.modules())


def _compiled_layouts() -> None:
    oracle = _latents(omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0)))
    layouts = (ParallelConfig(tp=2), ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2))
    for layout in layouts:
        torch._dynamo.reset()
        pipe = omni_accel.accelerate(
            omni_accel.tiny_flux_pipeline(seed=0), parallel=layout, compile={"backend": "aot_eager"}
        )
        counters = torch._dynamo.utils.counters
        counters.clear()
        got = _latents(pipe)
        assert rel_err(got, oracle) <= 1e-5, f"{layout} compiled"
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        assert graphs == 2 and not breaks, (
            f"{layout}: {graphs} graphs (one per block class expected), {breaks}"
        )


def _wan_cfg_pairs_both_experts() -> None:
    """Wan calls its transformer (or, in 2.2, the expert of the step) cond then uncond: cfg=2 runs the two
    on the two ranks, exactly as one rank does."""
    kwargs = dict(prompt="a cat", negative_prompt="blurry", guidance_scale=4.0, height=32, width=32)
    kwargs.update(num_frames=5, num_inference_steps=4, output_type="latent")
    for experts in (False, True):
        plain = omni_accel.tiny_wan_pipeline(seed=0, two_experts=experts)
        expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).frames
        pipe = omni_accel.accelerate(
            omni_accel.tiny_wan_pipeline(seed=0, two_experts=experts), parallel=ParallelConfig(cfg=2)
        )
        got = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
        assert rel_err(got, expected) <= 1e-5, f"two experts={experts}: {rel_err(got, expected):.2e}"
        report = omni_accel.describe(pipe)
        paired = [c.cfg.paired_calls for c in report.components if c.name.startswith("transformer")]
        assert len(paired) == (2 if experts else 1) and all(count > 0 for count in paired), paired
        assert "vae (AutoencoderKLWan): patch-parallel" in str(report)  # its decode was split, too
        # Diffusers' dynamic-CFG callback turns guidance off midway: the steps after it make one call each
        dynamic = dict(kwargs, callback_on_step_end=_guidance_off_after_step_one)
        expected = plain(**dynamic, generator=torch.Generator().manual_seed(0)).frames
        got = pipe(**dynamic, generator=torch.Generator().manual_seed(0)).frames
        assert rel_err(got, expected) <= 1e-5, f"dynamic CFG, two experts={experts}"


def _guidance_off_after_step_one(pipe, step: int, timestep, tensors: dict) -> dict:
    if step == 1:
        pipe._guidance_scale = 1.0
    return {}


def _live(group: dist.ProcessGroup | None) -> bool:
    return group in dist.distributed_c10d._world.pg_map


def _deepcopy_and_pickle() -> None:
    """A deep copy shares the layout's process groups and computes what plain Diffusers does (its CFG calls
    paired over its own branches); restoring it leaves the original accelerated, whose restore then destroys
    the groups. Pickling (maybe for another process) refuses, saying what to do."""
    true_cfg = dict(true_cfg_scale=2.0, negative_prompt=["a bird", "a fish"])
    for layout, kwargs in (
        (ParallelConfig(cfg=2), true_cfg),
        (ParallelConfig(ulysses=2), {}),
        (ParallelConfig(tp=2), {}),
    ):
        expected = _latents(omni_accel.tiny_flux_pipeline(seed=0), **kwargs)
        pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=layout)
        twin = copy.deepcopy(pipe)
        got = _latents(twin, **kwargs)  # the copy first: nothing of the original's calls set it up
        assert rel_err(got, expected) <= 1e-5, f"{layout}: the copy, {rel_err(got, expected):.2e}"
        assert torch.equal(_latents(pipe, **kwargs), got), f"{layout}: the copy computes unlike the original"
        if layout.cfg == 2:  # each rank runs one of Diffusers' two calls whole
            assert torch.equal(got, expected), f"{layout}: the copy, {rel_err(got, expected):.2e}"
        with torch.no_grad():  # the copy runs its own modules (not the original's, through its hooks)
            for param in twin.transformer.parameters():
                param.mul_(0.5)
        assert not torch.equal(_latents(twin, **kwargs), got), f"{layout}: the copy ran the original"
        paired = omni_accel.describe(twin).components[0].cfg.paired_calls
        assert paired == (4 if layout.cfg == 2 else 0), f"{layout}: the copy paired {paired} calls"
        for what in (pipe, pipe.transformer):
            with pytest.raises(TypeError, match=r"cannot be pickled.*omni_accel\.restore\(pipe\) first"):
                pickle.dumps(what)
        state = pipe._omni_accel_state.components[0].parallel
        groups = [
            g for g in [*state.mesh.get_all_groups(), state.users.host] if g not in (None, dist.group.WORLD)
        ]
        assert all(_live(g) for g in groups)
        omni_accel.restore(twin)
        assert type(twin) is FluxPipeline and all(_live(g) for g in groups), f"{layout}: restore of the copy"
        assert rel_err(_latents(pipe, **kwargs), expected) <= 1e-5, f"{layout}: after restoring the copy"
        assert omni_accel.describe(pipe).components[0].mode == "native"
        omni_accel.restore(pipe)
        assert type(pipe) is FluxPipeline and not any(_live(g) for g in groups), f"{layout}: groups left"


def _fused_qkv_under_tp() -> None:
    """Diffusers' ``fuse_qkv_projections()`` on native blocks under tp=2: a call is refused (Diffusers'
    forward of a split block would be wrong), the fused linears (built from this rank's slices) give full
    tensors in state_dict, and ``restore`` gives them their full weights back, computing as plain Diffusers'."""
    plain, fast = omni_accel.tiny_flux_pipeline(seed=0), omni_accel.tiny_flux_pipeline(seed=0)
    omni_accel.accelerate(fast, parallel=ParallelConfig(tp=2))
    for pipe in (plain, fast):
        pipe.transformer.fuse_qkv_projections()
    with pytest.raises(RuntimeError, match=r"fuse_qkv_projections\(\) is active"):
        _latents(fast)
    ours, theirs = fast.transformer.state_dict(), plain.transformer.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    omni_accel.restore(fast)
    ours = fast.transformer.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert torch.equal(_latents(fast), _latents(plain))


def _default_true_cfg_pairs() -> None:
    """Qwen-Image runs true CFG at its default scale (4.0) once a negative prompt is given: cfg=2 pairs those
    calls over the ranks and ulysses stacks them, as when the scale is passed (not every call on both)."""
    call = dict(prompt="a cat", negative_prompt="dark", height=32, width=32, num_inference_steps=2)
    call.update(output_type="latent")
    expected = omni_accel.tiny_qwenimage_pipeline(seed=0)(**call, generator=torch.Generator().manual_seed(0))
    for layout, counter in (
        (ParallelConfig(cfg=2), "paired_calls"),
        (ParallelConfig(ulysses=2), "stacked_calls"),
    ):
        pipe = omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0), parallel=layout)
        got = pipe(**call, generator=torch.Generator().manual_seed(0)).images
        assert rel_err(got, expected.images) <= 1e-5, f"{layout}: {rel_err(got, expected.images):.2e}"
        count = getattr(omni_accel.describe(pipe).components[0].cfg, counter)
        assert count == 2, f"{layout}: {count} {counter} of the 2 steps' cond/uncond pairs"


def _body(rank: int, world: int, tmp_path: str) -> None:
    torch.set_num_threads(1)
    _default_true_cfg_pairs()
    _fused_qkv_under_tp()
    _deepcopy_and_pickle()
    _lora_under_tp(tmp_path)
    _compiled_layouts()
    _wan_cfg_pairs_both_experts()


@pytest.mark.multirank
def test_diffusers_api_under_parallel_layouts(tmp_path):
    run_multirank(_body, 2, str(tmp_path), timeout=500)
