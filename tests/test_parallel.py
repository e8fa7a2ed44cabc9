"""Every parallel layout against the one-rank oracle on the same weights and seed (gloo, fp32, CPU)."""

import contextlib
import copy
import importlib
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from conftest import random_lora
from diffusers import AutoencoderKLWan, FluxPipeline
from multirank import run_multirank

import omni_accel
from omni_accel import AttentionProviderError, LayoutTuning, ParallelConfig
from omni_accel.parallel.peer_exchange import PeerRing
from omni_accel.parallel.sequence import SequenceParallel

CALL = dict(prompt=["a cat", "a dog"], height=24, width=40, num_inference_steps=2, max_sequence_length=13)


def _latents(pipe, **overrides):
    kwargs = {**CALL, **overrides}
    return pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).images


def _check(
    layout: ParallelConfig,
    oracle: torch.Tensor,
    heads: int = 2,
    expect: str = "",
    absent: str = "",
    repeat: bool = False,
    **call,
) -> None:
    groups_before = _live_groups()
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=heads, attention_head_dim=16)
    omni_accel.accelerate(pipe, parallel=layout)
    got = _latents(pipe, **call)
    if repeat:
        cache = omni_accel.describe(pipe).components[0].cache
        assert cache.hits == 0
        again = _latents(pipe, **call)
        assert torch.equal(again, got) and cache.hits > 0
    rel = ((got - oracle).abs().max() / oracle.abs().max()).item()
    assert rel <= 1e-5, f"{layout}: relative error {rel:.2e} against one rank"
    gathered = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, got)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{layout}: ranks disagree"
    report = str(omni_accel.describe(pipe))
    assert str(layout) in report and expect in report, report
    assert not absent or absent not in report, report
    omni_accel.restore(pipe)  # collective under tp: the shards are gathered back into Diffusers' layout
    original = omni_accel.tiny_flux_pipeline(
        seed=0, num_attention_heads=heads, attention_head_dim=16
    ).transformer
    restored, expected = pipe.transformer.state_dict(), original.state_dict()
    assert restored.keys() == expected.keys()
    assert all(torch.equal(restored[k], expected[k]) for k in expected), f"{layout}: restore is not exact"
    assert _live_groups() == groups_before, f"{layout}: restore left process groups behind"


def _live_groups() -> set[str]:
    """The names of the process groups alive in this process (torch keeps no public list of them)."""
    from torch.distributed.distributed_c10d import _world

    return {group.group_name for group in _world.pg_map}


def _oracle(heads: int = 2, **call) -> torch.Tensor:
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=heads, attention_head_dim=16)
    return _latents(omni_accel.accelerate(pipe), **call)


def _split_run(coder: torch.nn.Module, run) -> tuple[torch.Tensor, int]:
    """``run()`` with ``coder`` split over the ranks by rows; its output and how many calls were split."""
    from omni_accel.parallel.vae import RowSplit

    split = RowSplit(coder, dist.group.WORLD)
    split.install()
    try:
        with torch.no_grad():
            return run(), split.calls
    finally:
        split.uninstall()


def _vae_checks() -> None:
    """The row-split VAE against the whole VAE on each rank: decode and encode, uneven bands, tiling."""

    vae = omni_accel.tiny_flux_pipeline(seed=0).vae
    with torch.no_grad():
        for param in vae.parameters():  # GroupNorm affines away from their 1/0 init
            param.add_(
                torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.05
            )
    exact_vae = copy.deepcopy(vae).double()
    g = torch.Generator().manual_seed(3)

    def decode(v, z):
        return v.decode(z).sample

    def encode(v, x):
        return v.encode(x).latent_dist.parameters

    cases = [("decoder", decode, (16, 9, 10), False), ("decoder", decode, (16, 16, 10), False)]
    cases += [("decoder", decode, (16, 21, 10), True), ("encoder", encode, (3, 18, 20), False)]
    cases += [("encoder", encode, (3, 34, 12), True)]
    for coder, run, shape, tiled in cases:
        x = torch.randn(2, *shape, generator=g)
        for v in (vae, exact_vae):
            v.disable_tiling()
            if tiled:
                v.enable_tiling()
                v.tile_sample_min_size, v.tile_latent_min_size = 16, 8
        with torch.no_grad():
            exact = run(exact_vae, x.double())
            want = run(vae, x)
        got, calls = _split_run(getattr(vae, coder), lambda run=run, x=x: run(vae, x))
        assert calls > 0 and "forward" not in getattr(vae, coder).__dict__
        # Only the order of float32 sums differs (GroupNorm statistics): ~1e-7 of the output per norm.
        # So the split run is as close to a float64 run as the whole one, and within 1.5e-6 of it.
        rel = ((got - want).abs().max() / want.abs().max()).item()
        error, own = ((got - exact).abs().max().item(), (want - exact).abs().max().item())
        assert rel <= 1.5e-6 and error <= 2 * own, (
            f"{coder} {shape} (tiled: {tiled}): {rel:.2e}, {error} vs {own}"
        )
        gathered = [torch.empty_like(got) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, got)
        assert all(torch.equal(x, gathered[0]) for x in gathered)
    # A hook registered on the decoder while it is split wraps the split; uninstalling steps the split aside
    # and the hook stays, over the whole decoder.
    from diffusers.hooks import HookRegistry, ModelHook

    seen = []

    class Spy(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(args[0].shape)
            return args, kwargs

    z = torch.randn(2, 16, 9, 10, generator=g)
    vae.disable_tiling()
    with torch.no_grad():
        want = vae.decode(z).sample
    _, calls = _split_run(
        vae.decoder,
        lambda: HookRegistry.check_if_exists_or_initialize(vae.decoder).register_hook(Spy(), "spy"),
    )
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, want)
    assert seen == [z.shape] and calls == 0
    HookRegistry.check_if_exists_or_initialize(vae.decoder).remove_hook("spy")
    call = dict(prompt="a cat", height=40, width=24, num_inference_steps=2, output_type="np")
    want = omni_accel.tiny_flux_pipeline(seed=0)(**call, generator=torch.Generator().manual_seed(0)).images
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(ulysses=dist.get_world_size())
    )
    assert "vae (AutoencoderKL): patch-parallel - decoder and encoder split" in str(omni_accel.describe(pipe))
    got = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    assert abs(got - want).max() <= 1e-5
    layout = ParallelConfig(ulysses=dist.get_world_size())
    off = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=layout, vae_parallel=False)
    assert "forward" not in off.vae.decoder.__dict__ and "patch-parallel" not in str(omni_accel.describe(off))
    assert "vae (AutoencoderKL): untouched - runs whole on every rank, as vae_parallel=False asks" in str(
        omni_accel.describe(off)
    )  # said, not left out
    # A VAE put in after accelerate is described as it runs now, not as the split one it replaced.
    twin, split = copy.deepcopy(pipe), pipe.vae  # the copy's VAE is split as pipe's
    assert "vae (AutoencoderKL): patch-parallel" in str(omni_accel.describe(twin))
    for other, runs in ((off, "runs as in Diffusers"), (twin, "split by another pipeline")):
        pipe.vae = other.vae
        vae = next(c for c in omni_accel.describe(pipe).components if c.name == "vae")
        assert vae.mode == "replaced" and runs in vae.detail and "calls split" not in "\n".join(vae.lines())
    pipe.vae = split
    omni_accel.restore(twin)
    omni_accel.restore(pipe)
    assert "forward" not in pipe.vae.decoder.__dict__
    odd = omni_accel.tiny_flux_pipeline(seed=0)
    odd.vae.decoder.conv_in = torch.nn.Conv2d(odd.vae.config.latent_channels, 32, 5, padding=2)
    with pytest.raises(ValueError, match="vae_parallel=True cannot split pipe.vae .AutoencoderKL.'s decoder"):
        omni_accel.accelerate(odd, parallel=layout, vae_parallel=True)
    assert type(odd.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"  # nothing swapped

    # Wan's video decoder, frame chunk by frame chunk with its cached frames: causal 3-D convolutions take
    # halo rows, the per-frame attention runs on the gathered frame. No reduction is split, so only a
    # convolution kernel's own choice of order for a smaller input can differ (bitwise on 2 and 4 ranks;
    # on 8, bands of one row, 1.1e-6), so the split run must be as close to a float64 run as the whole one.
    importlib.import_module("omni_accel.models.wan")  # teaches the row split Wan's VAE layers
    wan_vae = omni_accel.tiny_wan_pipeline(seed=0).vae
    exact_wan = copy.deepcopy(wan_vae).double()
    z = torch.randn(1, wan_vae.config.z_dim, 3, 9, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = exact_wan.decode(z.double()).sample
        want = wan_vae.decode(z).sample
    got, calls = _split_run(wan_vae.decoder, lambda: wan_vae.decode(z).sample)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    error, own = ((got - exact).abs().max().item(), (want - exact).abs().max().item())
    assert calls == 3 and rel <= 1.5e-6 and error <= 2 * own, (rel, error, own)

    # Wan's video encoder the same way, for I2V / V2V: its strided downsamplings take the row below each
    # frame's band, its temporal ones need no rows; Wan 2.1's VAE and Wan 2.2's (patchified input, residual
    # down blocks with an averaging shortcut), even and uneven bands.
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same weights on every rank
        wan22_vae = AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True],
            is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=8,
        )  # fmt: skip
    world = dist.get_world_size()  # heights in whole downsampling units (Wan 2.1: 4 rows, Wan 2.2: 8)
    for vae, height in ((wan_vae, 8 * world), (wan_vae, 8 * world + 4), (wan22_vae, 8 * world)):
        x = torch.randn(1, 3, 5, height, 16, generator=torch.Generator().manual_seed(height))
        with torch.no_grad():
            exact = copy.deepcopy(vae).double().encode(x.double()).latent_dist.parameters
            want = vae.encode(x).latent_dist.parameters
        got, calls = _split_run(vae.encoder, lambda vae=vae, x=x: vae.encode(x).latent_dist.parameters)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        error, own = ((got - exact).abs().max().item(), (want - exact).abs().max().item())
        assert calls == 2 and rel <= 1.5e-6 and error <= 2 * own, (height, rel, error, own)
    # and Wan 2.2's decoder (residual up blocks duplicating 2x2 patches)
    z = torch.randn(1, 4, 3, 4 * world, 6, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = wan22_vae.decode(z).sample
    got, calls = _split_run(wan22_vae.decoder, lambda: wan22_vae.decode(z).sample)
    assert calls == 3 and ((got - want).abs().max() / want.abs().max()).item() <= 1.5e-6


def _vae_hooks_under_the_split() -> None:
    """Hooks on the VAE, set before or after accelerate, work as in plain Diffusers under a layout: a hook on a
    layer (layerwise casting, a user's ModelHook or torch hook) would be skipped by the band-aware layers or
    see a band, and one on the decoder from before accelerate was replaced, so those calls run whole; every
    hook stays in place after the call and after restore. Tiling and slicing still split."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Double(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    def cast(p):
        p.vae.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)

    def user_hooks(p):
        HookRegistry.check_if_exists_or_initialize(p.vae.decoder).register_hook(Double(), "double")
        HookRegistry.check_if_exists_or_initialize(p.vae.decoder.conv_in).register_hook(Double(), "double")
        p.vae.decoder.mid_block.register_forward_hook(lambda m, a, out: seen.append(out.shape))

    def hooks(vae):
        return {
            name: (m.__dict__.get("forward"), dict(getattr(m, "_diffusers_hook", None).hooks))
            for name, m in vae.named_modules()
            if hasattr(m, "_diffusers_hook")
        }

    z = torch.randn(2, 16, 8, 10, generator=torch.Generator().manual_seed(1))
    layout = ParallelConfig(ulysses=dist.get_world_size())
    seen = []
    for setup, split in ((cast, False), (user_hooks, False), (lambda p: p.vae.enable_slicing(), True)):
        plain = omni_accel.tiny_flux_pipeline(seed=0)
        setup(plain)
        with torch.no_grad():
            want = plain.vae.decode(z).sample
        plain_seen, seen[:] = list(seen), []
        for after in (False, True):
            pipe = omni_accel.tiny_flux_pipeline(seed=0)
            if not after:
                setup(pipe)
                before = hooks(pipe.vae)
            omni_accel.accelerate(pipe, parallel=layout)
            row_split = pipe.vae.decoder.forward
            if after:
                setup(pipe)
                before = hooks(pipe.vae)
            ready = hooks(pipe.vae)
            with torch.no_grad():
                got = pipe.vae.decode(z).sample
            assert seen == plain_seen and hooks(pipe.vae) == ready, (setup, after)
            assert row_split.calls == (2 if split else 0), (setup, after)  # slicing: one call per sample
            assert (got - want).abs().max() <= (1e-5 if split else 0), (setup, after)
            report = str(omni_accel.describe(pipe))  # what ran, read at describe time
            runs = "2 calls split over the ranks by rows" if split else "1 calls ran whole on every rank ("
            assert f"vae decoder: {runs}" in report, (setup, after, report)
            if setup is not cast:  # (a layerwise-cast VAE's copy fails in plain Diffusers too)
                twin = copy.deepcopy(pipe.vae)  # the copy splits its own decoder, and keeps its hooks
                with torch.no_grad():
                    assert torch.equal(twin.decode(z).sample, got), (setup, after)
                assert seen == 2 * plain_seen and row_split.calls == (2 if split else 0), (setup, after)
                seen[:] = []
            omni_accel.restore(pipe)
            with torch.no_grad():
                assert torch.equal(pipe.vae.decode(z).sample, want), (setup, after)
            assert hooks(pipe.vae) == before, (setup, after)
            seen[:] = []


def _vae_coder_replaced() -> None:
    """A decoder put in ``pipe.vae.decoder`` after accelerate runs as in Diffusers, and describe says so
    rather than the split decoder's line and counts; the encoder, still split, keeps its line."""
    call = dict(prompt="a cat", height=40, width=24, num_inference_steps=2, output_type="np")
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(ulysses=dist.get_world_size())
    )
    pipe(**call, generator=torch.Generator().manual_seed(0))
    split = pipe.vae.decoder
    for p in (plain, pipe):
        p.vae.decoder = omni_accel.tiny_flux_pipeline(seed=1).vae.decoder
    want, got = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (plain, pipe))
    assert abs(got - want).max() <= 1e-5
    vae = next(c for c in omni_accel.describe(pipe).components if c.name == "vae")
    lines = "\n".join(vae.lines())
    assert vae.mode == "patch-parallel" and "pipe.vae.decoder was replaced after accelerate" in vae.detail
    assert "encoder split over" in vae.detail and "vae decoder:" not in lines and "vae encoder:" in lines
    pipe.vae.decoder = split
    assert "vae decoder: 1 calls split" in str(omni_accel.describe(pipe))
    omni_accel.restore(pipe)
    assert "forward" not in split.__dict__


