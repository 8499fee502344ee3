"""A fault-tolerant job on this machine, with failures injected: :func:`launch`.

For notebooks and tests: it starts a real torchft lighthouse and, per replica group, real
processes joined in their own gloo process group (as ``torchrun`` would start them, one
group after another), runs the same step function in every group, kills a group's
processes or fails a group's all-reduce at the steps asked for, restarts a killed group,
and returns what every step did. The groups run :class:`~functional_fsdp.ft.ReplicaGroup`
unchanged; nothing is mocked.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import optree
import torch
import torch.distributed as dist

from .._tree import NAMESPACE
from ..distributed.process import free_port, torchrun_env
from .replicas import ReplicaGroup

__all__ = ["StepRecord", "launch"]

_HEARTBEAT_S = 1.5
"""How long the lighthouse waits for a silent group before it counts it dead."""
_PACE_S = 0.5
"""The pause before each step of the groups waiting for a restarted one to join."""
_BOOT = "import sys; from functional_fsdp.ft.launch import _rank_main; _rank_main(sys.argv[1])"
_LIGHTHOUSE = """\
import sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(
    bind=sys.argv[1], min_replicas=1, join_timeout_ms=2000,
    heartbeat_timeout_ms=int(float(sys.argv[2]) * 1000),
)
while True:
    time.sleep(3600)
