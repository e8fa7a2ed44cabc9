"""Zero-code acceleration: an unmodified script run through ``omni_accel.run``, and ``enable()`` for
pipelines however they are built."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from diffusers import AutoPipelineForText2Image, DiffusionPipeline, FluxImg2ImgPipeline, FluxPipeline

import omni_accel
from omni_accel.auto import options_from_env, parse_parallel

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "diffusers_script.py"


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_flux")
    omni_accel.tiny_flux_pipeline(seed=0).save_pretrained(path)
    return path


def _mode(pipe) -> str:
    return omni_accel.describe(pipe).components[0].mode


def test_an_unmodified_script_runs_accelerated(saved_pipeline, tmp_path):
    """At the default verbosity the run says, in one line per pipeline, what it accelerated."""
    env = {k: v for k, v in os.environ.items() if k != "OMNI_ACCEL_VERBOSITY"}
    plain, fast = tmp_path / "plain.pt", tmp_path / "fast.pt"
    subprocess.run([sys.executable, str(SCRIPT), str(saved_pipeline), str(plain)], check=True, env=env)
    done = subprocess.run(
        [sys.executable, "-m", "omni_accel.run", str(SCRIPT), str(saved_pipeline), str(fast)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    notices = [line for line in done.stderr.splitlines() if line.startswith("[omni_accel] NOTICE")]
    assert notices == [
        "[omni_accel] NOTICE zero-code: FluxPipeline accelerated (transformer native); omni_accel.describe(pipe) "
        "for details, OMNI_ACCEL_VERBOSITY=warning silences this"
    ], done.stderr[-3000:]
    assert "INFO" not in done.stderr
    assert rel_err(torch.load(fast), torch.load(plain)) <= 1e-5


def test_enable_accelerates_pipelines_however_they_are_built(saved_pipeline):
    omni_accel.enable()
    try:
        loaded = DiffusionPipeline.from_pretrained(saved_pipeline)
        auto = AutoPipelineForText2Image.from_pretrained(saved_pipeline)
        built = omni_accel.tiny_flux_pipeline(seed=0)  # a constructor call
        sibling = FluxImg2ImgPipeline.from_pipe(built)
        assert [_mode(p) for p in (loaded, auto, built)] == ["native"] * 3
        assert _mode(sibling) == "native (shared)"  # its transformer is the accelerated one of `built`
    finally:
        omni_accel.disable()
    after = omni_accel.tiny_flux_pipeline(seed=0)
    assert getattr(after, "_omni_accel_state", None) is None
    assert "__init_subclass__" not in vars(DiffusionPipeline)  # disable() left no patch behind
    kwargs = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="latent")
    expected = after(**kwargs, generator=torch.Generator().manual_seed(0)).images
    got = loaded(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert rel_err(got, expected) <= 1e-5


@pytest.mark.parametrize(
    ("by_hand", "zero_code", "mode"),
    [
        ({}, {"cuda_graphs": False}, "native"),
        ({"native": False}, {"native": False, "attention": "sdpa_math"}, "routed"),
    ],
)
def test_a_sibling_of_a_pipeline_accelerated_by_hand_with_other_options_shares_its_setup(
    by_hand, zero_code, mode, caplog
):
    """The sibling was refused (its transformer asked other options) and warned 'left as plain Diffusers',
    though its transformer ran the owner's setup and ``describe``/``restore`` refused it as not accelerated."""
    kwargs = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="latent")
    plain = FluxPipeline.from_pipe(omni_accel.tiny_flux_pipeline(seed=0))
    expected = plain(**kwargs, generator=torch.Generator().manual_seed(0)).images
    owner = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), **by_hand)
    omni_accel.enable(**zero_code)
    try:
        with caplog.at_level(logging.WARNING, logger="omni_accel"):
            sibling = FluxPipeline.from_pipe(owner)
    finally:
        omni_accel.disable()
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert "left FluxPipeline as plain Diffusers" not in warning
    option = next(iter(set(zero_code) - set(by_hand)))
    assert f"the options {option}=" in warning and repr(zero_code[option]) in warning
    assert _mode(sibling) == f"{mode} (shared)"
    got = sibling(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert rel_err(got, expected) <= 1e-5
    omni_accel.restore(sibling)
    assert _mode(owner) == mode  # the sibling's restore leaves its owner's setup alone


def test_a_sibling_built_under_an_enable_with_other_options_shares_its_setup(caplog):
    """The owner accelerated by zero-code under an earlier ``enable()`` given other options (not by hand):
    the sibling shares its setup, the warning names the options, and its remedy (restore the owner, then
    accelerate the sibling with them) works."""
    omni_accel.enable(cuda_graphs=False)
    try:
        owner = omni_accel.tiny_flux_pipeline(seed=0)
        omni_accel.enable(projection_cache_bytes=0)
        with caplog.at_level(logging.WARNING, logger="omni_accel"):
            sibling = FluxImg2ImgPipeline.from_pipe(owner)
    finally:
        omni_accel.disable()
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert "accelerated with projection_cache_bytes=None, cuda_graphs=False" in warning
    assert "the options projection_cache_bytes=0, cuda_graphs=None it was to be" in warning
    assert _mode(sibling) == "native (shared)"
    omni_accel.restore(owner)
    omni_accel.accelerate(sibling, projection_cache_bytes=0)
    assert _mode(sibling) == "native"


def test_accelerating_a_pipeline_zero_code_accelerated_says_who_did():
    """It said 'already accelerated' to a script calling accelerate once (zero-code did it as it was built)."""
    omni_accel.enable()
    try:
        pipe = omni_accel.tiny_flux_pipeline(seed=0)
        with pytest.raises(
            RuntimeError, match=r"already accelerated by zero-code acceleration as it was built"
        ):
            omni_accel.accelerate(pipe, attention="sdpa_math")
    finally:
        omni_accel.disable()
    omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, attention="sdpa_math")
    with pytest.raises(RuntimeError, match=r"already accelerated; call omni_accel.restore\(pipe\) first"):
        omni_accel.accelerate(pipe)