def _sibling_of_the_pairing_class(true_cfg: dict) -> None:
    """type(pipe).from_pipe(pipe) under cfg=2: Diffusers builds the sibling from the class the pairing gives
    the pipeline, without its pairing state, and its call raised KeyError; it runs its calls unpaired (as
    FluxPipeline.from_pipe(pipe)'s does), each as plain Diffusers', and the owner still pairs its own."""
    call = dict(true_cfg, height=32, width=32, num_inference_steps=2, output_type="latent")
    want = omni_accel.tiny_flux_pipeline(seed=0)(**call, generator=torch.Generator().manual_seed(0)).images
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(cfg=2))
    sibling = type(pipe).from_pipe(pipe)
    for p in (sibling, pipe):
        got = p(**call, generator=torch.Generator().manual_seed(0)).images
        assert (got - want).abs().max() <= 1e-5, type(p)
    assert omni_accel.describe(pipe).components[0].cfg.paired_calls == 2
    omni_accel.restore(pipe)


def _vae_shared_with_a_sibling() -> None:
    """A from_pipe sibling accelerated under a layout, or without one, shares the VAE's split as it shares the
    transformer (a second split over the first ran every call whole): both pipelines' decodes split, and
    restoring them in either order leaves the VAE as Diffusers made it. A deep copy of the sibling alone
    restores its own copy."""
    from diffusers import FluxPipeline

    from omni_accel.forward_hooks import installed
    from omni_accel.parallel.vae import RowSplit

    call = dict(prompt="a cat", height=40, width=24, num_inference_steps=2, output_type="np")
    want = omni_accel.tiny_flux_pipeline(seed=0)(**call, generator=torch.Generator().manual_seed(0)).images
    layout = ParallelConfig(ulysses=dist.get_world_size())
    for sibling_options, owner_first in (({"parallel": layout}, True), ({}, False)):
        pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=layout)
        sibling = omni_accel.accelerate(FluxPipeline.from_pipe(pipe), **sibling_options)
        split = pipe.vae.decoder.forward
        for p in (pipe, sibling):
            assert abs(p(**call, generator=torch.Generator().manual_seed(0)).images - want).max() <= 1e-5
        assert split.calls == 2 and not split.whole, split.whole
        vae = next(c for c in omni_accel.describe(sibling).components if c.name == "vae")
        lines = "\n".join(vae.lines())
        assert vae.mode == "patch-parallel (shared)" and "vae decoder: 2 calls split" in lines
        with pytest.raises(ValueError, match="vae_parallel=False cannot keep pipe.vae"):
            omni_accel.accelerate(FluxPipeline.from_pipe(pipe), vae_parallel=False)
        twin = copy.deepcopy(sibling)  # a copy of the sibling alone owns its copies, their split too
        assert abs(twin(**call, generator=torch.Generator().manual_seed(0)).images - want).max() <= 1e-5
        vae = next(c for c in omni_accel.describe(twin).components if c.name == "vae")
        assert vae.mode == "patch-parallel" and "vae decoder: 1 calls split" in "\n".join(vae.lines())
        omni_accel.restore(twin)
        assert "forward" not in twin.vae.decoder.__dict__ and "forward" not in twin.vae.encoder.__dict__
        assert split.calls == 2 and installed(pipe.vae.decoder, RowSplit) is split
        omni_accel.restore(pipe if owner_first else sibling)
        if owner_first:
            vae = next(c for c in omni_accel.describe(sibling).components if c.name == "vae")
            assert vae.mode == "untouched" and "has since restored it" in vae.detail
        omni_accel.restore(sibling if owner_first else pipe)
        assert "forward" not in pipe.vae.decoder.__dict__ and "forward" not in pipe.vae.encoder.__dict__


