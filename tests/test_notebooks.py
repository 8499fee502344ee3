"""The notebooks run, and the outputs committed with them are fresh.

Each notebook is executed once, in a fresh kernel (this is the suite's only execution of
them: pytest does not collect notebooks itself). An error in any cell fails the test, and
so do committed outputs that differ from the execution's (beyond the rounding of printed
numbers and the bytes of images): the docs site shows the committed outputs, so they must be
what the notebook prints today. Refresh them with ``python -m tests._notebooks``.
"""

from __future__ import annotations

import copy
import re

import nbformat
import pytest

from . import _notebooks as N

PATHS = sorted(N.NOTEBOOKS.glob("*.ipynb"))


def test_every_notebook_is_tested_and_committed_with_outputs():
    assert {p.stem for p in PATHS} >= {"quickstart", "layouts", "strategies", "planner"}
    for path in PATHS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert any(c.get("outputs") for c in code), f"{path.name} is committed without outputs"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_its_committed_outputs_are_fresh(path):
    executed = N.execute(path)
    stale = N.same(nbformat.read(path, as_version=4), executed)
    assert stale is None, (
        f"{path.name}: the committed outputs are stale ({stale}). Refresh them with "
        f"`python -m tests._notebooks {path.stem}` and commit the notebook."
    )


def test_the_comparison_can_fail():
    committed = nbformat.read(N.NOTEBOOKS / "quickstart.ipynb", as_version=4)
    changed = copy.deepcopy(committed)
    assert N.same(committed, changed) is None
    cell = next(c for c in changed.cells if c.cell_type == "code" and c.get("outputs"))
    stream = next(o for o in cell.outputs if o.output_type == "stream")
    stream.text = stream.text.replace("units", "unit")
    assert "stream stdout differs" in N.same(committed, changed)
    # Printed numbers may differ in the last digits (another machine), not more.
    numbers = copy.deepcopy(committed)
    cell = next(c for c in numbers.cells if c.cell_type == "code" and "sharded loss" in c.source)
    stream = next(o for o in cell.outputs if o.output_type == "stream")
    digits = re.search(r"sharded loss (\d+\.\d+)", stream.text).group(1)
    stream.text = stream.text.replace(digits, f"{float(digits) * 1.01:.6f}")
    assert "differs" in N.same(committed, numbers)
