"""A catalogue of bad inputs: each raises the right exception with a message that names what
is wrong (key path, shape, spec, mesh) and how to fix it.

The cases live in ``tests/_catalogue_workers.py``. Each runs in-process (on a simulated
2-rank mesh, or without a process group for checkpoints); those that reach collectives,
files or c10d also run on 2 real gloo processes, where the same wording must come out (or
the wording of real processes, where it differs). Cases about ranks that hold different
things run on real processes only: a simulation is one program for every rank.
``python -m tests._catalogue_workers`` prints the catalogue as a table.
"""

from __future__ import annotations

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


def test_the_docs_count_the_catalogue():
    # docs/guides/checkpoints.md's "Bad input" says how many cases there are and where they
    # run: the same four numbers as the catalogue (a new case changes them; update the page).
    page = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "checkpoints.md").read_text()
    found = re.search(
        r"`tests/test_catalogue\.py` checks (\d+) cases \(.*?\): (\d+) in-process,\s+"
        r"(\d+) of them again on 2 gloo processes, and (\d+) only there",
        page,
        re.S,
    )
    assert found, "docs/guides/checkpoints.md no longer says how many cases the catalogue has"
    in_process = [c for c in W.CASES if c.where != "real"]
    counts = (
        len(W.CASES),
        len(in_process),
        sum(c.real for c in in_process),
        sum(c.where == "real" for c in W.CASES),
    )
    assert tuple(map(int, found.groups())) == counts, (
        "docs/guides/checkpoints.md's catalogue counts (cases, in-process, of them again on "
        f"gloo, gloo only) are {found.groups()}, the catalogue's {counts}"
    )


IN_PROCESS = [c for c in W.CASES if c.where != "real"]


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.id for c in IN_PROCESS])
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
            if not is_expected_type or not re.search(case.real_pattern, message, re.S):
                failures.append(f"{case.id} on rank {rank}: {name}: {message}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- leaks

_LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)

# What a process started later does first when it sets up its own single-process group: bind
# MASTER_PORT if the environment names one (TCPStore's server), else any free port.
_CHILD = """
import os, socket
port = int(os.environ.get("MASTER_PORT", "0"))
with socket.socket() as s:
    s.bind(("127.0.0.1", port))
    print("bound", port, os.environ.get("RANK"))
"""


def test_make_mesh_outside_torchrun_leaves_the_environment_as_it_was(monkeypatch):
    import torch.distributed as dist

    assert not dist.is_initialized()  # otherwise make_mesh would start no group here
    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # set by the user: it must stay
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    try:
        mesh = ff.make_mesh({"dp": 1}, device_type="cpu")
        assert mesh.mesh_dim_names == ("dp",)
        assert dist.is_initialized() and dist.get_world_size() == 1
        after = {k: os.environ.get(k) for k in _LAUNCH_VARS}
        child = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert after == before
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.startswith("bound 0 None"), child.stdout


def test_units_take_a_list_or_set_of_classes_as_fsdp1_does():
    # FSDP1's transformer_layer_cls is a set of classes: the same here, as a list or a set,
    # and mixed with module-path patterns.
    from torch import nn

    model = W.mlp()
    expected = ff.find_units(model, nn.Linear)
    assert expected == ["0", "2"]
    assert ff.find_units(model, [nn.Linear]) == expected
    assert ff.find_units(model, {nn.Linear}) == expected
    assert ff.find_units(model, [nn.ReLU, "2"]) == ["1", "2"]
    assert ff.find_units(model, "2") == ["2"]