def _users_compile_under_a_layout() -> None:
    """A user's Module.compile() of a transformer split by a layout traced Diffusers' forward of its native
    blocks on one rank's share of the sequence (ulysses: 3% off, silently) or of the weights (tp: a Dynamo
    shape error); it raises, saying why and what to do."""
    torch._dynamo.reset()
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(ulysses=2))
    pipe.transformer.compile(backend="eager")
    with pytest.raises(RuntimeError, match="a torch.compile of the user's own .* pass compile=True"):
        _latents(pipe, num_inference_steps=1)
    omni_accel.restore(pipe)


def _graph_keys_under_a_layout() -> None:
    """Our layout hooks let a step be keyed for a CUDA graph (a user's hook still does not), and the key
    holds every rank's slice: 13 and 12 text tokens give rank 1 the same local shape (6 tokens), so a key
    on shapes alone would replay the 13-token graph, with its uneven all-to-alls, for 12 tokens."""
    from omni_accel import cuda_graphs

    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    omni_accel.accelerate(pipe, parallel=ParallelConfig(ulysses=2), cuda_graphs=True)
    assert (
        "replayed from CUDA graphs" if torch.cuda.is_available() else "no step can run on CUDA here"
    ) in str(omni_accel.describe(pipe))
    keys, eager_reason = [], cuda_graphs._eager_reason

    def spy(module, leaves):
        keys.append(cuda_graphs.step_key(module, leaves, None))
        return eager_reason(module, leaves)  # on CPU: runs eagerly, counted

    _latents(pipe, num_inference_steps=1)  # packs the projections: the keys after it are the ones graphs use
    cuda_graphs._eager_reason = spy
    try:
        for text in (13, 12):
            _latents(pipe, max_sequence_length=text, num_inference_steps=1)
        handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *a: None)
        _latents(pipe, num_inference_steps=1)
        handle.remove()
    finally:
        cuda_graphs._eager_reason = eager_reason
    assert keys[0] is not None and keys[1] is not None and keys[0] != keys[1]
    assert keys[2] is None, "a user's hook decides per call: no graph"
    # destroying the process group frees the graphs first (captured NCCL operations would block it)
    assert hasattr(dist.destroy_process_group, "__wrapped__")
    cache = omni_accel.describe(pipe).components[0].cache
    hits_group = cache._group  # the gloo group the ranks decide the cache's hits over
    assert dist.get_backend(hits_group) == "gloo"
    omni_accel.restore(pipe)
    assert not hasattr(dist.destroy_process_group, "__wrapped__")
    assert cache._group is None
    with pytest.raises(ValueError):  # destroyed with the layout, not left to outlive it
        dist.get_backend(hits_group)


def _modulation_split_over_the_ranks() -> None:
    """The AdaLN modulation of every block (a quarter of FLUX's parameters) is computed once per forward,
    each rank its half of every output, gathered in one collective: under tp=2 from the weights' halves the
    rank holds, under ulysses=2 and ring=2 from rows of the whole weights; LoRA on those linears too. Within
    1e-5 of one rank; and a tiny ``SplitModulation`` with widths the ranks split unevenly is one rank's."""
    from omni_accel.layers import split_modulation
    from omni_accel.layers.projection import apply_one, read_linear
    from omni_accel.parallel.tensor import shard_of

    modulations = ["norm1.linear", "norm1_context.linear", "norm.linear"]
    lora = random_lora(omni_accel.tiny_flux_pipeline(seed=0).transformer, modulations, seed=5)

    def run(layout):
        pipe = omni_accel.tiny_flux_pipeline(seed=0)
        pipe.load_lora_weights(lora, adapter_name="mod")
        omni_accel.accelerate(pipe, parallel=layout)
        return pipe, _latents(pipe)

    _, want = run(None)
    gathers = []
    with _counted(split_modulation, "all_gather_dim", gathers):
        for layout in (ParallelConfig(tp=2), ParallelConfig(ulysses=2), ParallelConfig(ring=2)):
            gathers.clear()
            pipe, got = run(layout)
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, layout
            split = pipe.transformer.transformer_blocks[0].omni_runtime.modulation
            # 2 prompts x 2 steps, guidance-distilled: one transformer call per step
            assert split.passes == len(gathers) == 2, (layout, split.passes, len(gathers))
            assert "modulation: 6 AdaLN projections per forward computed together, each rank 1/2" in str(
                omni_accel.describe(pipe)
            )
            blocks = pipe.transformer.transformer_blocks[0], pipe.transformer.single_transformer_blocks[0]
            for linear in (blocks[0].norm1.linear, blocks[0].norm1_context.linear, blocks[1].norm.linear):
                split_weights = shard_of(linear.get_base_layer()) is not None
                assert split_weights == (layout.tp > 1), layout
            runtime = blocks[0].omni_runtime
            omni_accel.restore(pipe)
            assert runtime.modulation is None
    # Widths 7 and 4 over two ranks (4 + 3 and 2 + 2 rows), one with a bias and a low-rank term, batch 3.
    torch.manual_seed(0)
    linears = [torch.nn.Linear(5, 7), torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(5, 7)]
    from peft import LoraConfig, inject_adapter_in_model

    holder = torch.nn.ModuleList(linears)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], init_lora_weights=False), holder)
    sites = [
        split_modulation.ModulationSite(f"m{i}", lambda i=i: holder[i], torch.nn.functional.silu)
        for i in range(3)
    ]
    split = split_modulation.SplitModulation(sites, dist.group.WORLD)
    conditioning = torch.randn(3, 5)
    with torch.no_grad():
        for i in range(3):
            want = apply_one(torch.nn.functional.silu(conditioning), read_linear(holder[i], "m"))
            assert torch.allclose(split.project(f"m{i}", conditioning), want, rtol=0, atol=1e-6), i
        assert split.passes == 1
        conditioning.add_(1)  # changed in place: projected again
        split.project("m0", conditioning)
    assert split.passes == 2
    with torch.inference_mode():  # a tensor without a version counter
        conditioning = torch.randn(3, 5)
        split.project("m0", conditioning), split.project("m1", conditioning)
    assert split.passes == 3


def _bf16_as_accurate_as_one_rank(run, *layouts: ParallelConfig) -> None:
    """``run(dtype, layout)`` in bf16 under each layout is as close to its float64 run as one rank in bf16
    is: a layout sums in another order (or, stacking the guidance calls, hands the kernels another batch),
    never in a lower precision. So a bf16 layout's distance from one rank (5-7 % for Wan's ring and tp after
    two steps of a random 14B model on GPUs) is rounding amplified by the model, not an error."""
    exact = run(torch.float64, None)

    def error(out: torch.Tensor) -> float:
        return ((out - exact).abs().max() / exact.abs().max()).item()

    one = error(run(torch.bfloat16, None))
    for layout in layouts:
        got = error(run(torch.bfloat16, layout))
        assert got <= 1.25 * one, f"{layout} in bf16: {got:.2e} from float64, one rank {one:.2e}"


def _small_wan(dtype: torch.dtype, layout: ParallelConfig | None):
    """In bf16 as ``from_pretrained(torch_dtype=...)`` gives it (its float32 modules and RoPE tables kept:
    a ``.to(torch.bfloat16)`` would rotate in bf16, as Diffusers then does); the float64 reference whole."""
    shape = dict(seed=0, num_layers=8, num_attention_heads=4, attention_head_dim=32)
    if dtype == torch.float64:
        pipe = omni_accel.tiny_wan_pipeline(**shape).to(dtype=dtype)
    else:
        pipe = omni_accel.tiny_wan_pipeline(**shape, dtype=dtype)
    return omni_accel.accelerate(pipe, parallel=layout)


def _wan_forward(dtype: torch.dtype, layout: ParallelConfig | None) -> torch.Tensor:
    from test_wan_native import wan_inputs

    pipe = _small_wan(dtype, layout)
    x = wan_inputs(pipe.transformer, batch=1, frames=5, side=16, text=7)
    x = {name: t if name == "timestep" else t.to(dtype) for name, t in x.items()}
    with torch.no_grad():
        return pipe.transformer(**x, return_dict=False)[0].double()


def _wan_guided_latents(dtype: torch.dtype, layout: ParallelConfig | None) -> torch.Tensor:
    """Two steps with guidance: under a layout the two calls of each step stack in one batch."""
    pipe = _small_wan(dtype, layout)
    video = dict(prompt="a cat", negative_prompt="blurry", height=32, width=32, num_frames=5)
    out = pipe(
        **video, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0)
    )
    assert layout is None or "2 cond/uncond pairs in one call" in str(omni_accel.describe(pipe))
    return out.frames.double()


