"""Fault tolerance across replica groups (``ff.ft.ReplicaGroup``, on torchft), on gloo.

Two replica groups of 2 ranks each train through the death of one group and its restart:
the survivors' states equal one process applying the documented rule (each committed step
is the token mean over the batches of the groups that took part), and the restarted group's
state is bitwise the survivors' at every step after it rejoins.
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


def _reference(records: list[dict], counted: dict[int, list[int]]) -> list[dict]:
    """One process, full parameters, each committed step on the union of the batches of
    the groups whose batch counted in it (``counted[step]``)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import _ft_script as job

    module = job.model()
    params = {k: v.detach() for k, v in module.named_parameters()}
    opt = job.optimizer()

    def apply(p, x):
        return torch.func.functional_call(module, p, (x,))

    step = ff.train_step(job.loss_of(apply), opt, batch="local")
    state = ff.TrainState.create(params, opt)
    out = []
    for r in records:
        assert r["step"] == state.step
        groups = counted[r["step"]]
        assert len(groups) == r["replicas"], (r["step"], groups, r["replicas"])
        parts = [job.batch(g, r["step"]) for g in groups]
        union = tuple(torch.cat(t) for t in zip(*parts))
        state, _ = step(state, union)
        out.append(dict(state.params))
    return out


def test_training_goes_on_through_a_replica_groups_death_and_it_rejoins_bitwise(tmp_path):
    lighthouse = torchft._torchft.LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1500
    )
    steps, die_at = 12, 3
    started = tmp_path / "restarted"
    try:
        survivors = _group(
            0, lighthouse.address(), tmp_path, "--steps", str(steps),
            "--wait-for", str(started), "--from", str(die_at + 2), "--together", str(tmp_path), "2",
            "--fail-at", str(die_at + 1),
        )  # fmt: skip
        doomed = _group(
            1, lighthouse.address(), tmp_path, "--steps", str(steps), "--die-at", str(die_at),
            "--together", str(tmp_path), "2",
        )  # fmt: skip
        _finish(doomed, 240)
        for rank in range(2):  # the dead group's record, up to its death
            (tmp_path / f"group1_rank{rank}.pt").rename(tmp_path / f"first_group1_rank{rank}.pt")
        # The survivors go on alone, and from step die_at + 2 wait for the restart.
        restarted = _group(
            1, lighthouse.address(), tmp_path, "--steps", str(steps), "--started", str(started)
        )
        _finish(survivors + restarted, 300)
    finally:
        lighthouse.shutdown()

    def load(name: str) -> list[dict]:
        return [r for r in torch.load(tmp_path / name) if r["committed"]]

    ranks = [load(f"group0_rank{r}.pt") for r in range(2)]
    joined = [load(f"group1_rank{r}.pt") for r in range(2)]
    first = load("first_group1_rank0.pt")
    # The failed all-reduce cost its step, which then ran again.
    again = [r["step"] for r in torch.load(tmp_path / "group0_rank0.pt") if not r["committed"]]
    assert again == [die_at + 1], again
    # Which groups' batches each committed step counted, from each group's own record.
    counted: dict[int, list[int]] = {}
    for g, record in ((0, ranks[0]), (1, first), (1, joined[0])):
        for r in record:
            if r["mine"]:
                counted.setdefault(r["step"], []).append(g)
    at = [r["step"] for r in ranks[0]]
    # The survivors' steps run on from where they joined to the end, each committed once
    # (a group that joins at a later step than 0 took the first steps' state from the other).
    assert at == list(range(at[0], steps)) and at[0] <= 1, at
    assert counted[die_at] == [0] and counted[die_at + 1] == [0], counted  # alone
    rejoined = [r["step"] for r in joined[0]]
    assert rejoined and rejoined[-1] == steps - 1 and rejoined[0] > die_at
    assert counted[steps - 1] == [0, 1], counted  # both again at the end
    # The restarted group's state is the survivors', bitwise, at every step it took part in.
    for rank in range(2):
        theirs = {r["step"]: r["leaves"] for r in ranks[rank]}
        for r in joined[rank]:
            for a, b in zip(r["leaves"], theirs[r["step"]], strict=True):
                same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                assert same, r["step"]
    # The survivors' parameters equal one process applying the rule, at every step.
    # The survivors' parameters equal one process applying the rule, at every step (the
    # first steps from the record of the group whose state they took, if any).
    history = [r for r in first if r["step"] < at[0]] + ranks[0]
    for r, expected in zip(history, _reference(history, counted), strict=True):
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
