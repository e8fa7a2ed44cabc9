"""The generic tier under ulysses and ring (gloo, two ranks): every transformer family that declares a
Diffusers ``_cp_plan`` and builds tiny runs split by that plan through our exchanges and providers, within
1e-5 (fp32) of plain Diffusers on one rank, its replica ranks bitwise equal; uneven lengths, key masks and
``restore`` included. One spawn runs every check (a spawn costs ~13 s of imports)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from multirank import run_checks, run_multirank
from tiny_transformers import (
    OVERRIDES,
    Holder,
    Shapes,
    build,
    exported_transformers,
    generic_inputs,
    outputs,
    randomized,
    tiny_config,
)

import omni_accel


def _generic(pipe, **options):
    """``accelerate`` in the generic tier: Qwen-Image (and FLUX.1, Wan) have native blocks, and these tests
    take them as models without."""
    return omni_accel.accelerate(pipe, **{"native": False, **options})


# Every family whose _cp_plan the installed Diffusers declares and tests/tiny_transformers builds is
# checked (FLUX.1 and Wan with native=False: their generic path); these at least.
AT_LEAST = (
    "ChronoEditTransformer3DModel",
    "Flux2Transformer2DModel",
    "FluxTransformer2DModel",
    "HeliosTransformer3DModel",
    "LTX2VideoTransformer3DModel",
    "LTXVideoTransformer3DModel",
    "MiniMaxH3Transformer3DModel",  # one packed video/audio/text sequence, two gathered outputs
    "QwenImageTransformer2DModel",
    "WanTransformer3DModel",
)
LAYOUTS = ({"ulysses": 2}, {"ring": 2})


def _inputs(name: str, inputs: dict) -> dict:
    if name == "Flux2Transformer2DModel":  # as Flux2Pipeline passes its ids: [batch, tokens, 4]
        batch = inputs["hidden_states"].shape[0]
        for key in ("img_ids", "txt_ids"):
            if inputs[key].ndim == 2:
                inputs[key] = inputs[key][None].expand(batch, -1, -1)
    return inputs


def _split(holder_model, inputs: dict, layout: dict, **options):
    holder = _generic(
        Holder(holder_model), parallel=omni_accel.ParallelConfig(**layout), native=False, **options
    )
    try:
        report = str(omni_accel.describe(holder))
        return outputs(holder.transformer, inputs), report
    finally:
        omni_accel.restore(holder)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert len(got) == len(want) and all(a.shape == b.shape for a, b in zip(got, want, strict=True))
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True))


def _same_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    for tensor in tensors:
        every = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(every, tensor.contiguous())
        if not all(torch.equal(every[0], other) for other in every[1:]):
            return False
    return True


def _families() -> None:
    declared = sorted(name for name, cls in exported_transformers().items() if getattr(cls, "_cp_plan", None))
    built = {name: build(name) for name in declared}
    built = {name: found for name, found in built.items() if not isinstance(found, str)}
    assert set(AT_LEAST) <= set(built), f"no longer built tiny: {set(AT_LEAST) - set(built)}"
    for name, (model, inputs) in built.items():
        inputs = _inputs(name, inputs)
        plain = outputs(model, inputs)
        for layout in LAYOUTS:
            got, report = _split(model, inputs, layout)
            err = _close(got, plain)
            assert err <= 1e-5, f"{name} {layout}: rel err {err:.2e}"
            assert _same_on_every_rank(got), f"{name} {layout}: replica ranks differ"
            assert "the sequence split as its _cp_plan declares" in report, report
        after = outputs(model, inputs)  # restore left nothing behind
        assert all(torch.equal(a, b) for a, b in zip(after, plain, strict=True)), name
        assert not any(
            hook.startswith("omni_accel.")
            for module in model.modules()
            for hook in getattr(module.__dict__.get("_diffusers_hook"), "hooks", {})
        ), name


def _masked_and_uneven(layouts: tuple[dict, ...] = LAYOUTS) -> None:
    """Qwen-Image with padded text (a key mask, as its pipeline passes) over 15 image tokens and 5 text
    tokens: both split unevenly (8+7, 3+2), so the ranks exchange their lengths; then with ControlNet
    residuals, and FLUX.1's (native=False) over 15 image tokens."""
    model, inputs = build("QwenImageTransformer2DModel")
    batch, channels = inputs["hidden_states"].shape[0], inputs["hidden_states"].shape[-1]
    g = torch.Generator().manual_seed(3)
    inputs["hidden_states"] = torch.randn(batch, 15, channels, generator=g)
    inputs["img_shapes"] = [[(1, 3, 5)]] * batch
    mask = torch.ones_like(inputs["encoder_hidden_states_mask"])
    mask[-1, -2:] = 0  # the last sample's prompt is two tokens shorter
    unmasked = outputs(model, inputs)
    inputs["encoder_hidden_states_mask"] = mask
    plain = outputs(model, inputs)
    assert _close(unmasked, plain) > 1e-3, "the mask must matter for this check to mean anything"
    for layout in layouts:
        got, _ = _split(model, inputs, layout)
        err = _close(got, plain)
        assert err <= 1e-5, f"{layout}: rel err {err:.2e}"
        assert _same_on_every_rank(got)
        again, _ = _split(model, inputs, layout)  # lengths exchanged again by a new layout, same result
        assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))
    inputs["controlnet_block_samples"] = [torch.randn(batch, 15, model.inner_dim, generator=g)]
    _controlnet_residuals("QwenImageTransformer2DModel", model, inputs, layouts)
    model, _ = build("FluxTransformer2DModel")
    inputs = generic_inputs(model, Shapes("tokens", height=3, width=5))
    residuals = [torch.randn(batch, 15, model.inner_dim, generator=g) for _ in range(3)]
    inputs.update(controlnet_block_samples=residuals[:1], controlnet_single_block_samples=residuals[1:])
    _controlnet_residuals("FluxTransformer2DModel", model, inputs, layouts)