def test_enable_checks_options_at_once():
    with pytest.raises(TypeError):
        omni_accel.enable(no_such_option=1)
    assert not omni_accel.auto.enabled()


def test_enable_takes_a_config_as_accelerate_does():
    """``enable(config=AccelConfig(...))`` was refused as an unknown option, though enable takes the options
    of accelerate: each pipeline built gets the config, with the keyword options over it."""
    config = omni_accel.AccelConfig(cuda_graphs=False, projection_cache_bytes=0)
    omni_accel.enable(config=config, projection_cache_bytes=1 << 20)
    try:
        pipe = omni_accel.tiny_flux_pipeline(seed=0)
    finally:
        omni_accel.disable()
    expected = omni_accel.AccelConfig(cuda_graphs=False, projection_cache_bytes=1 << 20)
    assert pipe._omni_accel_state.config == expected
    with pytest.raises(TypeError, match="config must be an omni_accel.AccelConfig"):
        omni_accel.enable({"native": False})
    assert not omni_accel.auto.enabled()


def test_options_from_the_environment():
    env = {
        "OMNI_ACCEL_ATTENTION": "sdpa_math",
        "OMNI_ACCEL_COMPILE": "1",
        "OMNI_ACCEL_PARALLEL": "tp=2, cfg=2",
        "OMNI_ACCEL_PROJECTION_CACHE_BYTES": "0",
        "OMNI_ACCEL_QUANTIZE": "fp8",
    }
    options = options_from_env(env)
    assert options == {
        "attention": "sdpa_math",
        "compile": True,
        "parallel": omni_accel.ParallelConfig(tp=2, cfg=2),
        "projection_cache_bytes": 0,
        "quantize": "fp8",
    }
    with pytest.raises(ValueError, match="items like tp=2"):
        parse_parallel("tp2")
    # a value outside the accepted ones left the option silently at its default, or named no variable
    with pytest.raises(ValueError, match="OMNI_ACCEL_CUDA_GRAPHS='off': expected one of 1, true, yes, 0"):
        options_from_env({"OMNI_ACCEL_CUDA_GRAPHS": "off"})
    with pytest.raises(ValueError, match="OMNI_ACCEL_COMPILE='2': expected one of"):
        options_from_env({"OMNI_ACCEL_COMPILE": "2"})
    with pytest.raises(
        ValueError, match="OMNI_ACCEL_PROJECTION_CACHE_BYTES='1e6': expected a number of bytes"
    ):
        options_from_env({"OMNI_ACCEL_PROJECTION_CACHE_BYTES": "1e6"})
    from omni_accel.run import build_parser, options_from_args

    args = build_parser().parse_args(["--quantize", "fp8", "x.py"])
    assert options_from_args(args)["quantize"] == "fp8"


def test_compile_turned_off_from_the_environment_or_the_command_line(monkeypatch):
    """OMNI_ACCEL_COMPILE=0 gave the automatic choice (the generic tier compiles on CUDA), the same as unset,
    and `omni-accel run` had no way to turn the compile off."""
    from omni_accel.run import build_parser, options_from_args

    assert options_from_env({"OMNI_ACCEL_COMPILE": "0"}) == {"compile": False}
    assert options_from_env({"OMNI_ACCEL_COMPILE": ""}) == {}
    monkeypatch.setenv("OMNI_ACCEL_COMPILE", "1")
    assert options_from_args(build_parser().parse_args(["--no-compile", "x.py"]))["compile"] is False
    monkeypatch.setenv("OMNI_ACCEL_COMPILE", "0")
    assert options_from_args(build_parser().parse_args(["--compile", "x.py"]))["compile"] is True
    assert options_from_args(build_parser().parse_args(["x.py"]))["compile"] is False


