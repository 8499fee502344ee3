"""What the debug mode costs: a GPT train step with and without ``ff.check_collectives()``.

The debug mode checks, before every collective, that all ranks issue the same one (kind,
axis, shape, dtype; FSDP's buckets also compare each parameter's name, shape and spec). Each
check is a small all-gather the collective waits for, so it also stops collectives from
overlapping compute. For two GPTs (the test suite's tiny one, 34,884 parameters, and the
training example's shape, 817,920), prints the best-of-``--repeats`` milliseconds per step
with the checks off and on (the two run alternately, to share the machine's noise), the
collectives per step and the extra time per collective:

    torchrun --nproc-per-node 2 benchmarks/debug_cost.py [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

CONFIGS = {
    "tiny (tests)": GPTConfig(n_layer=2, vocab_size=61, n_embd=36, n_head=3, block_size=16),
    "example shape": GPTConfig(n_layer=4, vocab_size=128, n_embd=128, n_head=4, block_size=64),
}
BATCH, TOKENS = 8, 13  # global batch: 8 sequences of 12 inputs and their targets


def step_seconds(cfg: GPTConfig, steps: int, check: bool) -> float:
    """Seconds per train step (after one warm-up step), with or without the checks."""
    torch.manual_seed(0)
    sm = ff.fsdp(GPT(cfg), ff.make_mesh({"dp": dist.get_world_size()}))
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), generator=gen) for _ in range(steps)]
    with ff.check_collectives(check):
        opt = ff.adamw(1e-2, weight_decay=0.01)
        step = ff.train_step(lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
        state, _ = step(state, data[0])  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for batch in data[1:]:
            state, metrics = step(state, batch)
            float(metrics["loss"])
        return (time.perf_counter() - start) / max(1, steps - 1)


def collectives_per_step(cfg: GPTConfig) -> float:
    torch.manual_seed(0)
    sm = ff.fsdp(GPT(cfg), ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(1e-2, weight_decay=0.01)
    step = ff.train_step(lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sm)
    state = ff.TrainState.create(sm.shard(), opt)
    batch = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS))
    with ff.count_comms() as comms:
        step(step(state, batch)[0], batch)
    return comms.count() / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ff.init_distributed()
    rows = []
    for name, cfg in CONFIGS.items():
        off, on = [], []
        for _ in range(args.repeats):
            off.append(step_seconds(cfg, args.steps, check=False))
            on.append(step_seconds(cfg, args.steps, check=True))
        n = collectives_per_step(cfg)
        params = sum(t.numel() for t in GPT(cfg).parameters())
        off_ms, on_ms = 1e3 * min(off), 1e3 * min(on)
        rows.append((name, params, n, off_ms, on_ms, (on_ms - off_ms) / n))
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, best of {args.repeats} runs of {args.steps} steps")
        print(
            "| GPT | parameters | collectives per step | off (ms) | on (ms) | per collective (ms) |"
        )
        print("|---|--:|--:|--:|--:|--:|")
        for name, params, n, off_ms, on_ms, each in rows:
            print(f"| {name} | {params:,} | {n:g} | {off_ms:.1f} | {on_ms:.1f} | {each:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
