"""A CFG step's two transformer calls stacked in one batch (``GuidanceBranches`` without a cfg group): each
branch gets exactly what its own call would have returned, and calls that cannot stack run apart."""

import pytest
import torch

from omni_accel.parallel.cfg import GuidanceBranches

BATCHED = ("hidden_states", "encoder_hidden_states", "timestep")


class _Model:
    """A transformer stand-in whose output depends on every argument, per sample."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, hidden_states, encoder_hidden_states, timestep, ids, extra=None):
        self.batches.append(hidden_states.shape[0])
        scale = 1.0 if extra is None else extra["scale"]
        text = encoder_hidden_states.mean(dim=1, keepdim=True)
        return (hidden_states + text) * timestep[:, None, None] * scale + ids.sum()


def _call(seed: int, tokens: int = 4, **overrides) -> dict:
    g = torch.Generator().manual_seed(seed)
    call = dict(
        hidden_states=torch.randn(1, 6, 3, generator=g),
        encoder_hidden_states=torch.randn(1, tokens, 3, generator=g),
        timestep=torch.tensor([0.5]),
        ids=torch.arange(3.0),
    )
    return {**call, **overrides}


def _step(
    pairs: GuidanceBranches, model: _Model, cond: dict, uncond: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    like = lambda call: torch.empty_like(call["hidden_states"])  # noqa: E731
    pairs.branch = "cond"
    cond_out = pairs.run(model, cond, like)
    pairs.branch = "uncond"
    return cond_out, pairs.run(model, uncond, like)


def _expected(cond: dict, uncond: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return _Model()(**cond), _Model()(**uncond)


def test_stacked_pair_returns_each_branch_its_own_result():
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    ids = torch.arange(3.0)
    # the same latents object in both calls (Wan), equal ids in distinct tensors (FLUX's text ids)
    cond = _call(0, ids=ids)
    uncond = _call(1, hidden_states=cond["hidden_states"], ids=ids.clone())
    got = _step(pairs, model, cond, uncond)
    want = _expected(cond, uncond)
    assert model.batches == [2]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert (pairs.stacked_calls, pairs.unstacked_calls, pairs.paired_calls) == (1, 0, 1)
    pairs.finish_call(completed=True)
    assert "1 cond/uncond pairs in one call, 0 pairs run one after the other" in pairs.describe()


@pytest.mark.parametrize(
    "change",
    [
        dict(ids=torch.arange(3.0) + 1),  # an unbatched input that differs
        dict(tokens=7),  # a batched input of another shape past the batch
        dict(extra={"scale": 2.0}),  # an argument only one call has
    ],
    ids=["unbatched-differs", "shape-differs", "keys-differ"],
)
def test_calls_that_cannot_stack_run_one_after_the_other(change):
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    tokens = change.pop("tokens", 4)
    cond, uncond = _call(0), _call(1, tokens=tokens, **change)
    got = _step(pairs, model, cond, uncond)
    want = _expected(cond, uncond)
    assert model.batches == [1, 1]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert (pairs.stacked_calls, pairs.unstacked_calls) == (0, 1)


def test_a_branch_whose_batched_inputs_broadcast_runs_apart():
    """FLUX's true CFG with two prompts and one negative prompt: the uncond call passes one sample's text
    beside two samples' latents (the model broadcasts it); stacked, the batches no longer lined up (4 latents
    beside 3 texts: a crash under ulysses/tp/ring). Such a pair runs one call after the other."""
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    g = torch.Generator().manual_seed(0)
    two = dict(hidden_states=torch.randn(2, 6, 3, generator=g), timestep=torch.tensor([0.5, 0.5]))
    cond = _call(0, **two, encoder_hidden_states=torch.randn(2, 4, 3, generator=g))
    uncond = _call(1, **two)  # one sample's text
    got = _step(pairs, model, cond, uncond)
    assert model.batches == [2, 2]
    assert all(torch.equal(g, w) for g, w in zip(got, _expected(cond, uncond), strict=True))
    assert (pairs.stacked_calls, pairs.unstacked_calls) == (0, 1)


def test_unbatched_tensors_are_compared_again_after_an_in_place_edit():
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    ids, other = torch.arange(3.0), torch.arange(3.0)
    _step(pairs, model, _call(0, ids=ids), _call(1, ids=other))
    other.add_(1)  # same objects, new contents: the verdict of the last step no longer holds
    cond, uncond = _call(2, ids=ids), _call(3, ids=other)
    got = _step(pairs, model, cond, uncond)
    assert model.batches == [2, 1, 1]
    assert all(torch.equal(g, w) for g, w in zip(got, _expected(cond, uncond), strict=True))


def test_a_dict_argument_edited_between_the_calls_reaches_the_conditional_branch_as_it_was():
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    extra = {"scale": 1.0}
    cond = _call(0, extra=extra)
    like = lambda call: torch.empty_like(call["hidden_states"])  # noqa: E731
    pairs.branch = "cond"
    cond_out = pairs.run(model, cond, like)
    extra["scale"] = 3.0  # as a pipeline swapping in the negative IP-adapter embeddings does
    pairs.branch = "uncond"
    uncond_out = pairs.run(model, _call(1, extra=extra), like)
    assert torch.equal(cond_out, _Model()(**_call(0, extra={"scale": 1.0})))
    assert torch.equal(uncond_out, _Model()(**_call(1, extra={"scale": 3.0})))
    assert pairs.unstacked_calls == 1


def test_unpaired_calls_are_errors_and_unpaired_pipelines_call_through():
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    like = lambda call: torch.empty_like(call["hidden_states"])  # noqa: E731
    call = _call(0)
    assert torch.equal(pairs.run(model, call, like), _Model()(**call))  # pairing off: a plain call
    pairs.pairing = True
    pairs.branch = "cache_context_of_another_hook"
    with pytest.raises(RuntimeError, match="expects calls inside cache_context"):
        pairs.run(model, call, like)
    pairs.branch = "uncond"
    with pytest.raises(RuntimeError, match="unconditional call without the conditional one"):
        pairs.run(model, call, like)
    pairs.branch = "cond"
    pairs.run(model, call, like)
    with pytest.raises(RuntimeError, match="Two conditional calls"):
        pairs.run(model, call, like)
    with pytest.raises(RuntimeError, match="its result was never computed"):
        pairs.finish_call(completed=True)
    assert not pairs.pairing


def test_calls_outside_any_cache_context_pair_by_their_order():
    """FLUX img2img, inpaint and Kontext, Wan video-to-video: no cache_context around the two calls."""
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    like = lambda call: torch.empty_like(call["hidden_states"])  # noqa: E731
    for step in range(2):
        first, second = _call(2 * step), _call(2 * step + 1, tokens=4)
        waiting = pairs.run(model, first, like)
        assert waiting.isnan().all()  # read before the second call, it shows
        got = waiting, pairs.run(model, second, like)
        assert all(torch.equal(g, w) for g, w in zip(got, _expected(first, second), strict=True))
    assert model.batches == [2, 2] and pairs.ordered_calls == 4 and pairs.stacked_calls == 2
    pairs.finish_call(completed=True)


def test_inference_mode_tensors_are_compared_without_a_version_counter():
    pairs, model = GuidanceBranches(None, BATCHED), _Model()
    pairs.pairing = True
    with torch.inference_mode():
        cond, uncond = _call(0), _call(1)  # distinct, equal ids tensors
        got = _step(pairs, model, cond, uncond)
    assert model.batches == [2]
    assert all(torch.equal(g, w) for g, w in zip(got, _expected(cond, uncond), strict=True))


def test_the_generic_tier_tells_batched_arguments_or_says_it_cannot():
    from omni_accel.models.generic import batch_dim_arguments

    def flux_call(batch: int, text: int) -> dict:
        return dict(
            hidden_states=torch.zeros(batch, 16, 8),
            encoder_hidden_states=torch.zeros(batch, text, 8),
            pooled_projections=torch.zeros(batch, 4),
            timestep=torch.zeros(batch),
            img_ids=torch.zeros(16, 3),
            txt_ids=torch.zeros(text, 3),
            joint_attention_kwargs=None,
        )

    assert batch_dim_arguments(flux_call(2, 3)) == (
        "hidden_states",
        "encoder_hidden_states",
        "pooled_projections",
        "timestep",
    )
    # two prompts of two tokens: the text ids [2, 3] look batched as much as the pooled projections
    call = flux_call(2, 2)
    assert batch_dim_arguments(call) is None
    pairs = GuidanceBranches(None, batch_dim_arguments)
    assert pairs._stack(call, dict(call)) is None  # such a pair runs one call after the other


def test_guidance_turned_off_midway_by_a_callback_stops_the_pairing():
    """Diffusers' dynamic-CFG callback sets ``pipe._guidance_scale`` so that the steps after it make the
    conditional call only: Wan's and FLUX.2 Klein's loops ask ``do_classifier_free_guidance`` at every
    step, and so does their pairing rule, at each call (no result waits for a pair that never comes)."""
    from types import SimpleNamespace

    from omni_accel.models.flux2 import cfg_pairs as klein_pairs
    from omni_accel.models.wan import cfg_pairs as wan_pairs

    for rule, config in ((wan_pairs, None), (klein_pairs, SimpleNamespace(is_distilled=False))):
        pipe = SimpleNamespace(config=config, do_classifier_free_guidance=True)
        pairs, model = GuidanceBranches(None, BATCHED), _Model()
        like = lambda call: torch.empty_like(call["hidden_states"])  # noqa: E731
        pairs.pairing = rule({"self": pipe, "guidance_scale": 4.0})
        cond, uncond = _call(0), _call(1)
        got = _step(pairs, model, cond, uncond)
        assert all(torch.equal(g, w) for g, w in zip(got, _expected(cond, uncond), strict=True))
        pipe.do_classifier_free_guidance = False  # what the callback did, read through the property
        for step in range(2):
            pairs.branch = "cond"
            alone = _call(2 + step)
            assert torch.equal(pairs.run(model, alone, like), _Model()(**alone)), rule
        pairs.finish_call(completed=True)
        assert model.batches == [2, 1, 1]


class _Seen(Exception):
    pass


def test_rope_tuples_stay_whole_beside_the_halved_batch():
    """HunyuanDiT's, CogVideoX's and Allegro's pipelines pass their RoPE as a tuple of tables as long as the
    sequence: beside a CFG batch of two it looks like one tensor per sample, and the generic tier could not
    tell the batch at all, so cfg=2 ran every call whole on both ranks. The registry names them unbatched."""
    import tiny_guided_pipelines as tiny

    from omni_accel.models.generic import generic_parallel_plan
    from omni_accel.parallel.config import ParallelConfig
    from omni_accel.parallel.hooks import bound_arguments

    builders = (tiny.tiny_hunyuandit_pipeline, tiny.tiny_cogvideox_pipeline, tiny.tiny_allegro_pipeline)
    for build, call in (case for case in tiny.batched_calls() if case[0] in builders):
        pipe, seen = build(), []

        def record(module, args, kwargs, seen=seen):
            seen.append(bound_arguments(module, args, kwargs))
            raise _Seen  # the first call's arguments are all this needs

        pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
        with pytest.raises(_Seen):
            pipe(**call, num_inference_steps=1)
        plan = generic_parallel_plan(pipe.transformer, ParallelConfig(cfg=2), routed=True)
        batched = plan.batched_inputs(seen[0])
        assert batched is not None and "hidden_states" in batched, build.__name__
        assert "image_rotary_emb" not in batched and isinstance(seen[0]["image_rotary_emb"], tuple)