def _controlnet_residuals(name: str, model, inputs: dict, layouts: tuple[dict, ...]) -> None:
    """ControlNet residuals (15 image tokens, split 8+7), which the _cp_plan leaves whole, split with the
    image tokens they are added to (they were whole beside a slice: a shape error)."""
    plain = outputs(model, inputs)
    for layout in layouts:
        got, _ = _split(model, inputs, layout)
        err = _close(got, plain)
        assert err <= 1e-5 and _same_on_every_rank(got), f"{name} {layout} ControlNet: rel err {err:.2e}"


def _compiled_split() -> None:
    """Compiled blocks under ulysses and ring (Dynamo's eager backend on the CPU: the same traced graphs,
    our attention op in them doing the exchanges): Qwen-Image's padded text split unevenly, FLUX.2, and
    LTX-2 with the audio the plan leaves whole."""
    for name in ("QwenImageTransformer2DModel", "Flux2Transformer2DModel", "LTX2VideoTransformer3DModel"):
        _compiled_under(name, LAYOUTS)


def _compiled_tensor_parallel() -> None:
    """Compiled blocks under tp=2: the row-split linears' reductions, Diffusers hooks inside the blocks,
    are traced in as functional all-reduces; Qwen-Image and FLUX.2 (its packed QKV+MLP projection)."""
    for name in ("QwenImageTransformer2DModel", "Flux2Transformer2DModel"):
        _compiled_under(name, ({"tp": 2},))


def _compiled_under(name: str, layouts: tuple[dict, ...]) -> None:
    """``name`` compiled (Dynamo's eager backend) under each of ``layouts``: within 1e-5 of one rank of
    plain Diffusers, replica ranks bitwise equal, every block compiled (Qwen-Image with padded text)."""
    model, inputs = build(name)
    inputs = _inputs(name, inputs)
    if name == "QwenImageTransformer2DModel":
        inputs["encoder_hidden_states_mask"][-1, -2:] = 0
    plain = outputs(model, inputs)
    for layout in layouts:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        holder = _generic(
            Holder(model),
            parallel=omni_accel.ParallelConfig(**layout),
            compile={"backend": "eager"},
            native=False,
        )
        try:
            got = [outputs(holder.transformer, inputs) for _ in range(2)]
            component = omni_accel.describe(holder).components[0]
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            report = str(omni_accel.describe(holder))
        finally:
            omni_accel.restore(holder)
        for run in got:
            err = _close(run, plain)
            assert err <= 1e-5, f"{name} {layout} compiled: rel err {err:.2e}"
            assert _same_on_every_rank(run), f"{name} {layout} compiled: replica ranks differ"
        assert graphs >= 1, f"{name} {layout}: no block was compiled"
        assert not component.runtime.fallbacks, component.runtime.fallbacks
        assert "every rank alike" in report, report


