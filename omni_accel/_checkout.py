"""``omni_accel.patches`` from a plain checkout.

The patches live in the top-level ``patches/`` folder (the documented home of our third-party patches);
an install maps that folder to ``omni_accel.patches`` (setup.cfg's ``package_dir``). Run from a checkout
on ``PYTHONPATH`` nothing maps it, so the folder next to this package is loaded under that name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _ensure_patches_importable(package: str) -> None:
    name = f"{package}.patches"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "patches"
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None:
        raise ImportError(f"{name} is missing: neither installed nor found at {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    sys.modules[package].patches = module


_ensure_patches_importable(__package__)