"""


class StepRecord(NamedTuple):
    """What one replica group did in one step (a step that did not commit has its own row,
    and so has the step it is run again in)."""

    group: str  # the replica group's id
    life: int  # 0 for the group's first processes, 1 after a restart
    step: int  # the step it ran: the quorum's step when the group joined in it
    committed: bool  # whether the group's state moved on (else it runs the step again)
    replicas: int  # how many groups' batches the step counted
    joined: bool  # the group took a healthy group's state in this step (its batch not counted)
    loss: float  # the step's loss (over the counted batches)
    state: str  # a hash of the group's state after the step (all its ranks' shards)
    seconds: float  # when the step ended, since the launch


def launch(
    build: Callable[[ReplicaGroup], tuple[Callable[[Any, Any], tuple[Any, Any]], Any]],
    batch_of: Callable[[str, int], Any],
    *,
    groups: int = 2,
    ranks: int = 2,
    steps: int = 8,
    kill: dict[str, int] | None = None,
    rejoin_after: int = 2,
    fail: dict[str, int] | None = None,
    timeout: float = 300.0,
) -> list[StepRecord]:
    """Run a fault-tolerant job of ``groups`` replica groups of ``ranks`` processes each on
    this machine (gloo on the CPU), injecting failures; return what every step did.

    Every process calls ``build(group)``, which builds the model, mesh and optimizer of its
    group and returns ``(step, state)`` (a ``train_step(..., replicas=group)`` and the
    initial ``TrainState``), then steps until ``state.step == steps``, on
    ``batch_of(group_id, state.step)`` (groups ``"0"``, ``"1"``, ...). A torchft lighthouse
    runs in this process; each group is its own process group, as a ``torchrun`` job each.

    * ``kill={"1": 3}``: at the start of step 3 every process of group 1 is killed
      (SIGKILL, no goodbye); the group is started again at once, and joins when the other
      groups reach step ``3 + rejoin_after``, taking their state.
    * ``fail={"0": 5}``: in step 5, rank 0 of group 0 reports a failed all-reduce (torchft's
      ``Manager.report_error``) after the all-reduces ran and before the commit vote: group
      0 does not commit step 5 and runs it again; the other groups commit it.

    ``build`` and ``batch_of`` travel to the processes with cloudpickle (functions defined
    in a notebook work). Workers' output goes to log files, shown when a process fails.

    Args:
        build: ``build(group) -> (step, state)``, run on every rank of every group.
        batch_of: ``batch_of(group_id, step) -> batch``, the group's global batch.
        groups: the number of replica groups.
        ranks: processes per group.
        steps: every group stops when its state reaches this step.
        kill: ``{group_id: step}``: the groups killed at the start of that step, and
            restarted. At least one group must never be killed.
        rejoin_after: how many steps after its death a killed group rejoins.
        fail: ``{group_id: step}``: the groups whose all-reduce fails in that step (once).
        timeout: seconds for the whole job; past it every process is stopped.

    Returns:
        A :class:`StepRecord` per step each group ran (rank 0's view), in the order they
        ended.

    Raises:
        ValueError: for a plan that cannot run (an unknown group, a kill too late to
            rejoin before ``steps``, every group killed).
        RuntimeError: if a process fails or exits other than as planned (with its log), or
            the job does not end within ``timeout``.

    Example:
        >>> import torch
        >>> import functional_fsdp as ff
        >>> def build(group):
        ...     mesh = ff.make_mesh({"dp": 2})
        ...     sm = ff.fsdp(torch.nn.Linear(4, 4), mesh)
        ...     opt = ff.adamw(1e-2)
        ...     loss = lambda p, b: sm.apply(p, b).pow(2).mean()
        ...     step = ff.train_step(loss, opt, model=sm, replicas=group)
        ...     return step, ff.TrainState.create(sm.shard(), opt, trainable=sm)
        >>> def batch_of(group_id, step):
        ...     return torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        >>> rows = ff.ft.launch(build, batch_of, steps=8, kill={"1": 3})  # doctest: +SKIP
        >>> [(r.step, r.replicas) for r in rows if r.group == "0"]  # doctest: +SKIP
        [(0, 2), (1, 2), (2, 2), (3, 1), (4, 1), (5, 1), (6, 2), (7, 2)]
    """
    kill, fail = dict(kill or {}), dict(fail or {})
    names = [str(g) for g in range(groups)]
    _check_plan(names, steps, kill, rejoin_after, fail)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="ff-ft-") as tmp:
        folder = Path(tmp)
        port = free_port()  # the lighthouse, a process of its own, as in a real job
        with open(folder / "log_lighthouse.txt", "w") as log:
            lighthouse = subprocess.Popen(
                [sys.executable, "-c", _LIGHTHOUSE, f"0.0.0.0:{port}", str(_HEARTBEAT_S)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        plan = {
            "build": build,
            "batch_of": batch_of,
            "groups": groups,
            "steps": steps,
            "kill": kill,
            "rejoin_after": rejoin_after,
            "fail": fail,
            "lighthouse": f"http://127.0.0.1:{port}",
            "folder": str(folder),
            "start": start,
        }
        (folder / "plan.pkl").write_bytes(cloudpickle.dumps(plan))
        try:
            _run(folder, names, ranks, kill, lighthouse, start + timeout)
        finally:
            lighthouse.kill()
            lighthouse.wait()
        rows = [
            StepRecord(**json.loads(line))
            for path in sorted(folder.glob("records_*.jsonl"))
            for line in path.read_text().splitlines()
        ]
    return sorted(rows, key=lambda r: r.seconds)


def _check_plan(
    names: list[str], steps: int, kill: dict[str, int], rejoin_after: int, fail: dict[str, int]
) -> None:
    for what, plan in (("kill", kill), ("fail", fail)):
        for g, at in plan.items():
            if g not in names:
                raise ValueError(
                    f"ft.launch({what}={plan!r}): there is no group {g!r}; the groups are "
                    f"{names} (ids are strings, e.g. {what}={{'1': 3}})."
                )
            if not (isinstance(at, int) and 0 <= at < steps):
                raise ValueError(
                    f"ft.launch({what}={plan!r}): step {at!r} (group {g!r}) is not a step of "
                    f"the job (0 to {steps - 1})."
                )
    late = {g: k for g, k in kill.items() if k + rejoin_after >= steps}
    if late:
        raise ValueError(
            f"ft.launch(kill={kill!r}, rejoin_after={rejoin_after}, steps={steps}): group(s) "
            f"{sorted(late)} would rejoin at or after the last step; kill earlier, or run "
            f"more steps."
        )
    if len(kill) >= len(names):
        raise ValueError(
            f"ft.launch(kill={kill!r}): every group is killed; at least one must live to "
            f"hand the state to the restarted ones."
        )


def _spawn(folder: Path, group: str, life: int, ranks: int) -> list[subprocess.Popen]:
    """Start the ``ranks`` processes of one group, as ``torchrun`` would (own c10d store)."""
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = torchrun_env(
            rank,
            ranks,
            port,
            FF_FT_GROUP=group,
            FF_FT_LIFE=str(life),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        with open(folder / f"log_{group}_{life}_{rank}.txt", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BOOT, str(folder)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    return procs


def _run(
    folder: Path,
    names: list[str],
    ranks: int,
    kill: dict[str, int],
    lighthouse: subprocess.Popen,
    end: float,
) -> None:
    """Start every group, restart the killed ones when they died, and wait for the rest."""
    running = {(g, 0): _spawn(folder, g, 0, ranks) for g in names}
    try:
        while running:
            if lighthouse.poll() is not None:
                log = (folder / "log_lighthouse.txt").read_text(errors="replace")
                raise RuntimeError(
                    f"ft.launch: the lighthouse exited with {lighthouse.returncode}; its "
                    f"log:\n{log[-6000:]}"
                )
            for (g, life), procs in list(running.items()):
                codes = [p.poll() for p in procs]
                planned = -signal.SIGKILL if life == 0 and g in kill else 0
                bad = [(r, c) for r, c in enumerate(codes) if c is not None and c != planned]
                if bad:
                    rank, code = bad[0]
                    log = (folder / f"log_{g}_{life}_{rank}.txt").read_text(errors="replace")
                    raise RuntimeError(
                        f"ft.launch: rank {rank} of replica group {g!r} (life {life}) exited "
                        f"with {code}; its log:\n{log[-6000:]}"
                    )
                if all(c is not None for c in codes):
                    del running[(g, life)]
                    if planned:  # killed as planned: started again at once
                        running[(g, 1)] = _spawn(folder, g, 1, ranks)
            if time.time() > end:
                logs = "\n".join(
                    f"--- group {g} life {life} rank 0 ---\n"
                    + (folder / f"log_{g}_{life}_0.txt").read_text(errors="replace")[-3000:]
                    for g, life in running
                )
                raise RuntimeError(
                    f"ft.launch: the job did not end within its timeout; groups still "
                    f"running: {sorted(running)}.\n{logs}"
                )
            time.sleep(0.1)
    finally:
        for procs in running.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


# ------------------------------------------------------------------ in each process


def _digest(state: Any) -> str:
    h = hashlib.sha256()
    for leaf in optree.tree_leaves(state, namespace=NAMESPACE):
        if isinstance(leaf, torch.Tensor):
            h.update(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def _wait(ready: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)


def _rank_main(folder_name: str) -> None:
    """One rank of one group: build, join, step (dying or failing as planned), record."""
    from ..distributed.mesh import init_distributed

    folder = Path(folder_name)
    plan = cloudpickle.loads((folder / "plan.pkl").read_bytes())
    me, life = os.environ["FF_FT_GROUP"], int(os.environ["FF_FT_LIFE"])
    init_distributed("gloo", device_type="cpu", timeout=60.0)
    rank = dist.get_rank()
    group = ReplicaGroup(me, lighthouse=plan["lighthouse"], timeout=30, quorum_timeout=60)
    step, state = plan["build"](group)
    failing = [False]
    vote = group.commit

    def commit() -> bool:  # after the step's all-reduces, before the commit vote
        if failing[0] and rank == 0:
            group._manager.report_error(RuntimeError("injected: an all-reduce failed"))
        return vote()

    group.commit = commit  # type: ignore[method-assign]
    if life == 1:  # restarted: join once the others reach the step it rejoins at
        _wait(lambda: (folder / f"reached_{me}").exists(), 120)
    group.connect()  # registered with the lighthouse before this group steps
    (folder / f"up_{me}_{life}_{rank}").write_text("up")
    if life == 0:  # every group in the first quorum
        everyone = plan["groups"] * dist.get_world_size()
        _wait(lambda: len(list(folder.glob("up_*_0_*"))) >= everyone, 120)
    # The steps at which this group waits for a restarted one to join, and which one.
    kills = plan["kill"]
    rejoins = sorted((k + plan["rejoin_after"], g) for g, k in kills.items() if g != me)
    waiting_for: str | None = None
    fail_at = plan["fail"].get(me, -1) if life == 0 else -1
    records = folder / f"records_{me}_{life}.jsonl"
    while state.step < plan["steps"]:
        if life == 0 and me in kills and state.step >= kills[me]:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank of the group, between steps
        while life == 0 and rejoins and state.step >= rejoins[0][0]:
            waiting_for = rejoins.pop(0)[1]
            (folder / f"reached_{waiting_for}").write_text("here")
            _wait(lambda: (folder / f"up_{waiting_for}_1_0").exists(), 120)
        if waiting_for is not None:
            time.sleep(_PACE_S)  # until the restarted group is in the quorum
        failing[0] = state.step == fail_at
        if failing[0]:
            fail_at = -1  # once: the step runs again
        state, metrics = step(state, plan["batch_of"](me, state.step))
        committed = bool(metrics["committed"])
        if waiting_for is not None and int(metrics["replicas"]) == plan["groups"]:
            waiting_for = None
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, _digest((state.params, state.opt_state)))
        if rank == 0:
            row = StepRecord(
                group=me,
                life=life,
                step=state.step - 1 if committed else state.step,
                committed=committed,
                replicas=int(metrics["replicas"]),
                joined=not group.contributes,
                loss=float(metrics["loss"]),
                state=hashlib.sha256("".join(digests).encode()).hexdigest()[:8],
                seconds=round(time.time() - plan["start"], 2),
            )
            with open(records, "a") as f:
                f.write(json.dumps(row._asdict()) + "\n")
    group.shutdown()
    dist.barrier()
    dist.destroy_process_group()