def _torch_compile_wrapper_under_a_split() -> None:
    """pipe.transformer = torch.compile(pipe.transformer) under ulysses or ring: the wrapper traced the model's
    whole call, where its scopes were not entered, so each routed call ran Diffusers' attention over one
    rank's tokens (3% off, silently; later refused). The scopes are now entered around the compiled frames:
    it runs split, exactly, as compiled in place does; and called from a larger compiled function too (this
    model's graph breaks run its call eagerly, in its scopes; one traced whole there would be refused). With
    grad on, they refuse as the eager call does."""
    want = _pipeline_images(
        omni_accel.tiny_flux_pipeline(seed=0), num_inference_steps=1, output_type="latent"
    )
    for layout, how in (({"ulysses": 2}, "wrapper"), ({"ring": 2}, "wrapper"), ({"ulysses": 2}, "in place")):
        torch._dynamo.reset()
        pipe = _generic(omni_accel.tiny_flux_pipeline(seed=0), parallel=omni_accel.ParallelConfig(**layout))
        try:
            if how == "wrapper":
                pipe.transformer = torch.compile(pipe.transformer, backend="eager")
            else:
                pipe.transformer.compile(backend="eager")
            got = _pipeline_images(pipe, num_inference_steps=1, output_type="latent")
            assert _close([got], [want]) <= 1e-5, (layout, how)
        finally:
            omni_accel.restore(pipe)

    torch._dynamo.reset()
    pipe = _generic(omni_accel.tiny_flux_pipeline(seed=0), parallel=omni_accel.ParallelConfig(ulysses=2))
    try:
        transformer, call = pipe.transformer, {}
        hook = transformer.register_forward_pre_hook(lambda m, a, kw: call.update(kw), with_kwargs=True)
        _pipeline_images(pipe, num_inference_steps=1, output_type="latent")
        hook.remove()
        outer = torch.compile(lambda **kw: transformer(**kw)[0] * 2, backend="eager")
        with torch.no_grad():
            want = transformer(**call)[0]
            assert torch.equal(outer(**call), want * 2)
        # with grad on, the traces took Diffusers' function over one rank's tokens (0.24 off, silently)
        # where an eager call refuses: each compiled call refuses alike; one nothing needs gradients of
        # (frozen weights) runs split, exactly
        wrapper = torch.compile(transformer, backend="eager")
        for compiled in (outer, wrapper):
            with pytest.raises(NotImplementedError, match="gradients under sequence parallelism are not"):
                compiled(**call)
        transformer.requires_grad_(False)
        assert torch.equal(wrapper(**call)[0], want)
        # a graph break inside the attention modules: the call sites compile in frames of their own, where
        # the trace knows no role; they took Diffusers' function over one rank's tokens (0.24 off, silently)
        for module in transformer.modules():
            if hasattr(module, "set_processor"):
                module.processor = _BreakingProcessor(module.processor)
        torch._dynamo.reset()
        with torch.no_grad():
            assert torch.equal(wrapper(**call)[0], want)
        transformer.requires_grad_(True)  # the role entered where the attention module's frame is a first one
        with pytest.raises(
            NotImplementedError, match="role 'flux.joint': gradients under sequence parallelism"
        ):
            wrapper(**call)
    finally:
        omni_accel.restore(pipe)


