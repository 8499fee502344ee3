"""Checkpoints survive crashes: atomic saves, verified loads, a manager, exact resume.

Every test runs on real gloo processes. Crashes are real SIGKILLs of a rank during a save
(fresh processes that are killed), and what a restarted job sees is checked on the pool.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from functional_fsdp.distributed.process import free_port

from . import _reliability_workers as W

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[1]

# (phase, rank killed there, what the checkpoint path holds afterwards: 1 = the previous
# checkpoint, 2 = the new one). Phases before the rename leave the previous one.
OVERWRITE = [
    ("started", 1, 1),  # temporary directory made, nothing written
    ("data_written", 1, 1),  # rank 1's data file complete, no .metadata yet
    ("written", 1, 1),  # DCP finished, no commit marker
    ("committed", 0, 1),  # marker written in the temporary directory, not renamed
    ("moved_aside", 0, 1),  # old directory moved aside, new one not yet renamed
    ("renamed", 0, 2),  # new directory in place, leftovers not yet removed
]


@pytest.mark.parametrize("phase,rank,expected", OVERWRITE, ids=[p for p, _, _ in OVERWRITE])
def test_sigkill_during_overwrite_keeps_a_complete_checkpoint(
    pools, tmp_path, phase, rank, expected
):
    path = str(tmp_path / "ckpt")
    codes = W.run_until_killed(W.save_then_crash, 2, path, path, phase, rank, timeout=90)
    assert codes[rank] == -9, codes  # really killed there, not finished or failed
    seen = pools.run(2, W.after_crash, path, path)
    assert seen[0] == seen[1]
    assert seen[0]["path"] == expected, seen[0]


@pytest.mark.parametrize("phase,rank", [("data_written", 1), ("committed", 0)])
def test_sigkill_during_new_save_leaves_no_checkpoint_and_the_previous_one(
    pools, tmp_path, phase, rank
):
    path, target = str(tmp_path / "step_1"), str(tmp_path / "step_2")
    codes = W.run_until_killed(W.save_then_crash, 2, path, target, phase, rank, timeout=90)
    assert codes[rank] == -9, codes
    seen = pools.run(2, W.after_crash, path, target)[0]
    assert seen["path"] == 1
    assert "no checkpoint at" in seen["target"] and "does not exist" in seen["target"]
    # Only a temporary may be left (a surviving rank that saw the failure removes it).
    others = [n for n in seen["leftovers"] if n != "step_1"]
    assert all(n.startswith(".step_2.tmp-") for n in others), seen


@pytest.mark.parametrize(
    ("async_save", "phase"),
    [(False, "written"), (True, "written"), (True, "data_written")],
    ids=["sync", "async", "async-mid-write"],
)
def test_manager_ignores_a_killed_save_and_resumes_from_the_last_complete(
    pools, tmp_path, async_save, phase
):
    # async-mid-write: rank 1 dies on the background thread with its data file written and
    # the checkpoint's metadata not yet: the previous checkpoint stays the latest complete one.
    directory = str(tmp_path / "run")
    codes = W.run_until_killed(W.manager_then_crash, 2, directory, phase, 1, async_save)
    assert codes[1] == -9, codes
    seen = pools.run(2, W.manager_after_crash, directory)
    assert seen[0] == seen[1]
    assert seen[0]["latest"] == 4 and seen[0]["restored_step"] == 4
    assert seen[0]["bitwise"]
    # The new manager removed the killed save's temporary directory.
    assert seen[0]["listing"] == ["step_00000002", "step_00000004"], seen[0]


DAMAGE = {
    "flip_16_bytes": r"is corrupt: the file __1_0\.distcp does not match its recorded CRC-32",
    "truncate_data": r"is corrupt: the file __1_0\.distcp has \d+ bytes, but \d+ were written",
    "truncate_metadata": r"is corrupt: the file \.metadata has \d+ bytes, but \d+ were written",
    "missing_file": r"is corrupt: the file __1_0\.distcp is missing",
    "no_marker": r"is incomplete: it has no commit marker COMMIT\.json.*verify=False",
    "garbled_marker": r"is corrupt: its commit marker COMMIT\.json cannot be read",
    "missing_dir": r"no checkpoint at '.*missing_dir': the directory does not exist",
    "truncate_data_unverified": r"reading '.*truncate_data' failed: .*load the previous",
    "truncate_metadata_unverified": r"reading '.*truncate_metadata' failed: .*load the previous",
}


def test_damaged_checkpoints_raise_errors_that_name_the_directory_and_problem(pools, tmp_path):
    import re

    cases = [c for c in DAMAGE if c != "missing_dir" and not c.endswith("_unverified")]
    out = pools.run(2, W.damaged_loads, str(tmp_path), cases)
    assert out[0] == out[1]  # every rank raises the same error
    assert out[0].pop("good_bitwise") == "True"
    for case, pattern in DAMAGE.items():
        assert re.search(pattern, out[0][case]), (case, out[0][case])
        if not case.startswith("missing_dir"):
            assert str(tmp_path / case.removesuffix("_unverified")) in out[0][case]


def test_checkpoint_of_another_model_raises_value_error_naming_key_and_fix(pools, tmp_path):
    import re

    out = pools.run(2, W.other_model, str(tmp_path))[0]
    assert re.search(
        r"was saved with global shape \(36,\) in .*, but the template has \(48,\)", out["wider"]
    )
    assert "the checkpoint is of another model" in out["wider"]
    assert str(tmp_path / "gpt") in out["wider"]
    assert "blocks.2.attn" in out["deeper"] and "is not in the checkpoint" in out["deeper"]


@pytest.mark.parametrize(
    "kind,pattern",
    [
        (
            "read_only",
            r"CheckpointError: checkpoint\.save: cannot save to .*Permission denied.*writable",
        ),
        (
            "full",
            r"CheckpointError: checkpoint\.save: cannot save to .*File too large.*Free disk space",
        ),
    ],
)
def test_unwritable_target_raises_and_keeps_the_previous_checkpoint(pools, kind, pattern):
    import re

    out = pools.run(2, W.unwritable, kind)
    for r in out:
        assert re.search(pattern, r["message"]), r["message"]
        assert "previous checkpoint at this path, if any, is untouched" in r["message"]
        assert r["previous_bitwise"]
    assert out[0]["leftovers"] == ["ckpt"], out[0]  # no temporary left behind


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_keeps_last_and_every_and_resumes_bitwise(pools, tmp_path, async_save):
    out = pools.run(2, W.manager_run, str(tmp_path / "run"), async_save)
    assert out[0] == out[1]
    r = out[0]
    assert r["saved"] == [False, True, False, True, False, True, False, True, False]
    assert r["kept"] == [4, 6, 8]  # keep_last=2 (6, 8) and keep_every=4 (4, 8)
    assert r["again"] is False
    assert r["latest"] == 8
    assert r["resumed_losses"] == r["tail_losses"]  # bitwise: floats compared with ==
    assert r["final_bitwise"]
    assert r["older_step"] == 4
    assert "step 2 has no complete checkpoint" in r["missing"] and "[4, 6, 8]" in r["missing"]


def test_manager_restore_without_checkpoints_says_to_start_from_scratch(pools, tmp_path):
    msg = pools.run(2, W.empty_manager, str(tmp_path / "none"))[0]
    assert "no complete checkpoint in" in msg and "latest_step() is None" in msg


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_transformers_llama_resumes_bitwise(pools, tmp_path, async_save):
    out = pools.run(2, W.hf_resume, str(tmp_path / "hf"), async_save)[0]
    assert out["again"] == out["tail"]
    assert out["bitwise"]


def _torchrun(
    directory: Path, out: Path, kill_at: int, async_save: bool, preempt_at: int = -1
) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--monitor-interval=0.1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "tests/_resume_script.py",
        "--dir",
        str(directory),
        "--out",
        str(out),
        "--kill-at",
        str(kill_at),
        "--preempt-at",
        str(preempt_at),
        *(["--async-save"] if async_save else []),
    ]
    # No TORCH_DISABLE_SHARE_RDZV_TCP_STORE: init_distributed makes restarts work without it.
    env = _env()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stderr


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def test_torchrun_restart_of_a_gloo_group_needs_no_environment_variable():
    """The first attempt forms its group, runs a collective and fails on rank 1; the second
    forms a new group in torchrun's shared store (the dead attempt's keys still in it) and
    runs a collective. Without init_distributed's per-attempt prefix, the second attempt
    failed to connect (or hung) in 3 of 4 runs on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--max-restarts=1", "--monitor-interval=0.1", "--rdzv-backend=c10d"]
    cmd += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", "tests/_restart_script.py"]
    run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rank 1 fails on purpose in the first attempt" in run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("attempt"))
    assert lines == [
        "attempt 1 rank 0 sum 3.0 shared store True",
        "attempt 1 rank 1 sum 3.0 shared store True",
    ], run.stdout


