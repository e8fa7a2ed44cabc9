"""``parallel="auto"``: the layout rules, and the one-rank case (the multi-rank runs are in test_parallel.py)."""

import pytest

import omni_accel
from omni_accel import ParallelConfig
from omni_accel.parallel.auto import choose_layout


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


def test_auto_refusals_name_the_cause_and_the_layouts_left(monkeypatch):
    """Over several ranks: a native model with native=False is refused for that option (not for lacking
    native blocks, which it has), and a model without any names the layouts it can still take."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    flux = omni_accel.tiny_flux_pipeline(seed=0)
    with pytest.raises(ValueError, match="native blocks, and native=False turns them off; drop native=False"):
        omni_accel.accelerate(flux, parallel="auto", native=False)
    assert not hasattr(flux, "_omni_accel_state")
    with pytest.raises(
        ValueError,
        match=r"StableDiffusion3Pipeline has none: run it on one rank, or pass parallel=ParallelConfig",
    ):
        omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0), parallel="auto")


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