class _BreakingProcessor:
    """FLUX's processor behind a graph break, as a user's processor with code Dynamo cannot trace has."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        torch._dynamo.graph_break()
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _pipeline_lora_under_tensor_parallel() -> None:
    """The Diffusers way, on the tiny Qwen-Image pipeline under tp=2: ``load_lora_weights`` (its shape
    checks see full shapes), ``fuse_lora``, ``unfuse_lora`` and ``unload_lora_weights``, each step's images
    as plain Diffusers' doing the same; and a LoRA loaded before ``accelerate``."""
    import copy

    from conftest import random_lora

    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    pipe = _generic(omni_accel.tiny_qwenimage_pipeline(seed=0), parallel=omni_accel.ParallelConfig(tp=2))
    lora = random_lora(plain.transformer, ["to_q", "to_k", "to_v", "to_out.0", "to_add_out"], seed=5)
    steps = (
        lambda p: p.load_lora_weights(copy.deepcopy(lora), adapter_name="style"),
        lambda p: p.fuse_lora(),
        lambda p: (p.unfuse_lora(), p.unload_lora_weights()),
    )
    for step in steps:
        for p in (plain, pipe):
            step(p)
        got = _pipeline_images(pipe)
        assert _close([got], [_pipeline_images(plain)]) <= 1e-5 and _same_on_every_rank([got])
    omni_accel.restore(pipe)
    # loaded before accelerate: split at the first forward, given back whole by restore
    plain, before = omni_accel.tiny_qwenimage_pipeline(seed=0), omni_accel.tiny_qwenimage_pipeline(seed=0)
    for p in (plain, before):  # fresh twins: fuse and unfuse above left rounding in the weights
        p.load_lora_weights(copy.deepcopy(lora), adapter_name="style")
    expected = _pipeline_images(plain)
    before = _generic(before, parallel=omni_accel.ParallelConfig(tp=2))
    got = _pipeline_images(before)
    assert _close([got], [expected]) <= 1e-5 and _same_on_every_rank([got])
    omni_accel.restore(before)
    assert torch.equal(_pipeline_images(before), expected)


def _adapted_under_cfg() -> None:
    """HunyuanVideo 1.5's adapted blocks (one key mask per forward, ``models/hunyuan_video15.py``) under
    cfg=2: each rank's half of the batch with its own padding, within 1e-5 of one rank."""
    from test_key_padding import _tiny_hunyuan_video15

    plain, accelerated, inputs = _tiny_hunyuan_video15()
    got, report = _split(accelerated, inputs, {"cfg": 2})
    assert _close(got, outputs(plain, inputs)) <= 1e-5 and _same_on_every_rank(got)
    assert "adapted: 3 transformer blocks attend over a key mask" in report, report


def _refusals() -> None:
    model, inputs = build("QwenImageTransformer2DModel")
    _too_short_to_split(model, inputs)
    sd3, _ = build("SD3Transformer2DModel")
    cases = [
        # without a _cp_plan either, cfg is the one layout left to name
        (
            sd3,
            dict(parallel=omni_accel.ParallelConfig(tp=2)),
            "SD3Transformer2DModel has neither; use cfg for it.",
        ),
    ]
    for module, options, message in cases:
        pipe = Holder(module)
        with pytest.raises(ValueError, match=re.escape(message)):
            _generic(pipe, **options)
        assert not hasattr(pipe, "_omni_accel_state") or not omni_accel.describe(pipe).components


def _too_short_to_split(model, inputs: dict) -> None:
    """A one-token prompt over two ranks: Diffusers' code cannot run on the rank that would hold none of its
    tokens (its RoPE reshapes an empty tensor, and the other rank would wait in an exchange forever), so
    every rank refuses the call alike, naming the fix; the layout then runs a longer prompt exactly."""
    short = {
        **inputs,
        "encoder_hidden_states": inputs["encoder_hidden_states"][:, :1],
        "encoder_hidden_states_mask": inputs["encoder_hidden_states_mask"][:, :1],
    }
    plain = outputs(model, inputs)
    for layout in LAYOUTS:
        holder = _generic(Holder(model), parallel=omni_accel.ParallelConfig(**layout))
        try:
            with pytest.raises(ValueError, match="Use at most 1 ulysses x ring ranks for such inputs"):
                outputs(holder.transformer, short)
            got = outputs(holder.transformer, inputs)
            assert _close(got, plain) <= 1e-5 and _same_on_every_rank(got), layout
        finally:
            omni_accel.restore(holder)


def _pipeline_images(pipe, **call) -> torch.Tensor:
    call = {
        "prompt": "a cat",
        "num_inference_steps": 3,
        "height": 32,
        "width": 32,
        "output_type": "pt",
        **call,
    }
    out = pipe(**call, generator=torch.Generator().manual_seed(0))
    return out.frames if hasattr(out, "frames") else out.images  # a video pipeline's, or an image one's