def _step_caches_under_layouts(video: dict, one) -> None:
    """Diffusers' first-block cache gives what it gives on one GPU under every layout: under cfg=2 each
    rank runs a branch whole; where the tokens are split, its decision is made on every rank's tokens
    (the guidance calls then run apart, each in its cache context). MagCache decides alike on every rank
    without help; calibrating, it would measure one rank's tokens, so it is refused there. TaylorSeer on the
    attention modules decides from the step count: native under ulysses, ring and tp."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    cached = dict(video, num_inference_steps=6)
    plain = omni_accel.tiny_wan_pipeline(seed=0)
    uncached = plain(**cached, generator=torch.Generator().manual_seed(0)).frames
    plain.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    expected = plain(**cached, generator=torch.Generator().manual_seed(0)).frames
    assert not torch.equal(expected, uncached)  # the cache skipped blocks on some steps
    for layout in (
        ParallelConfig(cfg=2),
        ParallelConfig(ulysses=2),
        ParallelConfig(ring=2),
        ParallelConfig(tp=2),
    ):
        pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), parallel=layout)
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
        got = pipe(**cached, generator=torch.Generator().manual_seed(0)).frames
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5, layout
        if layout.cfg == 1:
            assert "12 calls alone (a step cache" in str(omni_accel.describe(pipe)), layout
        pipe.transformer.disable_cache()
        again = pipe(**video, generator=torch.Generator().manual_seed(0)).frames
        assert ((again - one).abs().max() / one.abs().max()).item() <= 1e-5, layout
    # FLUX (its tokens split before the blocks), blocks skipped too
    call = dict(prompt="a cat", height=32, width=48, num_inference_steps=6, max_sequence_length=13)
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    plain.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    expected = _latents(plain, **call)
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(ulysses=2))
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    got = _latents(pipe, **call)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    assert not torch.equal(expected, _latents(omni_accel.tiny_flux_pipeline(seed=0), **call))
    # TaylorSeer (on the attention modules) decides from the step count alone: the native blocks run its
    # hook around their attention part on every rank, each recording and predicting its own share
    taylor = dict(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    plain.transformer.enable_cache(TaylorSeerCacheConfig(**taylor))
    expected = _latents(plain, **call)
    for layout in (ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(tp=2)):
        pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=layout)
        pipe.transformer.enable_cache(TaylorSeerCacheConfig(**taylor))
        got = _latents(pipe, **call)
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5, layout
        assert not omni_accel.describe(pipe).components[0].runtime.fallbacks, layout

    # MagCache decides from its ratios and the step count: alike on every rank (not while calibrating)
    def magcache(calibrate: bool = False) -> MagCacheConfig:
        ratios = None if calibrate else [1.0, 0.9, 0.8, 0.8, 0.8, 0.8]
        return MagCacheConfig(
            threshold=0.5, num_inference_steps=6, mag_ratios=ratios, retention_ratio=0.2, calibrate=calibrate
        )

    plain = omni_accel.tiny_wan_pipeline(seed=0)
    plain.transformer.enable_cache(magcache())
    expected = plain(**cached, generator=torch.Generator().manual_seed(0)).frames
    assert not torch.equal(expected, uncached)
    pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), parallel=ParallelConfig(ulysses=2))
    pipe.transformer.enable_cache(magcache())
    got = pipe(**cached, generator=torch.Generator().manual_seed(0)).frames
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    pipe.transformer.disable_cache()
    pipe.transformer.enable_cache(magcache(calibrate=True))
    with pytest.raises(RuntimeError, match=r"blocks.0 has Diffusers step-cache hooks"):
        pipe(**video, generator=torch.Generator().manual_seed(0))
    _first_block_cache_decides_on_every_rank()
    # a forward that raises leaves no layout in flight for a later forward's cache to sum over
    from omni_accel.parallel.sequence_hooks import token_groups

    def fail(module, args):
        raise KeyError("raised inside the forward")

    handle = pipe.transformer.blocks[1].register_forward_pre_hook(fail)
    pipe.transformer.disable_cache()
    with pytest.raises(KeyError, match="raised inside the forward"):
        pipe(**video, generator=torch.Generator().manual_seed(0))
    handle.remove()
    assert token_groups() is None


def _user_hook_on_the_output_sees_every_token(video: dict) -> None:
    """A user's own hooks run under a layout: one registered on the output projection after accelerate
    stays outside the layout's gather (as on one GPU it sees every token); one on the first block sees this
    rank's tokens (the layout's split stays outside it, so its input and output agree)."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Shapes(ModelHook):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def post_forward(self, module, output):
            self.seen.append(output.shape[1])
            return output

    one, two = (omni_accel.tiny_wan_pipeline(seed=0) for _ in range(2))
    omni_accel.accelerate(two, parallel=ParallelConfig(ulysses=2))
    hooks = []
    for pipe in (one, two):
        out, first = Shapes(), Shapes()
        HookRegistry.check_if_exists_or_initialize(pipe.transformer.proj_out).register_hook(out, "user")
        HookRegistry.check_if_exists_or_initialize(pipe.transformer.blocks[0]).register_hook(first, "user")
        pipe(**video, generator=torch.Generator().manual_seed(0))
        hooks.append((out.seen, first.seen))
    (out_one, first_one), (out_two, first_two) = hooks
    assert out_two == out_one  # every token, as on one GPU
    assert all(mine < whole for mine, whole in zip(first_two, first_one, strict=True)), (first_two, first_one)


def _first_block_cache_decides_on_every_rank() -> None:
    """The ranks' halves would decide apart (rank 0's residual unchanged, rank 1's changed); summed over
    the ranks, both take the whole sequence's decision."""
    from diffusers.hooks import first_block_cache
    from diffusers.hooks.hooks import CacheContext, StateManager

    from omni_accel import patches
    from omni_accel.parallel import sequence_hooks
    from omni_accel.parallel.sequence_hooks import SequenceState

    patches.apply("first_block_cache_over_ranks", "diffusers.hooks.first_block_cache")
    try:
        hook = first_block_cache.FBCHeadBlockHook(StateManager(first_block_cache.FBCSharedBlockState), 0.5)
        hook.state_manager.set_context(CacheContext("cond"))
        hook.state_manager.get_state().head_block_residual = torch.ones(1, 4, 2)
        residual = torch.ones(1, 4, 2) * (1.0 if dist.get_rank() == 0 else 3.0)
        alone = hook._should_compute_remaining_blocks(residual)  # no token split in flight: this rank's
        sequence_hooks._FORWARD.state = SequenceState(dist.group.WORLD, None)
        together = hook._should_compute_remaining_blocks(residual)
    finally:
        sequence_hooks._FORWARD.state = None
        patches.revert("first_block_cache_over_ranks", "diffusers.hooks.first_block_cache")
    assert alone == (dist.get_rank() == 1) and together  # summed: 16 / 16 = 1.0 > 0.5


def _flux_with_lora(layout: ParallelConfig | None, heads: int = 3) -> torch.Tensor:
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=heads, attention_head_dim=16)
    pipe.load_lora_weights(
        random_lora(pipe.transformer, ["to_q", "to_v", "proj_mlp"], seed=3), adapter_name="a"
    )
    return _latents(omni_accel.accelerate(pipe, parallel=layout))


@contextlib.contextmanager
def _counted(module, name: str, calls: list) -> Iterator[None]:
    """``module.name`` appending each call's positional arguments to ``calls``."""
    original = getattr(module, name)

    def counted(*args):
        calls.append(args)
        return original(*args)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, original)


