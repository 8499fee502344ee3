"""Fault tolerance across replica groups (``ff.ft.ReplicaGroup``, on torchft), on gloo.

Two replica groups of 2 ranks each train a transformers Llama through a failed all-reduce
in one group, the death of a group and its restart: the survivors' states equal one process
applying the documented rule (each committed step is the token mean over the batches of the
groups that took part), and a group that fell behind or restarted holds the survivors'
state bitwise at every step after it rejoins.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import functional_fsdp as ff

torchft = pytest.importorskip("torchft")

SCRIPT = Path(__file__).with_name("_ft_script.py")
ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(group: int, lighthouse: str, out: Path, *extra: str) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "TORCHFT_LIGHTHOUSE": lighthouse,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, str(SCRIPT), "--group", str(group), "--out", str(out), *extra]
        path = out / f"log{group}_{rank}_{len(list(out.glob('log*')))}.txt"
        with open(path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log = path  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process; fail with its log if one hangs or exits with an error."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a replica group hung:\n{_log(p)}") from None
        assert p.returncode == 0, f"a rank exited with {p.returncode}:\n{_log(p)}"


def _log(p: subprocess.Popen) -> str:
    return p.log.read_text(errors="replace")[-6000:]  # type: ignore[attr-defined]


def _reference(kind: str, records: list[dict], counted: dict[int, list[int]]) -> list[dict]:
    """One process, full parameters, each committed step on the union of the batches of
    the groups whose batch counted in it (``counted[step]``)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import _ft_script as job

    module = job.model(kind)
    params = {k: v.detach() for k, v in module.named_parameters()}
    opt = job.optimizer(kind)

    def call(p, *args, **kwargs):
        return torch.func.functional_call(module, p, args, kwargs)

    step = ff.train_step(job.loss_of(kind, call), opt, batch="local")
    state = ff.TrainState.create(params, opt)
    out = []
    for r in records:
        assert r["step"] == state.step
        groups = counted[r["step"]]
        assert len(groups) == r["replicas"], (r["step"], groups, r["replicas"])
        parts = [job.batch(kind, g, r["step"]) for g in groups]
        union = tuple(torch.cat(t) for t in zip(*parts))
        state, _ = step(state, union)
        out.append(dict(state.params))
    return out


def _bitwise(mine: list[dict], theirs: list[dict]) -> None:
    """Each committed step of ``mine`` holds exactly the state ``theirs`` holds at it."""
    at = {r["step"]: r["leaves"] for r in theirs}
    for r in mine:
        for a, b in zip(r["leaves"], at[r["step"]], strict=True):
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same, r["step"]


