"""``import omni_accel`` works however it is installed: from a wheel (built here, sdist too) and from a
plain checkout on PYTHONPATH; in both, ``omni_accel.patches`` is the top-level ``patches/`` folder."""

import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Import from one place only: drop the editable install's finder, put ``where`` first on the path.
_PROBE = """
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, {where!r})
import omni_accel, omni_accel.patches
from omni_accel.patches import pair_cfg_calls
assert omni_accel.__file__.startswith({where!r}), omni_accel.__file__
assert pair_cfg_calls.__file__.startswith({where!r}), pair_cfg_calls.__file__
omni_accel.patches.check_applicable("hook_chains")
print("ok")
"""


def _probe(where: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(where=str(where))], capture_output=True, text=True, cwd="/"
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_import_from_a_plain_checkout(tmp_path):
    for folder in ("omni_accel", "patches"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    _probe(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools is not installed")
def test_wheel_and_sdist_build_and_the_wheel_imports(tmp_path):
    source, out = tmp_path / "src", tmp_path / "dist"
    for name in ("omni_accel", "patches"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    build = (
        "from setuptools import build_meta as b; "
        f"print('BUILT', b.build_wheel({str(out)!r}), b.build_sdist({str(out)!r}))"
    )
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, sdist = done.stdout.split("BUILT")[-1].split()
    with zipfile.ZipFile(out / wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "omni-accel = omni_accel.cli:main" in archive.read(entry_points).decode()
    assert "omni_accel/patches/pair_cfg_calls.py" in names and "omni_accel/utils/logging.py" in names
    assert "omni_accel/py.typed" in names  # type checkers read the package's hints
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names)
    with tarfile.open(out / sdist) as archive:
        assert any(n.endswith("patches/pair_cfg_calls.py") for n in archive.getnames())
    target = tmp_path / "site"
    with zipfile.ZipFile(out / wheel) as archive:
        archive.extractall(target)  # what pip puts in site-packages
    _probe(target)
