"""``parallel="auto"``: the layout rules, and the one-rank case (the multi-rank runs are in test_parallel.py)."""

import re

import pytest

import omni_accel
from omni_accel import ParallelConfig
from omni_accel.parallel.auto import choose_generic_layout, choose_layout


@pytest.mark.parametrize(
    "world, heads, cfg, sequence, expected",
    [
        (2, 24, False, True, ParallelConfig(ulysses=2)),  # FLUX where ranks cannot write each other's memory
        (2, 40, True, True, ParallelConfig(cfg=2)),  # Wan with guidance: one branch per rank
        (2, 40, False, True, ParallelConfig(ulysses=2)),
        (4, 40, True, True, ParallelConfig(ulysses=2, cfg=2)),
        (4, 24, False, True, ParallelConfig(ulysses=4)),
        (8, 24, False, True, ParallelConfig(ulysses=8)),
        (8, 40, True, True, ParallelConfig(ulysses=4, cfg=2)),
        (8, 6, False, True, ParallelConfig(ulysses=2, ring=4)),  # Ulysses as far as the heads allow
        (3, 24, True, True, ParallelConfig(ulysses=3)),  # odd: no CFG split
        (4, 24, False, False, ParallelConfig(tp=4)),  # no sequence plan: tensor parallel only
    ],
)
def test_layout_rules(world, heads, cfg, sequence, expected):
    chosen = choose_layout(world, heads, cfg_by_default=cfg, sequence_plan=sequence)
    assert chosen.config == expected, chosen
    assert chosen.reason


@pytest.mark.parametrize(
    "world, cfg, expected",
    [
        (2, False, ParallelConfig(ring=2)),  # FLUX on one machine: the fastest measured two-rank layout
        (4, True, ParallelConfig(ring=2, cfg=2)),
        (4, False, ParallelConfig(ulysses=4)),  # beyond two ranks not measured: as without the hint
    ],
)
def test_ring_first_models_take_the_ring_on_two_ranks(world, cfg, expected):
    chosen = choose_layout(world, 24, cfg_by_default=cfg, sequence_plan=True, ring_first=True)
    assert chosen.config == expected, chosen
    assert expected.ring == 1 or "peer writes" in chosen.reason


def test_layout_errors_and_one_rank():
    assert choose_layout(1, 24, cfg_by_default=True, sequence_plan=True).config is None
    with pytest.raises(ValueError, match="parallel='auto' cannot spread this model over 4 ranks"):
        choose_layout(4, 6, cfg_by_default=False, sequence_plan=False)


def test_auto_on_one_rank_runs_unsplit(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel="auto")
    report = str(omni_accel.describe(pipe))
    assert "parallel='auto': one rank: nothing to spread" in report, report
    sd3 = omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0), parallel="auto")
    assert omni_accel.describe(sd3).components[0].mode == "routed"
    with pytest.raises(TypeError, match="parallel must be an omni_accel.ParallelConfig or 'auto'"):
        omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel="tp=2")


def test_auto_from_the_environment_and_the_command_line():
    from omni_accel.auto import options_from_env
    from omni_accel.run import build_parser, options_from_args

    assert options_from_env({"OMNI_ACCEL_PARALLEL": "auto"}) == {"parallel": "auto"}
    parser = build_parser()
    assert options_from_args(parser.parse_args(["--auto-parallel", "x.py"]))["parallel"] == "auto"
    with pytest.raises(ValueError, match="give --auto-parallel or parallel degrees"):
        options_from_args(parser.parse_args(["--auto-parallel", "--tp", "2", "x.py"]))


def test_auto_reads_the_pairing_rule_with_the_pipeline_in_the_arguments():
    """FLUX.2 klein's rule reads the pipeline's ``is_distilled``: a guided call of a base checkpoint makes
    two transformer calls a step, which auto gives a rank each (cfg=2)."""
    from omni_accel.models.registry import spec_for
    from omni_accel.pipeline_calls import on_first_call

    pipe = omni_accel.tiny_flux2_klein_pipeline(seed=0)
    assert pipe.config.is_distilled is False
    rule = spec_for(pipe.transformer).native_model().cfg_pairing
    seen = []
    on_first_call(pipe, seen.append)
    pipe(prompt="a cat", height=32, width=32, guidance_scale=4.0, num_inference_steps=1, output_type="latent")
    assert rule(seen[0])


def test_first_call_hook_sees_the_arguments_and_retries_after_an_error():
    from omni_accel.pipeline_calls import on_first_call

    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    seen = []

    def action(arguments):
        seen.append(arguments)
        if len(seen) == 1:
            raise RuntimeError("not yet")

    undo = on_first_call(pipe, action)
    assert type(pipe).__name__ == "FluxPipeline"  # saved configs keep the class name
    call = dict(prompt="a cat", num_inference_steps=1, output_type="latent")
    with pytest.raises(RuntimeError, match="not yet"):
        pipe(**call)
    pipe(**call, true_cfg_scale=2.0)  # the hook stayed after the error: this call runs the action again
    assert seen[1]["true_cfg_scale"] == 2.0 and seen[1]["guidance_scale"] == 3.5  # defaults included
    assert seen[1]["self"] is pipe
    pipe(**call)
    assert len(seen) == 2 and type(pipe) is type(omni_accel.tiny_flux_pipeline(seed=0))
    undo()  # a no-op once the first call happened