def _guidance_over_two_ranks() -> None:
    """cfg=2 on pipelines without native blocks: SD3 batches its two branches in one call (halved over the
    ranks by the arguments that carry the batch; Z-Image's lists of samples are not split); Qwen-Image's
    true CFG, FLUX's and Wan's (native=False) call the transformer twice per step (paired over the ranks
    once the first step has shown the output's shape)."""
    true_cfg = {"negative_prompt": "a dog", "true_cfg_scale": 4.0}
    cases = (
        (omni_accel.tiny_sd3_pipeline, {"guidance_scale": 5.0}, "batch-split calls", {}),
        (omni_accel.tiny_qwenimage_pipeline, true_cfg, "paired", {}),
        # FLUX with true CFG and Wan, with native=False: the pipeline pairs its calls as for native blocks
        (omni_accel.tiny_flux_pipeline, true_cfg, "paired", {"native": False}),
        (omni_accel.tiny_wan_pipeline, {"guidance_scale": 5.0, "num_frames": 5}, "paired", {"native": False}),
        # two prompts of two tokens: FLUX's text ids [2, 3] could carry the batch too; not halved, the
        # calls run whole on both ranks
        (
            omni_accel.tiny_flux_pipeline,
            {"prompt": ["a cat", "a dog"], "max_sequence_length": 2},
            "replicated",
            {"native": False},
        ),
        # Z-Image (native=False) batches both branches as lists of one tensor per sample: not halved
        # tensor by tensor (that failed in its blocks), the calls run whole on both ranks
        (omni_accel.tiny_zimage_pipeline, {"num_images_per_prompt": 2}, "replicated", {"native": False}),
    )
    for build_pipeline, call, counted, options in cases:
        plain = _pipeline_images(build_pipeline(seed=0), **call)
        pipe = _generic(build_pipeline(seed=0), parallel=omni_accel.ParallelConfig(cfg=2), **options)
        got = _pipeline_images(pipe, **call)
        err = _close([got], [plain])
        assert err <= 1e-5, f"{build_pipeline.__name__}: rel err {err:.2e}"
        assert _same_on_every_rank([got])
        cfg = omni_accel.describe(pipe).components[0].cfg
        if counted == "paired":  # the first step ran whole on both ranks, the two others paired
            assert cfg.paired_calls == 2 and cfg.replicated_calls == 2, cfg.describe()
            again = _pipeline_images(pipe, **call)  # every step paired now
            assert cfg.paired_calls == 5 and torch.equal(again, got), cfg.describe()
        elif counted == "replicated":
            assert cfg.split_calls == 0 and cfg.replicated_calls == 3, cfg.describe()
        else:
            assert cfg.split_calls == 3, cfg.describe()
        assert "the guidance branches over the cfg ranks" in str(omni_accel.describe(pipe))
        omni_accel.restore(pipe)


def _auto(cases: tuple = ()) -> None:
    """``parallel="auto"`` for pipelines without native blocks, chosen at the first call from its arguments:
    SD3 with guidance takes cfg=2 (no _cp_plan; its branches batched in one call, halved), FLUX with
    native=False and no true CFG ulysses=2 (its _cp_plan); each within 1e-5 of plain Diffusers on one rank,
    the ranks bitwise equal, and ``describe`` says what was chosen and why. SD3's first call without
    guidance is refused on every rank alike (nothing to spread it by), and its next, guided, call lays it
    out."""
    cases = cases or (
        (
            omni_accel.tiny_sd3_pipeline,
            {"guidance_scale": 5.0},
            {},
            "cfg=2) on 2 ranks, the guidance branches over",
        ),
        (
            omni_accel.tiny_flux_pipeline,
            {},
            {"native": False},
            "ulysses=2, ring=1, cfg=1) on 2 ranks, the seq",
        ),
    )
    for build_pipeline, call, options, chosen in cases:
        plain = _pipeline_images(build_pipeline(seed=0), **call)
        pipe = omni_accel.accelerate(build_pipeline(seed=0), parallel="auto", **options)
        got = _pipeline_images(pipe, **call)
        err = _close([got], [plain])
        assert err <= 1e-5, f"{build_pipeline.__name__}: rel err {err:.2e}"
        assert _same_on_every_rank([got]), build_pipeline.__name__
        report = str(omni_accel.describe(pipe))
        assert chosen in report and "chosen at the first call: " in report, report
        omni_accel.restore(pipe)
    if dist.get_world_size() != 2:
        return
    sd3 = omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0), parallel="auto")
    with pytest.raises(ValueError, match="this first pipeline call runs no classifier-free guidance"):
        _pipeline_images(sd3, guidance_scale=1.0)
    assert "decided at the first pipeline call" in str(omni_accel.describe(sd3))
    got = _pipeline_images(sd3, guidance_scale=5.0)
    assert omni_accel.describe(sd3).components[0].cfg.split_calls == 3 and _same_on_every_rank([got])
    omni_accel.restore(sd3)


