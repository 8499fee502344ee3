"""What activation checkpointing saves and costs: one GPT train step with and without it.

The variants take ``ff.train_step`` steps in the same processes, in rotation (so machine
noise hits them alike), on the same model, batch and mesh: without checkpointing, with
``Policy(activation_checkpointing=True)``, and with ``--global-batch`` also without checkpointing but with
``randomness="global_batch"``. Prints a Markdown table: the median step time, the peak
memory a step adds on top of the resting process, and the storage autograd holds for
backward at the end of the forward (the activations checkpointing saves).

    torchrun --nproc-per-node 2 benchmarks/checkpoint_cost.py [--steps 20] [--dropout 0.1]

Run it with another checkout of the library first on ``PYTHONPATH`` to compare versions
(``--dropout 0`` for a version whose GPT has no dropout).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from step_vs_fsdp2 import _markdown, _step_peak_mib

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss


def _saved_mib(loss: Callable[[Any], torch.Tensor], params: Any) -> float:
    """The storage autograd holds for backward at the end of a forward (plain autograd, where
    saved-tensor hooks can see it): activations, not the parameters gathered and freed."""
    storages: dict[int, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    leaves = {k: v.replace(v.local.detach().requires_grad_()) for k, v in params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss(leaves)
    total = sum(s.nbytes() for s in storages.values()) / 2**20  # freed storages count 0
    del value
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--global-batch", action="store_true", help="also time randomness='global_batch'"
    )
    args = parser.parse_args()

    ff.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    options: dict[str, Any] = dict(
        vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width
    )
    if args.dropout:
        options["dropout"] = args.dropout
    model = GPT(GPTConfig(**options))
    mesh = ff.make_mesh({"dp": world})
    opt = ff.sgd(1e-3)
    base = ff.fsdp(model, mesh)

    def variant(checkpoint: bool, **options: Any) -> Callable[[torch.Tensor], None]:
        sm = dataclasses.replace(base, policy=ff.Policy(activation_checkpointing=checkpoint))
        loss_fn = lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:])  # noqa: E731
        step = ff.train_step(loss_fn, opt, model=sm, batch="local", **options)
        box = {"state": ff.TrainState.create(sm.shard(), opt)}

        def run(b: torch.Tensor) -> None:
            box["state"], _ = step(box["state"], b)

        def saved(b: torch.Tensor) -> float:
            return _saved_mib(lambda p: loss_fn(p, b), box["state"].params)

        run.saved = saved  # type: ignore[attr-defined]
        return run

    systems = {
        "no checkpointing": variant(False),
        "Policy(activation_checkpointing=True)": variant(True),
    }
    if args.global_batch:
        systems["randomness='global_batch'"] = variant(False, randomness="global_batch")
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(args.steps + 2):
        b = torch.randint(0, 512, (args.batch, args.seq + 1), generator=g)
        k = i % len(systems)
        names = list(systems)[k:] + list(systems)[:k]
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            systems[name](b)
            dist.barrier()
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    b = torch.randint(0, 512, (args.batch, args.seq + 1), generator=g)
    peak = {name: _step_peak_mib(lambda f=fn: f(b)) for name, fn in systems.items()}
    saved = {name: fn.saved(b) for name, fn in systems.items()}  # type: ignore[attr-defined]
    if rank == 0:
        print(
            f"GPT {args.layers} layers, width {args.width}, dropout {args.dropout}; batch "
            f"{args.batch}x{args.seq} per rank on {world} rank(s); median of {args.steps} steps"
        )
        rows = [["per rank, per step", *systems]]
        rows.append(
            [
                "median step time (ms)",
                *(f"{statistics.median(times[n]) * 1e3:.1f}" for n in systems),
            ]
        )
        rows.append(["peak memory added by a step (MiB)", *(f"{peak[n]:.1f}" for n in systems)])
        rows.append(
            ["saved for backward after forward (MiB)", *(f"{saved[n]:.1f}" for n in systems)]
        )
        print(_markdown(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
