"""Writes docs/COVERAGE.md: for every transformer class the installed Diffusers exports, the tier omni_accel
gives it, its parallel layouts, whether Diffusers declares repeated blocks, and its tiny-model parity (or
why it is not built). The builders live with the tests (``tests/tiny_transformers.py``), which check that
the page stays current.

    .venv/bin/python benchmarks/coverage_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tiny_transformers  # noqa: E402  (the tests' builders, not part of the library)


def main() -> None:
    path = ROOT / "docs" / "COVERAGE.md"
    path.write_text(tiny_transformers.coverage_table())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