def _tensor_parallel() -> None:
    """tp=2 by the Diffusers _tp_plan of every family that declares one and builds tiny (Qwen-Image, FLUX.2,
    FLUX.1 with native=False): Q/K/V and MLP-up linears split by outputs, attention out and MLP-down by
    inputs (their partial sums reduced), packed projections (FLUX.2's QKV+MLP, FLUX's attention+MLP
    output) part by part; full tensors in state_dict, and restore gives back the very weights."""
    declared = sorted(name for name, cls in exported_transformers().items() if getattr(cls, "_tp_plan", None))
    built = {name: build(name) for name in declared}
    built = {name: found for name, found in built.items() if not isinstance(found, str)}
    assert {"Flux2Transformer2DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel"} <= set(built)
    for name, (model, inputs) in built.items():
        inputs = _inputs(name, inputs)
        plain = outputs(model, inputs)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        holder = _generic(Holder(model), parallel=omni_accel.ParallelConfig(tp=2), native=False)
        linear = model.transformer_blocks[0].attn.to_q
        assert linear.weight.shape[0] == weights["transformer_blocks.0.attn.to_q.weight"].shape[0] // 2, name
        got = outputs(model, inputs)
        err = _close(got, plain)
        assert err <= 1e-5, f"{name}: rel err {err:.2e}"
        assert _same_on_every_rank(got), name
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), name  # gathered
        assert "its linears split as its _tp_plan declares" in str(omni_accel.describe(holder))
        omni_accel.restore(holder)
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), name
        assert all(torch.equal(a, b) for a, b in zip(outputs(model, inputs), plain, strict=True)), name


def _bitwise(model, plain, inputs: dict) -> bool:
    return all(torch.equal(a, b) for a, b in zip(outputs(model, inputs), outputs(plain, inputs), strict=True))


def _fused_qkv_under_tensor_parallel() -> None:
    """Diffusers' ``fuse_qkv_projections()`` under tp=2, on every family that declares a _tp_plan and fuses
    (FLUX.1, FLUX.2, Qwen-Image 2.1): fused after ``accelerate`` (its fused linears built from this rank's
    slices) or before (the whole ones, split at ``accelerate``), its outputs, its state_dict (full tensors,
    before any forward too), unfuse and fuse again while accelerated, and ``restore``, each as plain Diffusers'
    on one rank: after restore the fused linears are whole again and the model computes as the plain one."""
    import copy

    fusing = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImage21Transformer2DModel")
    for name in fusing:
        for before in (False, True):
            model, inputs = build(name)
            inputs, plain, what = _inputs(name, inputs), copy.deepcopy(model), f"{name} fused before={before}"
            if before:
                for twin in (plain, model):
                    twin.fuse_qkv_projections()
            holder = _generic(Holder(model), parallel=omni_accel.ParallelConfig(tp=2), native=False)
            if not before:
                for twin in (plain, model):
                    twin.fuse_qkv_projections()
            ours, theirs = model.state_dict(), plain.state_dict()
            assert "transformer_blocks.0.attn.to_qkv.weight" in theirs, what
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), what
            _agree(model, plain, inputs, what)
            if before:  # unfused while accelerated, then fused again and restored before any forward
                for twin in (plain, model):
                    twin.unfuse_qkv_projections()
                _agree(model, plain, inputs, f"{what} unfused")
                for twin in (plain, model):
                    twin.fuse_qkv_projections()
            omni_accel.restore(holder)
            ours, theirs = model.state_dict(), plain.state_dict()
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), what
            assert _bitwise(model, plain, inputs), what
            for twin in (plain, model):
                twin.unfuse_qkv_projections()
            assert _bitwise(model, plain, inputs), what
    # an adapter peft sized by a fused linear's slices (added before anything split that linear) is refused
    from peft import LoraConfig

    model, inputs = build("FluxTransformer2DModel")
    holder = _generic(Holder(model), parallel=omni_accel.ParallelConfig(tp=2), native=False)
    model.fuse_qkv_projections()
    model.add_adapter(LoraConfig(r=2, target_modules=["to_qkv"]), "x")
    with pytest.raises(NotImplementedError, match="after fusing, then add the adapter"):
        outputs(model, inputs)
    model.delete_adapters("x")
    omni_accel.restore(holder)