def _layouts_by_peer_writes() -> None:
    """ring=2, ulysses=2 and tp=2 by peer writes in whole models, each rank's buffers shared files (as the
    GPUs' symmetric memory), within 1e-5 of one rank. The blocks' kernels (here their references) write
    where the exchanges want: q/k/v of the ring's K/V into its buffers (FLUX's single blocks then attend in
    one kernel beside the MLP's GEMM, its double blocks and Wan's attend the local block first), each head
    group into the buffer of the Ulysses rank that attends over it, and under tp the norm-modulate's rows
    into every rank's buffer of the gather before the column-split projections (the double blocks' image
    and text exchanges ending together)."""
    from test_sequence_parallel import peer_writes_over_files

    from omni_accel.layers import fused, projection

    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    one = _wan_forward(torch.float32, None)
    lora_one = {heads: _flux_with_lora(None, heads) for heads in (3, 4)}
    ring_calls, ulysses_calls, gathers, gathers_ended, sums_ended = [], [], [], [], []
    with (
        peer_writes_over_files(directory[0]) as made,
        _counted(PeerRing, "circulate", ring_calls),
        _counted(SequenceParallel, "_ulysses_placed", ulysses_calls),
        _counted(fused, "gather_targets", gathers),
        _counted(fused, "gathered_together", gathers_ended),
        _counted(projection, "sum_together", sums_ended),
    ):
        for layout in (ParallelConfig(ring=2), ParallelConfig(ulysses=2), ParallelConfig(tp=2)):
            heads = 4 if layout.tp > 1 else 3  # Ulysses splits 3 heads unevenly
            _check(layout, _oracle(heads=heads), heads=heads)
            wan = _wan_forward(torch.float32, layout)
            assert ((wan - one).abs().max() / one.abs().max()).item() <= 1e-5, layout
            lora = _flux_with_lora(layout, heads)  # adapters on both GEMMs the single blocks split
            want = lora_one[heads]
            assert ((lora - want).abs().max() / want.abs().max()).item() <= 1e-5, layout
        # Ulysses placed in two head stages, as at Wan 14B's length
        staged = LayoutTuning(placed_stages_from=1)
        wan = _wan_forward(torch.float32, ParallelConfig(ulysses=2, tuning=staged))
        assert ((wan - one).abs().max() / one.abs().max()).item() <= 1e-5
        assert any(args[1].later for args in ulysses_calls), "no call placed in two head stages"
        default_ring = list(ring_calls)
        # the tuning's other ways, each exact: packed inputs, one head stage, NCCL-style collectives
        for tuning in (
            LayoutTuning(place_inputs=False),
            LayoutTuning(head_stages=1),
            LayoutTuning(peer_writes=False),
        ):
            placed_before, ring_before = len(ulysses_calls), len(ring_calls)
            for layout in (ParallelConfig(ulysses=2, tuning=tuning), ParallelConfig(ring=2, tuning=tuning)):
                wan = _wan_forward(torch.float32, layout)
                assert ((wan - one).abs().max() / one.abs().max()).item() <= 1e-5, layout
            by_peers = ring_calls[ring_before:]
            placed = len(ulysses_calls) - placed_before + sum(bool(args[4]) for args in by_peers)
            assert (placed > 0) == (tuning.place_inputs and tuning.peer_writes), tuning
            assert bool(by_peers) == tuning.peer_writes, tuning
    assert made and ring_calls and ulysses_calls and gathers
    assert all(args[4] for args in default_ring), "the ring took K/V not written in place"  # placed
    # FLUX's single blocks: the GELU beside the outputs' return, which lands in the projection's input
    assert any(args[3].then is not None and args[3].out is not None for args in ulysses_calls)
    # FLUX's double blocks under tp: the image and text streams' exchanges end behind one barrier
    assert any(len(args[0]) == 2 for args in gathers_ended) and any(len(args[0]) == 2 for args in sums_ended)
    # compiled (no spy in the traced code: a list growing there recompiles), new buffers
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    with (
        peer_writes_over_files(directory[0]),
        _counted(PeerRing, "circulate", ring_calls),
        _counted(SequenceParallel, "_ulysses_placed", ulysses_calls),
    ):
        placed = _compiled_by_peer_writes(ulysses_calls, ring_calls)
    assert placed == [True, True], "compiled blocks did not place q, k and v"


def _compiled_by_peer_writes(ulysses_calls: list, ring_calls: list) -> list[bool]:
    """ulysses=2 and ring=2 by peer writes, compiled: the q/k kernel and attention as one op that places
    q, k and v, still one graph per block class, no graph break, within 1e-5 of one rank. Returns, per
    layout, whether the placed exchange ran (``ulysses_calls``/``ring_calls``: the spies' records)."""
    oracle, placed = _oracle(heads=3), []
    for layout in (ParallelConfig(ulysses=2), ParallelConfig(ring=2)):
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        ulysses_calls.clear()
        ring_calls.clear()
        pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=3, attention_head_dim=16)
        omni_accel.accelerate(
            pipe, parallel=layout, compile={"backend": "aot_eager"}, compile_in_background=False
        )
        got = _latents(pipe)
        assert ((got - oracle).abs().max() / oracle.abs().max()).item() <= 1e-5, f"{layout} compiled"
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        assert graphs == 2 and not breaks, f"{layout}: {graphs} graphs, {breaks}"
        calls = ulysses_calls if layout.ulysses > 1 else [args for args in ring_calls if args[4]]
        placed.append(bool(calls))
    return placed


def _training_mode_under_a_layout(oracle: torch.Tensor) -> None:
    """A transformer built from a config is in training mode; with no active dropout and grad off its
    sharded blocks run natively (the refusal is kept for gradients)."""
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=2, attention_head_dim=16)
    pipe.transformer.train()
    omni_accel.accelerate(pipe, parallel=ParallelConfig(ulysses=2))
    got = _latents(pipe)
    assert ((got - oracle).abs().max() / oracle.abs().max()).item() <= 1e-5
    cfg = pipe.transformer.config
    inputs = {
        "hidden_states": torch.randn(2, 60, cfg.in_channels, requires_grad=True),
        "encoder_hidden_states": torch.randn(2, 13, cfg.joint_attention_dim),
        "pooled_projections": torch.randn(2, cfg.pooled_projection_dim),
        "timestep": torch.ones(2),
        "img_ids": torch.zeros(60, 3),
        "txt_ids": torch.zeros(13, 3),
    }
    with pytest.raises(RuntimeError, match=r"cannot run natively \(gradients enabled"):
        pipe.transformer(**inputs)


def _a_failed_spread_is_undone() -> None:
    """An error in the layout's last steps (here the VAE's split) undoes the steps before it, the
    transformer's spread and the cond/uncond pairing included: the pipeline is Diffusers' again, and
    accelerates afterwards."""
    from omni_accel.api import spread

    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    want = {name: p.clone() for name, p in pipe.transformer.state_dict().items()}
    call, original = type(pipe).__call__, spread.split_vae

    def failing(*args):
        raise RuntimeError("split refused")

    spread.split_vae = failing
    try:
        with pytest.raises(RuntimeError, match="split refused"):
            omni_accel.accelerate(pipe, parallel=ParallelConfig(tp=2))
    finally:
        spread.split_vae = original
    assert type(pipe.transformer.transformer_blocks[0]).__name__ == "FluxTransformerBlock"
    assert type(pipe).__call__ is call and not pipe.transformer._forward_hooks
    registry = getattr(pipe.transformer, "_diffusers_hook", None)
    assert registry is None or not registry._hook_order, "hooks left behind"
    got = pipe.transformer.state_dict()
    assert all(torch.equal(got[name], p) for name, p in want.items()), "weights left sharded"
    omni_accel.accelerate(pipe, parallel=ParallelConfig(tp=2))
    omni_accel.restore(pipe)


def _a_failed_auto_spread_is_undone_and_retried() -> None:
    """``parallel="auto"`` spreads at the first call: an error there undoes the spread and the call raises;
    the next call tries again, and then runs as the layout it chose."""
    from omni_accel.api import spread

    groups = _live_groups()
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel="auto")

    def hooks() -> list[str]:  # every Diffusers hook on the transformer and its submodules
        registries = [getattr(m, "_diffusers_hook", None) for m in pipe.transformer.modules()]
        return [name for r in registries if r is not None for name in r._hook_order]

    before = hooks()
    original = spread.split_vae

    def failing(*args):
        raise RuntimeError("split refused")

    spread.split_vae = failing
    try:
        with pytest.raises(RuntimeError, match="split refused"):
            _latents(pipe, num_inference_steps=1)
    finally:
        spread.split_vae = original
    assert hooks() == before, "layout hooks left behind"
    assert _live_groups() == groups, "the failed layout's process groups left behind"
    assert "chosen at the first call" not in str(omni_accel.describe(pipe))
    got = _latents(pipe, num_inference_steps=1)
    assert "chosen at the first call" in str(omni_accel.describe(pipe)) and hooks() != before
    gathered = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, got)
    assert all(torch.equal(x, gathered[0]) for x in gathered)
    omni_accel.restore(pipe)
    assert _live_groups() == groups, "restore left process groups behind"


def _true_cfg_without_cache_context() -> None:
    """FLUX img2img makes its true-CFG calls outside any cache_context (Diffusers 0.42): paired by order."""
    from diffusers import FluxImg2ImgPipeline

    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    call = dict(
        prompt="a cat",
        negative_prompt="dark",
        true_cfg_scale=3.0,
        image=image,
        strength=0.7,
        num_inference_steps=3,
    )

    def img2img():
        return FluxImg2ImgPipeline(**omni_accel.tiny_flux_pipeline(seed=0).components)

    want = _latents(img2img(), **call)
    for layout, expect in (
        (ParallelConfig(cfg=2), "paired cond/uncond calls"),
        (ParallelConfig(ulysses=2), "cond/uncond pairs in one call, 0 pairs run one after"),
    ):
        pipe = omni_accel.accelerate(img2img(), parallel=layout)
        got = _latents(pipe, **call)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-5, f"{layout}: relative error {rel:.2e} against one rank"
        report = str(omni_accel.describe(pipe))
        assert expect in report and "calls paired by their order (no cache_context)" in report, report
        omni_accel.restore(pipe)


def _ring_needs_the_lse() -> None:
    """A provider that does not return the log-sum-exp, chosen for a site whose calls a ring merges through
    it, was accepted and failed at the first call (on one rank first, leaving the others in a collective):
    refused at accelerate now, nothing swapped, no groups left. Cross attention (over K/V every rank holds)
    may take it."""
    groups = _live_groups()
    for build, role in (
        (omni_accel.tiny_flux_pipeline, "flux.joint"),
        (omni_accel.tiny_wan_pipeline, "wan.self"),
    ):
        pipe = build(seed=0)
        blocks = dict(pipe.transformer.named_children())
        with pytest.raises(
            AttentionProviderError, match=rf"'{role}'.*Under a ring layout the calls of {role} merge"
        ):
            omni_accel.accelerate(pipe, attention="sdpa", parallel=ParallelConfig(ring=2))
        assert (
            getattr(pipe, "_omni_accel_state", None) is None
            and dict(pipe.transformer.named_children()) == blocks
        )
        assert _live_groups() == groups
    wan = omni_accel.accelerate(
        omni_accel.tiny_wan_pipeline(seed=0),
        attention={"per_role": {"cross": "sdpa"}},
        parallel=ParallelConfig(ring=2),
    )
    assert "wan.self [float32, cpu, head_dim=16, lse] -> sdpa_math" in str(omni_accel.describe(wan))
    video = dict(
        prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=1, output_type="latent"
    )
    wan(**video)
    omni_accel.restore(wan)


