"""One rank of one replica group in a fault-tolerant job, for tests/test_ft.py.

Started by the test with ``MASTER_ADDR``/``MASTER_PORT`` (this group's own c10d store),
``RANK``, ``WORLD_SIZE`` and ``TORCHFT_LIGHTHOUSE`` in the environment. The group trains a
small MLP (``--model mlp``) or a transformers Llama built from a tiny config (``--model
llama``, never downloaded) with FSDP over its 2 ranks and a ``(sum, count)`` loss, its batch
at step ``s`` being ``batch(kind, group, s)`` (uneven counts). Every committed step appends
to a record: the step, how many groups took part, whether this group's batch counted, and
this rank's shards of the parameters and the optimizer state. Options:

* ``--die-at K``: both ranks exit at the start of step K (the group dies between steps);
* ``--wait-for FILE --from K``: from step K on, wait (bounded) until FILE exists, i.e.
  until the restarted group is up, then step slowly until a step counts both groups, so
  that it rejoins before the job ends; ``--reached FILE2`` is written on reaching step K;
* ``--started FILE``: written once the process is ready to step (a restarted group);
* ``--after FILE``: import and build the model, then wait (bounded) until FILE exists
  before joining this group's process group: a restart whose processes were started
  early, so that their imports overlap the other groups' steps;
* ``--name NAME``: the record's file name stem (default ``group<G>``);
* ``--fail-at K``: this group's rank 0 reports a failed all-reduce in step K, after the
  all-reduces ran and before the commit vote (torchft's ``Manager.report_error``, what a
  collective whose future fails does): this group does not commit step K and runs it
  again; a group whose all-reduces succeeded commits it;
* ``--pace-until FILE``: step slowly (a pause before each step), past ``--steps`` if need
  be (bounded), until FILE exists: a group that must be there when another joins;
* ``--wide``: build a wider model than the other groups (a group that must be refused);
  the error is written to ``<out>/refused.txt`` and the process exits with code 3;
* ``--together DIR N``: connect to the lighthouse, then wait (bounded) until N groups have,
  before the first step, so that the first quorum holds them all (else each could train
  alone at first, and the later one would then take the other's state, as torchft heals).
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
TOKENS, VOCAB = 10, 96  # the Llama's batch: ROWS // 2 sequences of TOKENS ids


def model(kind: str = "mlp", hidden: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        from _hf import tiny_llama_config
        from transformers import LlamaForCausalLM

        llama = LlamaForCausalLM(tiny_llama_config(intermediate_size=hidden * 6))
        llama.config.use_cache = False
        return llama
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )


def batch(kind: str, group: int, step: int) -> tuple[torch.Tensor, ...]:
    """The group's global batch at ``step``: inputs, targets and a mask of counted rows
    (the MLP), or token ids and labels with some of them ignored (the Llama)."""
    g = torch.Generator().manual_seed(1000 * group + step)
    if kind == "llama":
        ids = torch.randint(0, VOCAB, (ROWS // 2, TOKENS), generator=g)
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.3, -100)
        labels[:, 1] = ids[:, 1]  # every sequence counts a token
        return ids, labels
    x, y = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 3, generator=g)
    mask = (torch.rand(ROWS, 1, generator=g) < 0.6).float()
    mask[group % ROWS] = 1.0  # never empty
    return x, y, mask


def loss_of(kind: str, call):
    """The ``(sum, count)`` loss of a model run by ``call(params, *args, **kwargs)``
    (``FSDP.apply``, or ``functional_call`` on the module for the reference)."""
    if kind == "llama":
        return lambda params, b: ff.causal_lm_loss(call(params, input_ids=b[0]).logits, b[1])

    def loss_fn(params, b):
        x, y, mask = b
        err = ((call(params, x) - y) ** 2 * mask).sum()
        return ff.SumCount(err, mask.sum() * 3)

    return loss_fn


def optimizer(kind: str = "mlp") -> ff.GradientTransformation:
    lr = 0.01 if kind == "llama" else 0.05
    return ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(lr, weight_decay=0.01))


def _wait(ready, seconds: float) -> None:
    """Wait until ``ready()``, or ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)


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
    p.add_argument("--model", choices=["mlp", "llama"], default="mlp")
    p.add_argument("--reached", default=None)
    p.add_argument("--after", default=None)
    p.add_argument("--name", default=None)
    args = p.parse_args()
    name = args.name or f"group{args.group}"

    module = model(args.model, 12 if args.wide else 10)
    if args.after:
        _wait(lambda: os.path.exists(args.after), 120)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ff.make_mesh({"dp": 2})
    sm = ff.fsdp(module, mesh)
    opt = optimizer(args.model)
    group = functional_fsdp.ft.ReplicaGroup(str(args.group), timeout=30, quorum_timeout=60)
    failing = [False]
    vote = group.commit

    def commit() -> bool:  # after the step's all-reduces, before its commit vote
        if failing[0] and rank == 0:  # one rank's failure: the vote fails the whole group
            group._manager.report_error(RuntimeError("an all-reduce failed"))
        return vote()

    group.commit = commit
    step = ff.train_step(loss_of(args.model, sm.apply), opt, model=sm, replicas=group)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    if args.started:
        group.connect()
        if rank == 0:
            pathlib.Path(args.started).write_text("up")
    if args.together:
        group.connect()  # registered with the lighthouse before any group steps
        folder, n = pathlib.Path(args.together[0]), int(args.together[1])
        (folder / f"ready{args.group}_{rank}").write_text("up")
        _wait(lambda: len(list(folder.glob("ready*"))) >= 2 * n, 120)
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
            if args.reached and rank == 0:
                pathlib.Path(args.reached).write_text("here")
            _wait(lambda: os.path.exists(args.wait_for), 120)
            time.sleep(0.5)  # step slowly until the restarted group is in the quorum
        failing[0] = state.step == args.fail_at
        if failing[0]:
            args.fail_at = -1  # once: the step runs again
        try:
            state, metrics = step(state, batch(args.model, args.group, state.step))
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
            torch.save(record, f"{args.out}/{name}_rank{rank}.pt")  # kept if it dies
        else:
            record.append({"committed": False, "step": state.step})
    group.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