# LoRA targets covering column- and row-split linears, packed ones included (FLUX.2's QKV+MLP and output).
_LORA_TARGETS = {
    "QwenImageTransformer2DModel": ["to_q", "add_k_proj", "to_out.0", "to_add_out", "img_mlp.net.2"],
    "Flux2Transformer2DModel": (
        r".*(attn\.to_q|to_add_out|ff\.linear_in|to_qkv_mlp_proj|single_transformer_blocks\.\d+\.attn\.to_out)"
    ),
}


def _add_lora(model, name: str, adapter: str, seed: int) -> None:
    from peft import LoraConfig

    torch.manual_seed(seed)  # the same random A and B on every rank and for the plain twin
    config = LoraConfig(r=2, lora_alpha=4, target_modules=_LORA_TARGETS[name], init_lora_weights=False)
    model.add_adapter(config, adapter)


def _agree(model, plain, inputs: dict, what: str) -> None:
    got, want = outputs(model, inputs), outputs(plain, inputs)
    err = _close(got, want)
    assert err <= 1e-5, f"{what}: rel err {err:.2e}"
    assert _same_on_every_rank(got), f"{what}: the ranks differ"


def _lora_under_tensor_parallel() -> None:
    """LoRA adapters added after ``accelerate`` under tp=2 are split with the linears they wrap (lora_B by
    outputs, lora_A by inputs with its rank-r partial sums reduced): the outputs, the adapter's state dict
    (full tensors), fuse_lora / unfuse_lora (of a split adapter, and of one fused before any forward),
    delete_adapters and restore all as plain Diffusers' on one rank."""
    import copy

    from peft.utils import get_peft_model_state_dict

    for name in _LORA_TARGETS:
        model, inputs = build(name)
        inputs = _inputs(name, inputs)
        plain = copy.deepcopy(model)
        holder = _generic(Holder(model), parallel=omni_accel.ParallelConfig(tp=2), native=False)
        for twin in (plain, model):
            _add_lora(twin, name, "x", seed=7)

        _agree(model, plain, inputs, f"{name} adapter x")
        split, full = model.transformer_blocks[0].attn.to_q, plain.transformer_blocks[0].attn.to_q
        assert split.lora_B["x"].weight.shape[0] * 2 == full.lora_B["x"].weight.shape[0], name  # by outputs
        ours = get_peft_model_state_dict(model, adapter_name="x")
        theirs = get_peft_model_state_dict(plain, adapter_name="x")
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), name
        for twin in (plain, model):
            twin.fuse_lora(adapter_names=["x"])
        _agree(model, plain, inputs, f"{name} x fused")
        for twin in (plain, model):
            twin.unfuse_lora()
        _agree(model, plain, inputs, f"{name} x unfused")
        for twin in (plain, model):  # fused before any forward of ours split it: the full delta, sliced
            _add_lora(twin, name, "y", seed=8)
            twin.set_adapters(["x", "y"])
            twin.fuse_lora(adapter_names=["y"])
        _agree(model, plain, inputs, f"{name} y fused before a forward")
        for twin in (plain, model):
            twin.unfuse_lora()
            twin.delete_adapters(["x", "y"])
        _agree(model, plain, inputs, f"{name} adapters deleted")
        assert not model._diffusers_hook.get_hook("omni_accel.tp_adapters").split, (
            "deleted adapters are let go"
        )
        omni_accel.restore(holder)  # full weights back, as the plain twin's after the same steps
        ours, theirs = model.state_dict(), plain.state_dict()
        assert ours.keys() == theirs.keys(), name
        assert all(torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-6) for k in theirs), name