def test_a_llama_trains_through_failed_all_reduces_and_a_groups_death_and_rejoin(tmp_path):
    """A transformers Llama (a tiny config, FSDP in each group). Both groups alive, group
    1's all-reduce fails at step 1 on one rank: group 1 does not commit it, group 0 commits
    it with both batches, and group 1 takes group 0's state at step 2. Group 1 dies at
    step 4; group 0, alone, fails an all-reduce at step 5 and runs it again; group 1 is
    restarted and rejoins from step 6."""
    pytest.importorskip("transformers")
    kind = "llama"
    lighthouse = torchft._torchft.LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1500
    )
    steps, fail_both, die_at = 10, 1, 4
    started, reached = tmp_path / "restarted", tmp_path / "reached"
    common = ("--model", kind, "--steps", str(steps))
    try:
        survivors = _group(
            0, lighthouse.address(), tmp_path, *common, "--together", str(tmp_path), "2",
            "--fail-at", str(die_at + 1), "--wait-for", str(started), "--from", str(die_at + 2),
            "--reached", str(reached),
        )  # fmt: skip
        doomed = _group(
            1, lighthouse.address(), tmp_path, *common, "--together", str(tmp_path), "2",
            "--fail-at", str(fail_both), "--die-at", str(die_at),
        )  # fmt: skip
        # Group 1's restart: its processes start now (their imports overlap the others'
        # steps) and join once group 0, alone since step die_at, reaches step die_at + 2.
        restarted = _group(
            1, lighthouse.address(), tmp_path, *common, "--after", str(reached),
            "--started", str(started), "--name", "rejoined1",
        )  # fmt: skip
        _finish(doomed + survivors + restarted, 300)
    finally:
        lighthouse.shutdown()

    def load(name: str) -> list[dict]:
        return [r for r in torch.load(tmp_path / name) if r["committed"]]

    def retried(name: str) -> list[int]:
        return [r["step"] for r in torch.load(tmp_path / name) if not r["committed"]]

    ranks = [load(f"group0_rank{r}.pt") for r in range(2)]
    firsts = [load(f"group1_rank{r}.pt") for r in range(2)]
    joined = [load(f"rejoined1_rank{r}.pt") for r in range(2)]
    at = [r["step"] for r in ranks[0]]
    # The survivors' steps run on from where they joined to the end, each committed once
    # (a group that joins at a later step than 0 took the first steps' state from the other).
    assert at == list(range(at[0], steps)) and at[0] <= 1, at
    # Which groups' batches each committed step counted, from each group's own record:
    # both if two took part, else the one whose batch counted.
    counted: dict[int, list[int]] = {}
    for me, record in ((1, firsts[0]), (1, joined[0]), (0, ranks[0])):
        for r in record:
            alone = [me] if r["mine"] else [1 - me]
            assert counted.setdefault(r["step"], [0, 1] if r["replicas"] == 2 else alone) == (
                [0, 1] if r["replicas"] == 2 else alone
            ), (me, r["step"], counted)
    for rank in range(2):
        # Group 1's all-reduce failed at step 1 on one rank: neither of its ranks committed
        # it, group 0 committed it with both groups' batches, and group 1 took group 0's
        # state at step 2 (its batch of step 2 is not trained).
        assert retried(f"group1_rank{rank}.pt") == [fail_both]
        assert [r["step"] for r in firsts[rank] if r["step"] > 0] == [2, 3], firsts[rank]
        assert retried(f"group0_rank{rank}.pt") == [die_at + 1]  # alone: run again
    assert counted[fail_both] == [0, 1] and counted[fail_both + 1] == [0], counted
    assert counted[die_at] == [0] and counted[die_at + 1] == [0], counted  # alone
    rejoined = [r["step"] for r in joined[0]]
    assert rejoined and rejoined[-1] == steps - 1 and rejoined[0] > die_at
    assert counted[steps - 1] == [0, 1], counted  # both again at the end
    # Group 1's state is group 0's, bitwise, at every step it committed after the failed
    # all-reduce, and at every step after it rejoined.
    for rank in range(2):
        _bitwise([r for r in firsts[rank] if r["step"] > fail_both], ranks[rank])
        _bitwise(joined[rank], ranks[rank])
    # The survivors' parameters equal one process applying the rule, at every step (the
    # first steps from the record of the group whose state they took, if any).
    history = [r for r in firsts[0] if r["step"] < at[0]] + ranks[0]
    for r, expected in zip(history, _reference(kind, history, counted), strict=True):
        for name, full in expected.items():
            got = r["full"][name]
            torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6, msg=f"{name} {r['step']}")


def test_a_group_with_another_model_is_refused_and_the_quorum_goes_on(tmp_path):
    lighthouse = torchft._torchft.LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1500
    )
    refused = tmp_path / "refused.txt"
    try:
        good = _group(
            0, lighthouse.address(), tmp_path, "--steps", "6", "--pace-until", str(refused)
        )
        deadline = time.monotonic() + 240  # the bad group joins behind: it is the one to heal
        while not (tmp_path / "group0_rank0.pt").exists() and time.monotonic() < deadline:
            assert all(p.poll() is None for p in good)
            time.sleep(0.1)
        bad = _group(1, lighthouse.address(), tmp_path, "--steps", "6", "--wide")
        codes = [p.wait(timeout=240) for p in bad]
        assert codes == [3, 3], [_log(p) for p in bad]
        _finish(good, 240)
    finally:
        lighthouse.shutdown()
    message = refused.read_text()
    # The first value that differs, with its global shape here and in the quorum's state.
    assert "'1' cannot join" in message and "['params']['0.bias']" in message, message
    assert "(12,) float32 P('dp') on Mesh(dp=2) here" in message, message
    assert "(10,) float32 P('dp') on Mesh(dp=2) in the quorum's state" in message, message
    record = [r for r in torch.load(tmp_path / "group0_rank0.pt") if r["committed"]]
    assert [r["step"] for r in record] == list(range(len(record))) and len(record) >= 6
    assert all(r["mine"] and r["replicas"] == 1 for r in record)
