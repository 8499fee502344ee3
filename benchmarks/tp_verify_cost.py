"""What the tensor-parallel plan check costs: the first train step of a GPT under its TP plan,
with ``tensor_parallel(..., verify=True)`` (the default) and ``verify=False``.

The check runs once per distinct block (one attention, one MLP and the vocabulary-parallel
embedding here, whatever the depth), at the first call only. Prints, per model, the seconds
the checks took on rank 0 (``TensorParallel.checks.seconds``), the first step's seconds with
and without them (best of ``--repeats``, alternating), and a later step's seconds:

    torchrun --nproc-per-node 4 benchmarks/tp_verify_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan

CONFIGS = {
    "tiny (tests)": GPTConfig(n_layer=2, vocab_size=64, n_embd=64, n_head=4, block_size=128),
    "12 layers, 768 wide": GPTConfig(
        n_layer=12, vocab_size=4096, n_embd=768, n_head=12, block_size=256
    ),
}
BATCH, TOKENS = 8, 129


def first_step(cfg: GPTConfig, mesh, verify: bool) -> tuple[float, float, float]:
    """(first step's seconds, the checks' seconds, a later step's seconds)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    tp = ff.tensor_parallel(model, mesh, gpt_plan(cfg), verify=verify)
    sm = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), generator=gen)
    opt = ff.adamw(1e-3)

    def loss_fn(p, b):
        return ff.vocab_parallel_cross_entropy(sm.apply(p, b[:, :-1]), b[:, 1:], mesh)

    step = ff.train_step(loss_fn, opt, model=sm)
    state = ff.TrainState.create(sm.shard(), opt)
    dist.barrier()
    start = time.perf_counter()
    state, metrics = step(state, batch)
    float(metrics["loss"])
    first = time.perf_counter() - start
    start = time.perf_counter()
    state, metrics = step(state, batch)
    float(metrics["loss"])
    later = time.perf_counter() - start
    return first, (tp.checks.seconds if tp.checks else 0.0), later


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ff.init_distributed()
    world = dist.get_world_size()
    mesh = ff.make_mesh({"dp": world // 2, "tp": 2})
    for name, cfg in CONFIGS.items():
        on, off, checks, later = [], [], 0.0, []
        for _ in range(args.repeats):
            f, checks, later_on = first_step(cfg, mesh, True)
            on.append(f)
            later.append(later_on)
            off.append(first_step(cfg, mesh, False)[0])
        if dist.get_rank() == 0:
            params = sum(p.numel() for p in GPT(cfg).parameters())
            print(
                f"{name} ({params:,} parameters, dp={world // 2} x tp=2, gloo): checks "
                f"{checks:.3f} s; first step {min(on):.3f} s checked, {min(off):.3f} s "
                f"unchecked; a later step {min(later):.3f} s"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