CHECKS = (
    _families,
    _masked_and_uneven,
    _compiled_split,
    _compiled_tensor_parallel,
    _torch_compile_wrapper_under_a_split,
    _refusals,
    _guidance_over_two_ranks,
    _auto,
    _tensor_parallel,
    _fused_qkv_under_tensor_parallel,
    _lora_under_tensor_parallel,
    _pipeline_lora_under_tensor_parallel,
    _adapted_under_cfg,
)


@pytest.mark.multirank
def test_generic_tier_splits_every_cp_plan_family_exactly():
    run_multirank(run_checks, 2, CHECKS, timeout=600)


def _hybrid(rank: int, world: int) -> None:
    """ulysses=2 x ring=2 on four ranks: Ulysses inside each pair of ranks, the ring across the pairs."""
    for name in ("QwenImageTransformer2DModel", "LTX2VideoTransformer3DModel", "Flux2Transformer2DModel"):
        model, inputs = build(name)
        inputs = _inputs(name, inputs)
        plain = outputs(model, inputs)
        got, _ = _split(model, inputs, {"ulysses": 2, "ring": 2})
        err = _close(got, plain)
        assert err <= 1e-5, f"{name}: rel err {err:.2e}"
        assert _same_on_every_rank(got), name
    _masked_and_uneven(({"ulysses": 2, "ring": 2},))
    _tensor_and_sequence_parallel()
    # parallel="auto": Qwen-Image's true CFG (native=False) on a branch per pair of ranks, its sequence
    # split over each pair
    true_cfg = {"negative_prompt": "a dog", "true_cfg_scale": 4.0}
    _auto(
        ((omni_accel.tiny_qwenimage_pipeline, true_cfg, {"native": False}, "ulysses=2, ring=1, cfg=2) on 4"),)
    )


def _four_heads(name: str):
    """``build(name)``'s model with 4 heads of 8 (the same widths, so its inputs serve): under tp=2 x
    ulysses=2 each rank then exchanges whole heads (the tiny models' 2 heads split unevenly there)."""
    cls = exported_transformers()[name]
    axes = {"QwenImageTransformer2DModel": (2, 2, 4), "Flux2Transformer2DModel": (2, 2, 2, 2)}[name]
    overrides = {**OVERRIDES.get(name, {}), "num_attention_heads": 4, "attention_head_dim": 8}
    torch.manual_seed(0)
    return randomized(cls(**tiny_config(cls, {**overrides, "axes_dims_rope": axes})))


def _tensor_and_sequence_parallel() -> None:
    """tp=2 with ring=2 or ulysses=2 on four ranks: the sequence split over the ring/Ulysses ranks by the
    _cp_plan, each share's linears split over the TP pair by the _tp_plan (every TP rank holds all of its
    share's tokens); Qwen-Image with padded text split unevenly, and FLUX.2."""
    for name in ("QwenImageTransformer2DModel", "Flux2Transformer2DModel"):
        _, inputs = build(name)
        model = _four_heads(name)
        inputs = _inputs(name, inputs)
        if name == "QwenImageTransformer2DModel":
            inputs["encoder_hidden_states_mask"][-1, -2:] = 0
        plain = outputs(model, inputs)
        for layout in ({"tp": 2, "ring": 2}, {"tp": 2, "ulysses": 2}):
            got, report = _split(model, inputs, layout)
            err = _close(got, plain)
            assert err <= 1e-5, f"{name} {layout}: rel err {err:.2e}"
            assert _same_on_every_rank(got), f"{name} {layout}: replica ranks differ"
            assert "the sequence split as its _cp_plan declares" in report and "_tp_plan" in report, report
        torch._dynamo.reset()  # and compiled (Dynamo's eager backend): the same within 1e-5
        got, report = _split(model, inputs, {"tp": 2, "ulysses": 2}, compile={"backend": "eager"})
        assert _close(got, plain) <= 1e-5 and _same_on_every_rank(got), name
        assert "compiled at the first call per input shape (every rank alike" in report, report


@pytest.mark.multirank
def test_generic_tier_hybrid_layout_on_four_ranks():
    run_multirank(_hybrid, 4, timeout=600)