def test_a_parallel_degree_of_zero_is_refused_not_dropped():
    """``--tp 0`` ran the script without a layout, as if no degree were given."""
    from omni_accel.run import build_parser, options_from_args

    with pytest.raises(ValueError, match="ParallelConfig.tp must be a positive int, got 0"):
        options_from_args(build_parser().parse_args(["--tp", "0", "x.py"]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cfg", "3", str(SCRIPT)], "cfg=3: classifier-free guidance has two branches"),
        (["--tp", "2", "--auto-parallel", str(SCRIPT)], "give --auto-parallel or parallel degrees, not both"),
        (["no_such_script.py"], "no script at 'no_such_script.py'"),
    ],
)
def test_a_wrong_run_option_is_a_usage_error(argv, message, capsys):
    """It was a traceback with exit status 1, like an error of the script itself."""
    from omni_accel import run

    with pytest.raises(SystemExit) as exited:
        run.main(argv)
    assert exited.value.code == 2
    assert f"omni-accel run: error: {message}" in capsys.readouterr().err
    assert not omni_accel.auto.enabled()


@pytest.mark.parametrize(
    ("ours", "given"),
    [([], ["--flag"]), ([], ["--", "--flag"]), ([], ["--"]), (["--compile", "--"], ["--", "b"])],
)
def test_a_script_run_gets_the_path_and_arguments_python_gives_it(ours, given, tmp_path, monkeypatch):
    """``python script.py`` finds the modules in the script's folder; ``omni-accel run script.py`` run from
    another folder raised ModuleNotFoundError (runpy puts no file's folder on the path). The script gets its
    arguments as given: a ``--`` after its name was dropped (argparse's end of options)."""
    from omni_accel import run

    (tmp_path / "omni_beside_helper.py").write_text("VALUE = 42\n")
    (tmp_path / "script.py").write_text(
        "import sys\nfrom omni_beside_helper import VALUE\nsys.modules['omni_beside_result'] = (VALUE, list(sys.argv))\n"
    )
    monkeypatch.chdir(tmp_path.parent)
    script = f"{tmp_path.name}/script.py"  # relative, as given (sys.argv[0]: absolute, see below)
    monkeypatch.delitem(sys.modules, "omni_beside_helper", raising=False)
    monkeypatch.delitem(sys.modules, "omni_beside_result", raising=False)
    path, argv = list(sys.path), list(sys.argv)
    run.main([*ours, script, *given])
    assert sys.modules.pop("omni_beside_result") == (42, [str(Path.cwd() / script), *given])
    assert (sys.path, sys.argv) == (path, argv)  # as they were: the next script (or test) starts afresh


@pytest.mark.parametrize("folder", [False, True])
def test_a_script_runs_with_the_absolute_file_and_path_python_gives_it(folder, tmp_path, monkeypatch):
    """``python script.py`` (and ``python folder``) gives the script an absolute ``__file__`` and puts an
    absolute folder on ``sys.path`` (Python 3.9+), which a script that changes directory relies on; ours
    were relative as given. runpy sets ``sys.argv[0]`` to the path it runs, so that is absolute too (Python
    keeps it as given: the one difference left, short of rewriting runpy)."""
    from omni_accel import run

    code = "import sys\nsys.modules['omni_where_result'] = (__file__, sys.path[0])\n"
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "__main__.py").write_text(code)
    (tmp_path / "main" / "script.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "omni_where_result", raising=False)
    run.main(["main" if folder else "main/script.py"])
    where = Path.cwd() / "main"
    assert sys.modules.pop("omni_where_result") == (
        str(where / ("__main__.py" if folder else "script.py")),
        str(where),
    )


def test_ipython_extension_enables_and_disables():
    omni_accel.load_ipython_extension(None)
    try:
        assert omni_accel.auto.enabled()
    finally:
        omni_accel.unload_ipython_extension(None)
    assert not omni_accel.auto.enabled()


def _torchrun_ranks(rank: int, world: int, saved: str, out_dir: str) -> None:
    """What ``torchrun --nproc-per-node 2 -m omni_accel.run --tp 2 SCRIPT ...`` does on each rank."""
    from omni_accel import run

    run.main(["--tp", "2", str(SCRIPT), saved, f"{out_dir}/rank{rank}.pt"])


@pytest.mark.multirank
def test_an_unmodified_script_under_torchrun(saved_pipeline, tmp_path):
    from multirank import run_multirank

    plain = tmp_path / "plain.pt"
    subprocess.run([sys.executable, str(SCRIPT), str(saved_pipeline), str(plain)], check=True)
    run_multirank(_torchrun_ranks, 2, str(saved_pipeline), str(tmp_path), init=False, timeout=300)
    expected = torch.load(plain)
    for rank in range(2):
        assert rel_err(torch.load(tmp_path / f"rank{rank}.pt"), expected) <= 1e-5