def _two_ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    _layouts_by_peer_writes()
    _bf16_as_accurate_as_one_rank(
        _wan_forward, ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(tp=2)
    )
    _bf16_as_accurate_as_one_rank(_wan_guided_latents, ParallelConfig(ulysses=2), ParallelConfig(tp=2))
    _pipeline_calls_from_threads(rank)
    _vae_checks()
    _vae_hooks_under_the_split()
    _vae_coder_replaced()
    _vae_shared_with_a_sibling()
    _a_failed_spread_is_undone()
    _a_failed_auto_spread_is_undone_and_retried()
    _users_compile_under_a_layout()
    _graph_keys_under_a_layout()
    _modulation_split_over_the_ranks()
    oracle = _oracle()
    _training_mode_under_a_layout(oracle)
    for layout in (ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2)):
        _check(layout, oracle)
    # tp: each rank holds half the tokens between the projections
    _check(ParallelConfig(tp=2), oracle, expect="summed after the row-split ones: gloo all-to-all")
    # with the token split tuned off (as where the exchanges would be NCCL's), every token on every rank
    _check(
        ParallelConfig(tp=2, tuning=LayoutTuning(split_tokens=False)),
        oracle,
        expect="tensor parallel tokens: every rank holds every token",
    )
    # heads not divisible by the Ulysses degree, uneven text (13) and image (60) lengths over the ranks
    _check(ParallelConfig(ulysses=2), _oracle(heads=3), heads=3, expect="ulysses exchanges: gloo all-to-all")
    _check(
        ParallelConfig(ring=2),
        _oracle(heads=3),
        heads=3,
        expect="ring transfers: gloo send/recv around the ring",
    )
    # true CFG: the pipeline calls the transformer twice per step; cfg=2 pairs the calls
    true_cfg = dict(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0)
    _check(ParallelConfig(cfg=2), _oracle(**true_cfg), expect="2 paired", **true_cfg)
    _true_cfg_without_cache_context()
    _sibling_of_the_pairing_class(true_cfg)
    # without a cfg group the two calls of a step run as one call of both branches (text ids compared)
    stacked = "guidance branches stacked in one batch: 2 cond/uncond pairs in one call, 0 pairs run one"
    for layout in (ParallelConfig(ulysses=2), ParallelConfig(tp=2)):
        _check(layout, _oracle(**true_cfg), expect=stacked, **true_cfg)
    unstacked = ParallelConfig(ring=2, batch_guidance=False)
    _check(unstacked, _oracle(**true_cfg), absent="guidance branches stacked", **true_cfg)
    _check(
        "auto", _oracle(**true_cfg), expect="ParallelConfig(tp=1, ulysses=1, ring=1, cfg=2) on 2", **true_cfg
    )
    # parallel="auto" decides at the first pipeline call: without true CFG the two ranks split the
    # sequence (Ulysses), with it they take one guidance branch each
    _check("auto", oracle, expect="ParallelConfig(tp=1, ulysses=2, ring=1, cfg=1) on 2 ranks, chosen at")
    # a batch of one without true CFG: computed on both ranks, still exact
    _check(ParallelConfig(cfg=2), _oracle(prompt="a cat"), expect="2 calls computed on both", prompt="a cat")
    # misconfigurations: clear errors, nothing swapped, no process groups left behind
    groups = _live_groups()
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=3, attention_head_dim=16)
    with pytest.raises(ValueError, match="tp=2 does not divide FLUX's 3 attention heads"):
        omni_accel.accelerate(pipe, parallel=ParallelConfig(tp=2))
    assert type(pipe.transformer).__name__ == "FluxTransformer2DModel"
    with pytest.raises(ValueError, match="spans 4 ranks, but 2 were started"):
        omni_accel.accelerate(pipe, parallel=ParallelConfig(tp=2, ulysses=2))
    assert _live_groups() == groups
    _ring_needs_the_lse()
    # the Wan pipeline over ulysses=2 (its video tokens split inside the model) gives the one-rank video
    video = dict(
        prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="latent"
    )
    one = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))(
        **video, generator=torch.Generator().manual_seed(0)
    )
    wan = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), parallel=ParallelConfig(ulysses=2))
    two = wan(**video, generator=torch.Generator().manual_seed(0))
    assert ((two.frames - one.frames).abs().max() / one.frames.abs().max()).item() <= 1e-5
    assert "2 cond/uncond pairs in one call" in str(omni_accel.describe(wan))  # Wan's CFG calls stacked
    _step_caches_under_layouts(video, one.frames)
    _user_hook_on_the_output_sees_every_token(video)
    # parallel="auto": Wan's default call runs both guidance branches, so they go to the two ranks
    wan = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0), parallel="auto")
    assert "decided at the first pipeline call" in str(omni_accel.describe(wan))
    auto = wan(**video, generator=torch.Generator().manual_seed(0))
    report = str(omni_accel.describe(wan))
    assert "ParallelConfig(tp=1, ulysses=1, ring=1, cfg=2)" in report
    assert "vae (AutoencoderKLWan): patch-parallel - decoder and encoder split" in report
    assert ((auto.frames - one.frames).abs().max() / one.frames.abs().max()).item() <= 1e-5
    # Wan I2V over ulysses=2: the conditioning video goes through the split encoder, the image K/V through
    # every rank's cross-attention; the one-rank latents
    import numpy as np
    from PIL import Image

    image = Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype("uint8"))
    i2v = dict(image=image, height=32, width=32, num_frames=5, num_inference_steps=2, output_type="latent")

    def image_to_video(**options):
        pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, image_to_video=True), **options)
        g = torch.Generator().manual_seed(5)  # embeddings given: the I2V prompt cleaner needs ftfy
        embeds = [torch.randn(1, 512, pipe.text_encoder.config.d_model, generator=g) for _ in range(2)]
        frames = pipe(
            **i2v,
            prompt_embeds=embeds[0],
            negative_prompt_embeds=embeds[1],
            generator=torch.Generator().manual_seed(0),
        ).frames
        return frames, pipe

    (one, _), (two, pipe) = image_to_video(), image_to_video(parallel=ParallelConfig(ulysses=2))
    assert ((two - one).abs().max() / one.abs().max()).item() <= 1e-5
    assert pipe.vae.encoder.forward.calls > 0  # the encoder ran split
    assert "2 cond/uncond pairs in one call" in str(omni_accel.describe(pipe))  # image embeddings stacked
    # Wan VACE: its calls pair under cfg=2 as Wan's do (control blocks and all)
    from test_wan_native import vace_call

    def vace(**options):
        pipe = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, vace=True), **options)
        return pipe(**vace_call(pipe), generator=torch.Generator().manual_seed(0)).frames, pipe

    (one, _), (two, pipe) = vace(), vace(parallel=ParallelConfig(cfg=2))
    assert ((two - one).abs().max() / one.abs().max()).item() <= 1e-5
    assert "2 paired" in str(omni_accel.describe(pipe))
    # ... and stack in one batch under ulysses (the control video stacked with the latents)
    two, pipe = vace(parallel=ParallelConfig(ulysses=2))
    assert ((two - one).abs().max() / one.abs().max()).item() <= 1e-5
    assert "2 cond/uncond pairs in one call, 0 pairs run one" in str(omni_accel.describe(pipe))
    # Wan 2.2's two experts each stack their own steps' calls
    experts = dict(video, num_inference_steps=4)
    one = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, two_experts=True))(
        **experts, generator=torch.Generator().manual_seed(0)
    )
    pipe = omni_accel.accelerate(
        omni_accel.tiny_wan_pipeline(seed=0, two_experts=True), parallel=ParallelConfig(ulysses=2)
    )
    two = pipe(**experts, generator=torch.Generator().manual_seed(0))
    assert ((two.frames - one.frames).abs().max() / one.frames.abs().max()).item() <= 1e-5
    stacked = [c.cfg.stacked_calls for c in omni_accel.describe(pipe).components if c.cfg is not None]
    assert len(stacked) == 2 and sum(stacked) == 4 and all(stacked), stacked
    with pytest.raises(
        ValueError, match="and SD3Transformer2DModel has neither; use cfg for it .*, or run it"
    ):
        omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0), parallel=ParallelConfig(ulysses=2))


