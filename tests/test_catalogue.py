"""A catalogue of bad inputs: each raises the right exception with a message that names what
is wrong (key path, shape, spec, mesh) and how to fix it.

The cases live in ``tests/_catalogue_workers.py``. Each runs in-process (on a simulated
2-rank mesh, or without a process group for checkpoints); those that reach collectives,
files or c10d also run on 2 real gloo processes, where the same wording must come out.
``python -m tests._catalogue_workers`` prints the catalogue as a table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import functional_fsdp as ff

from . import _catalogue_workers as W

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory that an unprivileged user can traverse (for the read-only case)."""
    root = Path(tempfile.mkdtemp(prefix="ff-catalogue-"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_catalogue_has_at_least_30_distinct_cases():
    ids = [c.id for c in W.CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 30
    assert sum(c.real for c in W.CASES) >= 15


@pytest.mark.parametrize("case", W.CASES, ids=[c.id for c in W.CASES])
def test_bad_input_raises_a_clear_error(case: W.Case, shared_tmp: Path):
    ctx_tmp = shared_tmp / case.id
    ctx_tmp.mkdir()
    os.chmod(ctx_tmp, 0o755)
    if case.where == "plain":
        with pytest.raises(case.error, match=re.compile(case.pattern, re.S)):
            case.run(W.Ctx(None, ctx_tmp, real=False))
        return
    with (
        ff.simulated_mesh({"dp": 2}) as mesh,
        pytest.raises(case.error, match=re.compile(case.pattern, re.S)),
    ):
        case.run(W.Ctx(mesh, ctx_tmp, real=False))


@pytest.mark.multiprocess
def test_bad_inputs_on_real_gloo_processes(pools, shared_tmp: Path):
    cases = [c for c in W.CASES if c.real]
    for c in cases:
        (shared_tmp / c.id).mkdir()
        os.chmod(shared_tmp / c.id, 0o755)
    per_rank = pools.run(2, W.run_real, str(shared_tmp), [c.id for c in cases])
    failures = []
    for case in cases:
        for rank, results in enumerate(per_rank):
            name, message, is_expected_type = results[case.id]
            if not is_expected_type or not re.search(case.pattern, message, re.S):
                failures.append(f"{case.id} on rank {rank}: {name}: {message}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- leaks

_LEAK_PROBE = r"""
import json, os, subprocess, sys
import functional_fsdp as ff

keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
before = {k: os.environ.get(k) for k in keys}
mesh = ff.make_mesh({"dp": 1}, device_type="cpu")
after = {k: os.environ.get(k) for k in keys}
# A process started now sets up its own single-process group: it must find a free port.
child = subprocess.run(
    [sys.executable, "-c", "import functional_fsdp as ff; "
     "print(ff.make_mesh({'dp': 1}, device_type='cpu').mesh_dim_names)"],
    capture_output=True, text=True, timeout=120,
)
print(json.dumps({"before": before, "after": after, "child_rc": child.returncode,
                  "child_out": child.stdout + child.stderr[-2000:]}))
"""


def test_make_mesh_outside_torchrun_leaves_the_environment_as_it_was():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    run = subprocess.run(
        [sys.executable, "-c", _LEAK_PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["before"]["MASTER_ADDR"] == "127.0.0.1"  # a variable the user set stays
    assert out["after"] == out["before"]
    assert out["child_rc"] == 0 and "('dp',)" in out["child_out"], out["child_out"]
