"""A tiny run for the crash-and-restart test, under ``torchrun --max-restarts``.

Trains a small GPT (dropout 0.1) on 2 processes, checkpoints every 3 steps with a
CheckpointManager (params, optimizer state, step, the random key and the data generator's
state), and resumes from the latest
complete checkpoint when there is one. On the first attempt only, rank 1 SIGKILLs itself
before step ``--kill-at``. With ``--preempt-at``, rank 1 sends itself SIGTERM before that
step on the first launch (no checkpoint yet); every rank stops at the step the manager's
``reached_preemption`` agrees on, saves it and exits 0. Rank 0 appends one JSON line per step: attempt, step, loss (as
``float.hex``, so comparisons are bitwise) and the step the attempt resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=2, block_size=16, dropout=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=-1, help="step before which rank 1 dies")
    p.add_argument(
        "--preempt-at", type=int, default=-1, help="step before which rank 1 gets SIGTERM"
    )
    p.add_argument("--async-save", action="store_true")
    args = p.parse_args()

    ff.init_distributed()
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = GPT(CFG)
    f = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(
        ff.warmup_cosine_decay_schedule(0.0, 1e-2, 2, args.steps, 1e-3), eps=1e-6, weight_decay=0.01
    )
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    state = ff.TrainState.create(f.shard(), opt, rng=0)  # dropout's key: saved with the state
    gen = torch.Generator().manual_seed(1)  # the data order: part of the checkpoint

    mgr = ff.checkpoint.CheckpointManager(
        args.dir, save_every=args.save_every, keep_last=2, async_save=args.async_save
    )
    resumed_from = 0
    if mgr.latest_step() is not None:
        ckpt = mgr.restore({"state": state, "data": {"rng": gen.get_state()}})
        state = ckpt["state"]
        gen.set_state(ckpt["data"]["rng"])
        resumed_from = state.step

    with open(args.out, "a") as out:
        while state.step < args.steps:
            if state.step + 1 == args.kill_at and attempt == 0 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step + 1 == args.preempt_at and resumed_from == 0 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting one node
            batch = torch.randint(0, CFG.vocab_size, (8, 13), generator=gen)
            state, metrics = step(state, batch)
            if rank == 0:
                record = {
                    "attempt": attempt,
                    "step": state.step,
                    "loss": float(metrics["loss"]).hex(),
                    "resumed_from": resumed_from,
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
            tree = {"state": state, "data": {"rng": gen.get_state()}}
            if args.preempt_at > 0 and mgr.reached_preemption(state.step):
                mgr.save(state.step, tree, force=True)
                mgr.close()  # waits for the save
                if rank == 0:
                    out.write(json.dumps({"preempted_at": state.step}) + "\n")
                raise SystemExit(0)  # a clean exit: the scheduler requeues the job
            mgr.save(state.step, tree)
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