def _hybrids_by_peer_writes() -> None:
    """tp=2 x ulysses=2 and ulysses=4 by peer writes over shared files: q, k and v placed by the q/k
    kernel (its reference here) within each Ulysses group, of the TP rank's heads, and the gathers written
    by the norm-modulate; within 1e-5 of one rank (Wan under tp keeps its q/k norm apart, so its Ulysses
    packs)."""
    from test_sequence_parallel import peer_writes_over_files

    from omni_accel.layers import fused

    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    oracle, one = _oracle(heads=4), _wan_forward(torch.float32, None)
    placed, gathers = [], []
    with (
        peer_writes_over_files(directory[0]) as made,
        _counted(SequenceParallel, "_ulysses_placed", placed),
        _counted(fused, "gather_targets", gathers),
    ):
        for layout in (ParallelConfig(tp=2, ulysses=2), ParallelConfig(ulysses=4)):
            _check(layout, oracle, heads=4)
        wan = _wan_forward(torch.float32, ParallelConfig(tp=2, ulysses=2))
    assert ((wan - one).abs().max() / one.abs().max()).item() <= 1e-5
    assert made and placed and gathers


def _four_ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    _hybrids_by_peer_writes()
    _bf16_as_accurate_as_one_rank(
        _wan_forward, ParallelConfig(ulysses=4), ParallelConfig(ring=4), ParallelConfig(ulysses=2, ring=2),
        ParallelConfig(tp=2, ulysses=2), ParallelConfig(tp=4),
    )  # fmt: skip
    _vae_checks()
    # Wan's guidance calls stacked over a hybrid (tokens split by Ulysses, then by the TP group)
    video = dict(
        prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="latent"
    )
    one = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0))(
        **video, generator=torch.Generator().manual_seed(0)
    ).frames
    wan = omni_accel.accelerate(
        omni_accel.tiny_wan_pipeline(seed=0), parallel=ParallelConfig(tp=2, ulysses=2)
    )
    got = wan(**video, generator=torch.Generator().manual_seed(0)).frames
    assert ((got - one).abs().max() / one.abs().max()).item() <= 1e-5
    assert "2 cond/uncond pairs in one call" in str(omni_accel.describe(wan))
    oracle = _oracle()
    for layout in (
        ParallelConfig(tp=2, ulysses=2),
        ParallelConfig(ulysses=2, ring=2),
        ParallelConfig(cfg=2, ulysses=2),
        ParallelConfig(ulysses=4),
    ):
        _check(layout, oracle)
    true_cfg = dict(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0)
    _check(ParallelConfig(cfg=2, ring=2), _oracle(**true_cfg), expect="2 paired", **true_cfg)
    # hybrids compiled: still one graph per block class, no graph break
    for layout in (ParallelConfig(tp=2, ulysses=2), ParallelConfig(ulysses=2, ring=2)):
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        pipe = omni_accel.tiny_flux_pipeline(seed=0, num_attention_heads=2, attention_head_dim=16)
        omni_accel.accelerate(pipe, parallel=layout, compile={"backend": "aot_eager"})
        got = _latents(pipe)
        assert ((got - oracle).abs().max() / oracle.abs().max()).item() <= 1e-5, f"{layout} compiled"
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        assert graphs == 2 and not breaks, f"{layout}: {graphs} graphs, {breaks}"


def _eight_ranks(rank: int, world: int) -> None:
    """Eight ranks (issue 12 on CPUs): the VAE in bands of one latent row, every kind of degree at 8, and
    hybrids of three dimensions, true CFG paired over Ulysses groups, and "auto"; bf16 as accurate as one
    rank (Ulysses over 8 ranks leaves half of them without a head of the tiny Wan's 4)."""
    torch.set_num_threads(1)
    _bf16_as_accurate_as_one_rank(
        _wan_forward,
        ParallelConfig(ulysses=8),
        ParallelConfig(ring=8),
        ParallelConfig(tp=2, ulysses=2, ring=2),
    )
    _vae_checks()
    oracle = _oracle(heads=8)
    for layout in (
        ParallelConfig(ulysses=8),
        ParallelConfig(ring=8),
        ParallelConfig(ulysses=2, ring=4),
        ParallelConfig(tp=2, ulysses=2, cfg=2),
        ParallelConfig(tp=4, ring=2),
    ):
        _check(layout, oracle, heads=8)
    true_cfg = dict(prompt="a cat", negative_prompt="dark", true_cfg_scale=3.0)
    paired = _oracle(heads=8, **true_cfg)
    _check(ParallelConfig(cfg=2, ulysses=4), paired, heads=8, expect="paired", **true_cfg)
    _check("auto", oracle, heads=8, expect="ParallelConfig(tp=1, ulysses=8, ring=1, cfg=1) on 8 ranks")


def _vae_split_as_plain_diffusers(rank: int, world: int) -> None:
    """The split VAE against plain Diffusers' VAE doing the same calls: a float64 VAE keeps float64's
    precision (the GroupNorm statistics too); a torch.compile of the VAE or a coder; a layer replaced after
    accelerate; a hook on one rank only."""
    torch.set_num_threads(1)
    layout = ParallelConfig(ulysses=world)
    plain = omni_accel.tiny_flux_pipeline(seed=0).vae.double()
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=layout)
    pipe.vae.double()
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 16, 5, 6, generator=g, dtype=torch.float64)
    x = torch.randn(2, 3, 8, 6, generator=g, dtype=torch.float64)
    with torch.no_grad():
        decoded = (pipe.vae.decode(z).sample, plain.decode(z).sample)
        encoded = (pipe.vae.encode(x).latent_dist.parameters, plain.encode(x).latent_dist.parameters)
    for got, want in (decoded, encoded):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12
    assert pipe.vae.decoder.forward.calls == 1 and pipe.vae.encoder.forward.calls == 1
    with torch.no_grad():  # fewer latent rows than ranks: whole, said without "a multiple of 1 rows"
        pipe.vae.decode(z[:, :, :1])
    assert (
        f"1 calls ran whole on every rank (1 rows: the split takes one row or more per rank, {world} in all)"
        in str(omni_accel.describe(pipe))
    )
    pipe.vae.float()
    plain = omni_accel.tiny_flux_pipeline(seed=0).vae
    # A torch.compile of the VAE or of a coder, put in their place, runs them split (the forward it compiles):
    # describe says so (not "replaced after accelerate, runs as in Diffusers", nor "split by another
    # pipeline's layout").
    vae, decoder = pipe.vae, pipe.vae.decoder
    pipe.vae.decoder = torch.compile(decoder)
    assert "vae decoder: 1 calls split" in str(omni_accel.describe(pipe))
    pipe.vae, vae.decoder = torch.compile(vae), decoder
    line = next(c for c in omni_accel.describe(pipe).components if c.name == "vae")
    assert line.mode == "patch-parallel" and "vae decoder: 1 calls split" in "\n".join(line.lines())
    pipe.vae = vae
    # A layer the split does not handle, put in after accelerate, makes the calls run whole (on its band
    # alone, a 5x5 convolution would miss its second halo row), and describe says why.
    with torch.no_grad():
        conv_in, want = decoder.conv_in, plain.decode(z.float()).sample
    for vae in (plain, pipe.vae):
        with torch.random.fork_rng():
            torch.manual_seed(1)
            vae.decoder.conv_in = torch.nn.Conv2d(16, 32, 5, padding=2)
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(z.float()).sample, plain.decode(z.float()).sample)
    assert pipe.vae.decoder.forward.calls == 1
    assert (
        "vae decoder: 1 calls ran whole on every rank (conv_in: a convolution the row split does not"
        in str(omni_accel.describe(pipe))
    )
    # A hook on one rank's decoder only (a logger on rank 0): every rank runs the call whole, rather than
    # the others waiting for halo rows from a rank that runs it whole.
    decoder.conv_in, seen = conv_in, []
    if rank == 0:
        decoder.mid_block.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(z.float()).sample, want)
    assert len(seen) == (rank == 0) and decoder.forward.calls == 1
    assert rank == 0 or "vae decoder: 1 calls ran whole on every rank (another rank runs it whole" in str(
        omni_accel.describe(pipe)
    )
    omni_accel.restore(pipe)
    _vae_inputs_differ_per_rank(rank, world)
    _vae_from_threads(world)


