"""Every transformer class the installed Diffusers exports, built tiny with random weights, runs through
``omni_accel.accelerate`` with the parity of plain Diffusers (fp32, CPU, <= 1e-5), or is listed with why it
is not built; docs/COVERAGE.md is the table these runs give now."""

from pathlib import Path

import pytest
from tiny_transformers import (
    NOT_BUILT,
    OVERRIDES,
    RECIPES,
    TOLERANCE,
    coverage_table,
    exported_transformers,
    measure,
)

from omni_accel.models.registry import registered_natives

DOC = Path(__file__).resolve().parents[1] / "docs" / "COVERAGE.md"
# Classes that run in plain Diffusers and fail only when accelerated (real defects, kept visible): name ->
# what fails. Each is an xfail(strict=True), so the suite says when one is fixed.
DEFECTS: dict[str, str] = {}


def _params() -> list:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=DEFECTS[name]))
        if name in DEFECTS
        else name
        for name in exported_transformers()
    ]


@pytest.mark.parametrize("name", _params())
def test_accelerated_matches_plain_or_reason_recorded(name):
    row = measure(name)
    if row.reason is not None:  # recorded in NOT_BUILT, or the generic rules' error for a new family
        assert row.reason.strip()
        return
    assert row.defect is None, f"{name} runs in plain Diffusers but not accelerated:\n{row.defect}"
    assert row.parity is not None and row.parity <= TOLERANCE, f"{name}: rel err {row.parity:.3e}"


def test_enumeration_and_tables_agree():
    """The enumeration finds every class we make native, and no override names a class Diffusers dropped."""
    exported = set(exported_transformers())
    assert set(registered_natives()) <= exported
    for table in (NOT_BUILT, OVERRIDES, RECIPES, DEFECTS):
        assert set(table) <= exported, (
            f"entries for classes Diffusers no longer exports: {set(table) - exported}"
        )
    unused = set(NOT_BUILT) & (set(RECIPES) | set(OVERRIDES))
    assert not unused, f"listed as not built, yet given a recipe or an override: {unused}"


def test_coverage_doc_is_current():
    current = DOC.read_text() if DOC.exists() else ""
    assert current == coverage_table(), (
        "docs/COVERAGE.md differs from what the builders give now: regenerate it with "
        "`.venv/bin/python benchmarks/coverage_table.py`"
    )
