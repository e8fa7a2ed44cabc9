"""The example script and the quickstart notebook are what users copy first, so they must run as shipped.

Both run on the tiny offline FLUX pipeline on CPU; the script's parity numbers are checked too, since an
example that prints a large difference would teach users that acceleration changes their images.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def _load_example(name: str) -> ModuleType:
    """Imports ``examples/<name>.py`` by path: the examples are scripts, not a package."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_text_to_image_example_matches_plain_diffusers(tmp_path: Path) -> None:
    example = _load_example("text_to_image")
    output = tmp_path / "image.png"
    args = ["--device", "cpu", "--dtype", "float32", "--steps", "2", "--height", "32", "--width", "32"]
    result = example.main([*args, "--runs", "1", "--output", str(output)])

    assert result["image_max_abs_diff"] < 1e-4
    assert result["latent_rel_err"] < 1e-5
    assert result["within_tolerance"]
    assert result["plain_s"] > 0 and result["accelerated_s"] > 0
    assert output.read_bytes().startswith(b"\x89PNG")


def test_the_example_makes_a_wan_video(tmp_path: Path) -> None:
    example = _load_example("text_to_image")
    output = tmp_path / "video.gif"
    args = ["--model", "tiny-wan", "--frames", "5", "--steps", "2", "--height", "32", "--width", "32"]
    result = example.main([*args, "--device", "cpu", "--runs", "1", "--output", str(output)])
    assert result["within_tolerance"] and result["latent_rel_err"] < 1e-5
    assert output.read_bytes().startswith(b"GIF8")


def test_quickstart_notebook_runs_without_errors() -> None:
    path = ROOT / "notebooks" / "quickstart.ipynb"
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells), "store the notebook without outputs"

    # kernel "python3" is ipykernel in the interpreter running the tests, so it sees this omni_accel.
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell's traceback, on the first error

    # Cells tagged ``raises-exception`` would not stop execute(); the quickstart should have none.
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors


def test_text_to_image_example_under_torchrun(tmp_path: Path) -> None:
    """The same script over two ranks (gloo on CPU) with true CFG paired across them: rank 0 saves."""
    import os
    import subprocess
    import sys

    output = tmp_path / "image.png"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(ROOT / "examples" / "text_to_image.py"), "--steps", "2", "--height", "32", "--width", "32",
               "--cfg", "2", "--negative-prompt", "dark", "--true-cfg-scale", "3", "--runs", "1",
               "--output", str(output)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-> OK" in done.stdout and "paired cond/uncond calls" in done.stdout
    assert done.stdout.count("omni_accel report") == 1  # only rank 0 reports
    assert output.read_bytes().startswith(b"\x89PNG")