def test_auto_takes_the_generic_tier_where_a_layout_fits_and_refuses_where_none_can(monkeypatch):
    """Over several ranks a model without native blocks (or with native=False) waits for the first call
    where its Diffusers _cp_plan or its pipelines' guidance rule can lay it out: FLUX with native=False (a
    _cp_plan), SD3 (its guidance batched, cfg=2 on two ranks). Refused at accelerate, nothing swapped: SD3
    over four ranks (cfg=2 alone takes two) and Z-Image with native=False (neither)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for pipe, options in (
        (omni_accel.tiny_flux_pipeline(seed=0), {"native": False}),
        (omni_accel.tiny_sd3_pipeline(seed=0), {}),
    ):
        omni_accel.accelerate(pipe, parallel="auto", **options)
        assert "parallel='auto': decided at the first pipeline call" in str(omni_accel.describe(pipe))
        omni_accel.restore(pipe)
    refused = (
        (
            "4",
            omni_accel.tiny_sd3_pipeline(seed=0),
            {},
            "pipe.transformer (SD3Transformer2DModel) by its guidance branches alone, one per rank (cfg=2: it "
            "has no native blocks and no Diffusers _cp_plan to split its sequence), which takes 2 ranks, and 4 "
            "were started; launch 2",
        ),
        (
            "2",
            omni_accel.tiny_zimage_pipeline(seed=0),
            {"native": False},
            "cannot choose a layout for pipe.transformer (ZImageTransformer2DModel): it has no native blocks, "
            "no Diffusers _cp_plan to split its sequence, and no rule telling whether its pipeline's calls run "
            "both guidance branches. Run it on one rank, or pass parallel=ParallelConfig(cfg=2)",
        ),
    )
    for world, pipe, options, message in refused:
        monkeypatch.setenv("WORLD_SIZE", world)
        blocks = list(pipe.transformer.modules())
        with pytest.raises(ValueError, match=re.escape(message)):
            omni_accel.accelerate(pipe, parallel="auto", **options)
        assert not hasattr(pipe, "_omni_accel_state") and list(pipe.transformer.modules()) == blocks


@pytest.mark.parametrize(
    "world, guidance, sequence, expected",
    [
        (2, True, False, ParallelConfig(cfg=2)),  # SD3 with guidance: one branch per rank
        (2, True, True, ParallelConfig(cfg=2)),  # Qwen-Image (native=False) with true CFG
        (2, False, True, ParallelConfig(ulysses=2)),  # FLUX (native=False) without: its _cp_plan
        (4, True, True, ParallelConfig(ulysses=2, cfg=2)),
        (8, False, True, ParallelConfig(ulysses=2, ring=4)),  # Ulysses as far as the 2 heads allow
    ],
)
def test_generic_layout_rules(world, guidance, sequence, expected):
    chosen = choose_generic_layout(world, 2, "pipe.transformer (X)", guidance, sequence_plan=sequence)
    assert chosen.config == expected, chosen
    assert chosen.reason


@pytest.mark.parametrize(
    "world, guidance, message",
    [
        (
            2,
            False,
            "and this first pipeline call runs no classifier-free guidance; make the first call a guided",
        ),
        (4, True, "which takes 2 ranks, and 4 were started; launch 2 (torchrun --nproc-per-node 2)"),
        (3, False, "which takes 2 ranks, and 3 were started"),
    ],
)
def test_generic_layout_refusals_without_a_cp_plan(world, guidance, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        choose_generic_layout(world, 2, "pipe.transformer (X)", guidance, sequence_plan=False)


def test_a_deep_copy_made_before_the_first_call_lays_out_itself_and_restores_itself(monkeypatch):
    """Over several ranks ``parallel="auto"`` waits for the first call. A deep copy made before it spread
    the original at its own first call (the action held the original), and ``restore`` of the copy removed
    the original's hook (its layout would never be applied). One process stands for a rank: the action is
    recorded, not run."""
    import copy

    from omni_accel.api import spread

    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), parallel="auto")
    hooked = type(pipe)
    seen = []
    monkeypatch.setattr(spread, "_apply_auto_layout", lambda called, arguments: seen.append(called))
    twin = copy.deepcopy(pipe)
    twin(prompt="a cat", height=32, width=32, num_inference_steps=1, output_type="latent")
    assert seen == [twin] and type(pipe) is hooked
    omni_accel.restore(copy.deepcopy(pipe))
    assert type(pipe) is hooked
    omni_accel.restore(pipe)
    assert type(pipe) is hooked.__mro__[1]