def _trajectory(out: Path) -> tuple[dict[int, str], list[dict]]:
    records = [json.loads(line) for line in out.read_text().splitlines()]
    records = [r for r in records if "step" in r]
    last_wins = {r["step"]: r["loss"] for r in records}  # a later attempt overwrites
    return last_wins, records


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, str]:
    """The 12 losses of ``tests/_resume_script.py`` run without a kill or a signal."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _torchrun(tmp / "ckpt", tmp / "ref.jsonl", -1, async_save=False)
    return _trajectory(tmp / "ref.jsonl")[0]


def test_torchrun_restart_after_sigkill_resumes_bitwise(tmp_path, uninterrupted):
    kill_at = random.Random().randint(3, 10)  # any step: the result must not depend on it
    _torchrun(tmp_path / "ckpt", tmp_path / "run.jsonl", kill_at, async_save=True)
    ref = uninterrupted
    got, records = _trajectory(tmp_path / "run.jsonl")
    assert sorted(ref) == list(range(1, 13))
    assert got == ref, f"kill_at={kill_at}"  # losses as float.hex(): bitwise
    attempts = {r["attempt"] for r in records}
    assert attempts == {0, 1}, (kill_at, records)
    first_again = min(r["step"] for r in records if r["attempt"] == 1)
    resumed_from = next(r["resumed_from"] for r in records if r["attempt"] == 1)
    # Resumed from the latest complete checkpoint (every 3 steps; the newest one may still
    # have been in flight on the background thread when rank 1 died before step kill_at).
    assert resumed_from == first_again - 1
    last_started = (kill_at - 1) // 3 * 3
    assert resumed_from % 3 == 0 and last_started - 3 <= resumed_from <= last_started, (
        kill_at,
        records,
    )


def test_sigterm_to_one_rank_saves_exits_zero_and_the_requeued_run_is_bitwise(
    tmp_path, uninterrupted
):
    """SIGTERM reaches rank 1 alone (a scheduler preempting one node) before a random step:
    every rank stops at the step reached_preemption agrees on, saves it (no periodic save
    is due: checkpoints every 3 steps), and the launch exits 0. The next launch, as a
    requeued job, resumes there, and its losses (dropout on) are the uninterrupted run's."""
    preempt_at = random.Random().randint(2, 9)
    run = tmp_path / "run.jsonl"
    _torchrun(tmp_path / "ckpt", run, -1, async_save=True, preempt_at=preempt_at)
    lines = [json.loads(line) for line in run.read_text().splitlines()]
    stopped = [r["preempted_at"] for r in lines if "preempted_at" in r]
    # Noted during step preempt_at, voted after it, agreed after the next step.
    assert stopped == [preempt_at + 1], (preempt_at, lines)
    assert max(r["step"] for r in lines if "step" in r) == preempt_at + 1
    assert (tmp_path / "ckpt" / f"step_{preempt_at + 1:08d}").is_dir()
    _torchrun(tmp_path / "ckpt", run, -1, async_save=True, preempt_at=preempt_at)
    got, records = _trajectory(run)
    assert got == uninterrupted, preempt_at  # losses as float.hex(): bitwise
    assert {r["resumed_from"] for r in records} == {0, preempt_at + 1}
