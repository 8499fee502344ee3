"""One rank of one replica group in a fault-tolerant job, for tests/test_ft.py.

Started by the test with ``MASTER_ADDR``/``MASTER_PORT`` (this group's own c10d store),
``RANK``, ``WORLD_SIZE`` and ``TORCHFT_LIGHTHOUSE`` in the environment. The group trains a
small MLP with FSDP over its 2 ranks and a ``(sum, count)`` loss, its batch at step ``s``
being ``batch(group, s)`` (uneven counts). Every committed step appends to a record: the
step, how many groups took part, and this rank's shards of the parameters and the optimizer
state. Options:

* ``--die-at K``: both ranks exit at the start of step K (the group dies between steps);
* ``--wait-for FILE --from K``: from step K on, wait (bounded) until FILE exists, i.e.
  until the restarted group is up, then step slowly until a step counts both groups, so
  that it rejoins before the job ends;
* ``--started FILE``: written once the process is ready to step (a restarted group);
* ``--fail-at K``: this group reports a failed collective in step K (torchft's
  ``Manager.report_error``, what a broken all-reduce does), so no group commits step K;
* ``--pace-until FILE``: step slowly (a pause before each step), past ``--steps`` if need
  be (bounded), until FILE exists: a group that must be there when another joins;
* ``--wide``: build a wider model than the other groups (a group that must be refused);
  the error is written to ``<out>/refused.txt`` and the process exits with code 3;
* ``--together DIR N``: before the first step, wait (bounded) until N groups are ready, so
  that the first quorum holds them all (else each could train alone at first, and the
  later one would then take the other's state, as torchft heals).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import torch
import torch.distributed as dist

import functional_fsdp as ff
import functional_fsdp.ft

DIM, ROWS = 6, 8


def model(hidden: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's global batch at ``step``: inputs, targets and a mask of counted rows."""
    g = torch.Generator().manual_seed(1000 * group + step)
    x, y = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 3, generator=g)
    mask = (torch.rand(ROWS, 1, generator=g) < 0.6).float()
    mask[group % ROWS] = 1.0  # never empty
    return x, y, mask


def loss_of(apply):
    def loss_fn(params, b):
        x, y, mask = b
        err = ((apply(params, x) - y) ** 2 * mask).sum()
        return ff.SumCount(err, mask.sum() * 3)

    return loss_fn


def optimizer() -> ff.GradientTransformation:
    return ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(0.05, weight_decay=0.01))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--wait-for", default=None)
    p.add_argument("--from", dest="wait_from", type=int, default=0)
    p.add_argument("--started", default=None)
    p.add_argument("--together", nargs=2, default=None)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--wide", action="store_true")
    p.add_argument("--pace-until", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ff.make_mesh({"dp": 2})
    sm = ff.fsdp(model(12 if args.wide else 10), mesh)
    opt = optimizer()
    group = functional_fsdp.ft.ReplicaGroup(str(args.group), timeout=30, quorum_timeout=60)
    failing = [False]
    inner = loss_of(sm.apply)

    def loss_fn(params, b):
        if failing[0]:  # inside the step, after its quorum formed
            group._manager.report_error(RuntimeError("an all-reduce failed"))
        return inner(params, b)

    step = ff.train_step(loss_fn, opt, model=sm, replicas=group)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    if args.started and rank == 0:
        pathlib.Path(args.started).write_text("up")
    if args.together:
        folder, n = pathlib.Path(args.together[0]), int(args.together[1])
        (folder / f"ready{args.group}_{rank}").write_text("up")
        deadline = time.monotonic() + 120
        while len(list(folder.glob("ready*"))) < 2 * n and time.monotonic() < deadline:
            time.sleep(0.05)
    record = []
    both = False  # whether a step since the wait counted both groups' batches
    deadline = time.monotonic() + 180
    # --pace-until: step slowly, past --steps if need be (bounded), until FILE exists.
    while state.step < args.steps or (
        args.pace_until and not os.path.exists(args.pace_until) and time.monotonic() < deadline
    ):
        if args.pace_until and not os.path.exists(args.pace_until):
            time.sleep(0.5)
        if state.step == args.die_at:
            os._exit(0)  # the whole group, between steps, without a goodbye
        if args.wait_for and state.step >= args.wait_from and not both:
            deadline = time.monotonic() + 120
            while not os.path.exists(args.wait_for) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # step slowly until the restarted group is in the quorum
        failing[0] = state.step == args.fail_at
        if failing[0]:
            args.fail_at = -1  # once: the step runs again
        try:
            state, metrics = step(state, batch(args.group, state.step))
        except functional_fsdp.ft.ReplicaMismatchError as e:
            if rank == 0:
                pathlib.Path(args.out, "refused.txt").write_text(str(e))
            os._exit(3)
        at = state.step - 1  # a group that joins jumps to the quorum's step
        both = both or (state.step > args.wait_from and int(metrics["replicas"]) == 2)
        if metrics["committed"]:
            leaves = [
                t.clone() if isinstance(t, torch.Tensor) else t
                for t in ff.tree_leaves((state.params, state.opt_state))
            ]
            full = {k: v.clone() for k, v in ff.gather(state.params).items()}
            record.append(
                {
                    "committed": True,
                    "step": at,
                    "replicas": int(metrics["replicas"]),
                    "mine": bool(group.contributes),  # whether this group's batch counted
                    "leaves": leaves,
                    "full": full,
                }
            )
            torch.save(record, f"{args.out}/group{args.group}_rank{rank}.pt")  # kept if it dies
        else:
            record.append({"committed": False, "step": state.step})
    group.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