def _vae_inputs_differ_per_rank(rank: int, world: int) -> None:
    """Each rank's own latents or images (a seed per rank, a data-parallel encode): the split would mix the
    ranks' rows; each rank runs its own whole, as plain Diffusers does, and describe counts those calls. A video
    decoder whose first frame chunk split (its cached frames are bands) and whose later chunks differ raises."""
    plain = omni_accel.tiny_flux_pipeline(seed=0).vae
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(ulysses=world)
    )
    g = torch.Generator().manual_seed(rank)
    z, x = torch.randn(2, 16, 6, 4, generator=g), torch.randn(1, 3, 8, 8, generator=g)
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(z).sample, plain.decode(z).sample)
        want = plain.encode(x).latent_dist.parameters
        assert torch.equal(pipe.vae.encode(x).latent_dist.parameters, want)
        pipe.vae.decode(z[:, :, :, :2] if rank else z[:, :, :, 2:])  # equal shapes, different rows
        pipe.vae.decode(z[:, :, : 2 + 2 * rank])  # different shapes: gloo refused the halo exchange
    report = str(omni_accel.describe(pipe))
    assert "vae decoder: 3 calls ran whole on every rank (the ranks' inputs differ" in report, report
    assert "vae encoder: 1 calls ran whole on every rank (the ranks' inputs differ" in report, report
    # A VAE moved where the layout's collectives do not run (the CPU under NCCL) runs whole: the agreement's
    # all-reduce raised "No backend type associated with device type cpu".
    config, dist.get_backend_config = dist.get_backend_config, lambda group=None: "cuda:nccl"
    try:
        with torch.no_grad():
            assert torch.equal(pipe.vae.decode(z).sample, plain.decode(z).sample)
    finally:
        dist.get_backend_config = config
    assert (
        "vae decoder: 1 calls ran whole on every rank (its input is on cpu, where the layout's collectives "
        in (str(omni_accel.describe(pipe)))
    )
    omni_accel.restore(pipe)
    importlib.import_module("omni_accel.models.wan")
    wan_vae = omni_accel.tiny_wan_pipeline(seed=0).vae
    z = torch.randn(1, wan_vae.config.z_dim, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    first, later = z.clone(), z.clone()
    first[:, :, 0] += rank
    later[:, :, 1] += rank
    with torch.no_grad():
        want = wan_vae.decode(first).sample
    got, calls = _split_run(wan_vae.decoder, lambda: wan_vae.decode(first).sample)
    assert torch.equal(got, want) and calls == 0  # every chunk whole, as the first
    with pytest.raises(
        RuntimeError, match="differ from a later chunk on.* or accelerate with vae_parallel=False"
    ):
        _split_run(wan_vae.decoder, lambda: wan_vae.decode(later).sample)


def _vae_from_threads(world: int) -> None:
    """Calls from several threads at once (decodes of the split VAE and of a copy of it, an encode) give what
    plain Diffusers gives: each rank takes the calls one at a time (they patched each other's layers and
    crossed their collectives: gloo aborted); calls the ranks take in different orders run whole."""
    import threading

    plain = omni_accel.tiny_flux_pipeline(seed=0).vae
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(ulysses=world)
    )
    vaes = [pipe.vae, pipe.vae, copy.deepcopy(pipe.vae)]
    g = torch.Generator().manual_seed(7)
    latents = [torch.randn(1, 16, 6 + 2 * i, 4, generator=g) for i in range(len(vaes))]
    image = torch.randn(1, 3, 16, 8, generator=g)
    with torch.no_grad():
        wants = [plain.decode(z).sample for z in latents] + [plain.encode(image).latent_dist.parameters]
    got, errors = [None] * len(wants), []

    def run(i: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(3):
                    if i < len(vaes):
                        got[i] = vaes[i].decode(latents[i]).sample
                    else:
                        got[i] = pipe.vae.encode(image).latent_dist.parameters
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(wants))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    for out, want in zip(got, wants, strict=True):
        assert ((out - want).abs().max() / want.abs().max()).item() <= 1.5e-6
    omni_accel.restore(pipe)


def _pipeline_calls_from_threads(rank: int) -> None:
    """Two threads per rank calling a pipeline and a sibling (``from_pipe``) at once (a web server), two calls
    each, give what plain Diffusers' threads give: each rank runs the calls that communicate one at a time, in an order every rank
    agrees on (the threads' collectives crossed: gloo aborted both ranks), and each thread pairs its own
    guidance calls (another thread's end of call dropped its waiting conditional result)."""
    import threading

    plain = omni_accel.tiny_flux_pipeline(seed=0)
    prompts = ["a cat", "a dog in a hat", "a red car", "dark"]
    with torch.no_grad():  # text encoding is done first: a tokenizer in threads is not deterministic
        embeds = [plain.encode_prompt(prompt=p, prompt_2=None)[:2] for p in prompts]

    def call(i: int) -> dict:
        negative = embeds[(i + 1) % len(embeds)]
        return dict(
            prompt_embeds=embeds[i][0],
            pooled_prompt_embeds=embeds[i][1],
            negative_prompt_embeds=negative[0],
            negative_pooled_prompt_embeds=negative[1],
            true_cfg_scale=2.0,
            num_inference_steps=2,
            height=32,
            width=32 + 16 * (i % 2),
            output_type="pt",
            generator=torch.Generator().manual_seed(i),
        )

    def in_threads(pipe) -> list[torch.Tensor]:
        """Thread 0 calls ``pipe`` (its guidance calls pair), thread 1 a sibling sharing its transformer and
        VAE, with a scheduler of its own (plain Diffusers' scheduler keeps a call's step)."""
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        pipes = [pipe, FluxPipeline.from_pipe(pipe, scheduler=scheduler)]
        got, errors = [None] * 4, []

        def run(thread: int) -> None:
            try:
                with torch.no_grad():
                    for i in (thread, thread + 2):
                        got[i] = pipes[thread](**call(i)).images
            except Exception as error:
                errors.append(error)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors and not any(thread.is_alive() for thread in threads), errors
        return got

    wants = in_threads(plain)
    for layout in (ParallelConfig(tp=2), ParallelConfig(ulysses=2), ParallelConfig(cfg=2)):
        pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel=layout)
        for got, want in zip(in_threads(pipe), wants, strict=True):
            assert (got - want).abs().max().item() <= 1e-5, layout
        omni_accel.restore(pipe)
    # calls whose inputs differ over the ranks never meet: every rank raises, before any collective of them
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(tp=2, timeout_s=2)
    )
    refused = "no call with the same inputs waiting on all of them.*serialise"
    with pytest.raises(RuntimeError, match=refused), torch.no_grad():
        pipe(**{**call(rank), "true_cfg_scale": 1.0})
    with torch.no_grad():  # and the next calls run as before
        got = pipe(**{**call(0), "true_cfg_scale": 1.0, "output_type": "latent"}).images
        want = plain(**{**call(0), "true_cfg_scale": 1.0, "output_type": "latent"}).images
    assert (got - want).abs().max().item() <= 1e-5
    omni_accel.restore(pipe)


def _dead_peer(rank: int, world: int, done: str) -> None:
    """accelerate() starts the group from torchrun's environment with the configured timeout; a rank that
    stops taking part makes the others fail with an error after that timeout instead of hanging."""
    import pathlib
    import time

    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), parallel=ParallelConfig(tp=2, timeout_s=5)
    )
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    if rank == 1:  # alive but gone quiet: never joins the forward's all-reduces, until rank 0 is done
        deadline = time.monotonic() + 90
        while not pathlib.Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        return
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="(?i)timed out"):  # the timeout's error, not the peer's exit
            _latents(pipe)
        assert time.monotonic() - start < 60
    finally:
        pathlib.Path(done).touch()


@pytest.mark.multirank
def test_a_silent_rank_ends_in_a_timeout_error(tmp_path):
    run_multirank(_dead_peer, 2, str(tmp_path / "done"), init=False, timeout=120)


@pytest.mark.multirank
def test_two_rank_layouts():
    run_multirank(_two_ranks, 2, timeout=400)


@pytest.mark.multirank
def test_four_rank_hybrids():
    run_multirank(_four_ranks, 4, timeout=600)


@pytest.mark.multirank
def test_eight_rank_layouts():
    run_multirank(_eight_ranks, 8, timeout=600)


def test_parallel_config_errors():
    with pytest.raises(ValueError, match="positive int"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="cfg is 1 or 2"):
        ParallelConfig(cfg=4)
    with pytest.raises(ValueError, match="tp=1, ulysses=1, ring=2, cfg=1"):
        ParallelConfig(tp=3).check_world_size(2)
    with pytest.raises(TypeError, match="ParallelConfig"):
        omni_accel.AccelConfig(parallel={"tp": 2})
    # "60", None: a TypeError of the comparison; True: a 1 s timeout; inf: an OverflowError at the launch
    for timeout in ("60", None, True, float("inf"), float("nan"), 0):
        with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds > 0, got"):
            ParallelConfig(timeout_s=timeout)
    assert ParallelConfig(timeout_s=30).timeout_s == 30
    # batch_guidance=False where no guidance calls are stacked anyway changed nothing, silently
    for degrees in ({"cfg": 2}, {"cfg": 2, "ulysses": 2}, {}):
        with pytest.raises(
            ValueError, match="batch_guidance=False turns off the stacking .* leave batch_guid"
        ):
            ParallelConfig(batch_guidance=False, **degrees)
    assert not ParallelConfig(tp=2, batch_guidance=False).stacks_guidance


def test_parallel_without_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        omni_accel.accelerate(pipe, parallel=ParallelConfig(tp=2))
    assert type(pipe.transformer).__name__ == "FluxTransformer2DModel"


def test_the_layout_device_follows_the_groups_backend():
    """A plain ``init_process_group()`` on a GPU machine starts gloo and NCCL together: the layout runs on
    CUDA then, not on the CPU (which would move the user's pipeline there)."""
    from omni_accel.parallel.mesh import device_type_of

    assert device_type_of("nccl") == "cuda"
    assert device_type_of("cpu:gloo,cuda:nccl") == "cuda"
    assert device_type_of("gloo") == "cpu"


@pytest.mark.multirank
def test_vae_split_as_plain_diffusers():
    run_multirank(_vae_split_as_plain_diffusers, 2)
