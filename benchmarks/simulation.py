"""How simulated meshes scale: ``shard``, ``gather`` and a train step, against plain torch.

Measures, in one process on the CPU:

* ``ff.shard`` and ``ff.gather`` of a one-layer GPT's parameters on a simulated
  ``{"dp": n}`` mesh for several ``n`` (the target: seconds at ``n = 512``);
* one training step (forward, backward, AdamW) of the small GPT on a simulated ``{"dp": 8}``
  mesh against the same step in plain single-process torch on the same global batch (the
  target: within 10x of plain torch per step);
* a shapes-only step (meta tensors, fake process group) of the same GPT at 1024 ranks.

Prints Markdown tables, side by side with plain torch, and exits non-zero when a target is
missed (``--no-check`` to only print). The step ratio is also given in process CPU time,
which other jobs on a shared machine disturb less than the wall clock.

    python benchmarks/simulation.py [--ranks 8 32 128 512] [--steps 5] [--shapes-only 0]
                                    [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

_SORT = "cumulative"  # the order of --profile's tables
STEP_TARGET = 10.0  # simulated dp=8 step / plain torch step
SHARD_TARGET_S = 10.0  # dp=512 shard of a one-layer GPT, seconds
SHAPES_TARGET_S = 10.0  # shapes-only step at 1024 ranks, seconds


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _profiled(fn: Callable[[], Any], profile: bool, title: str) -> Any:
    if not profile:
        return fn()
    prof = cProfile.Profile()
    out = prof.runcall(fn)
    print(f"\n--- profile: {title}")
    pstats.Stats(prof).sort_stats(_SORT).print_stats(25)
    return out


def bench_shard_gather(ranks: list[int], profile: bool) -> list[dict[str, Any]]:
    """``shard`` and ``gather`` of a one-layer GPT on ``{"dp": n}``; plain torch clones it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    params = {k: p.detach() for k, p in model.named_parameters()}
    plain, _ = _timed(lambda: {k: v.clone() for k, v in params.items()})
    with ff.simulated_mesh({"dp": 2}) as mesh:  # one-time costs (imports) out of the figures
        ff.gather(ff.shard(params, mesh, ff.P("dp")))
    rows = []
    for n in ranks:
        with ff.simulated_mesh({"dp": n}) as mesh:
            t_shard, sharded = _timed(
                lambda mesh=mesh: _profiled(
                    lambda: ff.shard(params, mesh, ff.P("dp")), profile, f"shard dp={n}"
                )
            )
            t_gather, full = _timed(
                lambda s=sharded: _profiled(lambda: ff.gather(s), profile, f"gather dp={n}")
            )
            same = all(torch.equal(ff.rank_values(full[k])[-1], v) for k, v in params.items())
        rows.append(dict(ranks=n, shard=t_shard, gather=t_gather, plain=plain, equal=same))
    return rows


def _small_gpt() -> tuple[GPT, GPTConfig]:
    cfg = GPTConfig()  # 2 layers, width 64, vocab 256, block 64
    torch.manual_seed(0)
    return GPT(cfg), cfg


def bench_step(n: int, steps: int, batch: int, profile: bool) -> dict[str, float]:
    """Median step time: simulated ``{"dp": n}`` against plain torch on the same global batch.

    The two take steps in turn (plain torch with the simulation's dispatch mode off the
    stack), so that load from other processes on the machine hits both alike.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    model, cfg = _small_gpt()
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (batch, 65), generator=g) for _ in range(steps + 1)]

    # Plain torch: the same model, global batch and AdamW (foreach kernels), one process.
    ref = GPT(cfg)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)

    def plain_step(b: torch.Tensor) -> float:
        loss = lm_loss(ref(b[:, :-1]), b[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    plain_times, plain_losses, sim_times, sim_losses = [], [], [], []
    plain_cpu: list[float] = []
    sim_cpu: list[float] = []
    with ff.simulated_mesh({"dp": n}) as mesh:
        sm = ff.fsdp(model, mesh)
        optimizer = ff.adamw(1e-3, weight_decay=0.01)
        step = ff.train_step(
            lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), optimizer, model=sm
        )
        state = ff.TrainState.create(sm.shard(), optimizer)
        for i, b in enumerate(data):
            with _disable_current_modes():  # plain torch: no simulation on the dispatch stack
                cpu = time.process_time()
                t, loss = _timed(lambda b=b: plain_step(b))
                plain_cpu.append(time.process_time() - cpu)
            plain_times.append(t)
            plain_losses.append(loss)
            last = profile and i == len(data) - 1
            cpu = time.process_time()
            t, (state, metrics) = _timed(
                lambda b=b, s=state, last=last: _profiled(
                    lambda: step(s, b), last, f"train step dp={n}"
                )
            )
            sim_cpu.append(time.process_time() - cpu)
            sim_times.append(t)
            sim_losses.append(ff.rank_values(metrics["loss"])[0].item())
    # The first step of each warms caches (plans, kernels); it is left out.
    plain_med = statistics.median(plain_times[1:])
    sim_med = statistics.median(sim_times[1:])
    plain_cpu_med = statistics.median(plain_cpu[1:])
    sim_cpu_med = statistics.median(sim_cpu[1:])
    return dict(
        ranks=n,
        plain=plain_med,
        sim=sim_med,
        ratio=sim_med / plain_med,
        plain_cpu=plain_cpu_med,
        sim_cpu=sim_cpu_med,
        cpu_ratio=sim_cpu_med / plain_cpu_med,
        loss_diff=max(abs(a - b) for a, b in zip(sim_losses, plain_losses)),
    )


def bench_shapes_only(n: int, profile: bool) -> dict[str, Any]:
    """One train step of the small GPT with meta tensors on a fake ``{"dp": n}`` mesh."""
    cfg = GPTConfig()

    def run() -> dict[str, Any]:
        with torch.device("meta"):
            model = GPT(cfg)
        with ff.simulated_mesh({"dp": n}, shapes_only=True) as mesh:
            sm = ff.fsdp(model, mesh)
            optimizer = ff.adamw(1e-3, weight_decay=0.01)
            step = ff.train_step(
                lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), optimizer, model=sm
            )
            # The meta parameters as they are: shard() lays out meta blocks, no values.
            params = sm.shard({k: p.detach() for k, p in model.named_parameters()})
            state = ff.TrainState.create(params, optimizer)
            batch = torch.empty(n, 65, dtype=torch.long, device="meta")
            with ff.count_comms() as comms:
                state, _ = step(state, batch)
        return dict(ranks=n, comms=comms.by_kind_and_axis())

    t, out = _timed(lambda: _profiled(run, profile, f"shapes-only step dp={n}"))
    out["time"] = t
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--step-ranks", type=int, default=8)
    parser.add_argument("--shapes-ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows of 64 tokens)")
    parser.add_argument("--shapes-only", type=int, default=1, help="0 skips the shapes-only step")
    parser.add_argument("--profile", action="store_true", help="print cProfile summaries")
    parser.add_argument("--no-check", action="store_true", help="do not fail on a missed target")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    misses = []

    print("## shard / gather of a one-layer GPT (parameters of", end=" ")
    print(f"{sum(p.numel() for p in GPT(GPTConfig(n_layer=1)).parameters()):,} elements)\n")
    print("| simulated ranks | shard (s) | gather (s) | plain torch copy (s) | gathered == input |")
    print("|--:|--:|--:|--:|:--|")
    for r in bench_shard_gather(args.ranks, args.profile):
        print(
            f"| {r['ranks']} | {r['shard']:.3f} | {r['gather']:.3f} | {r['plain']:.4f} "
            f"| {r['equal']} |"
        )
        if not r["equal"]:
            misses.append(f"gather at dp={r['ranks']} did not give the input back")
        if r["ranks"] >= 512 and r["shard"] > SHARD_TARGET_S:
            misses.append(f"shard at dp={r['ranks']}: {r['shard']:.1f} s > {SHARD_TARGET_S} s")

    s = bench_step(args.step_ranks, args.steps, args.batch, args.profile)
    print(f"\n## train step of the small GPT ({GPTConfig()}), global batch {args.batch}x64\n")
    print(f"| | plain torch, 1 process | simulated dp={s['ranks']} | ratio | max loss difference |")
    print("|--|--:|--:|--:|--:|")
    print(
        f"| median step, wall (ms) | {1e3 * s['plain']:.1f} | {1e3 * s['sim']:.1f} "
        f"| {s['ratio']:.1f}x | {s['loss_diff']:.1e} |"
    )
    print(
        f"| median step, CPU (ms) | {1e3 * s['plain_cpu']:.1f} | {1e3 * s['sim_cpu']:.1f} "
        f"| {s['cpu_ratio']:.1f}x | |"
    )
    if s["ratio"] > STEP_TARGET:
        misses.append(f"simulated step {s['ratio']:.1f}x plain torch > {STEP_TARGET}x")

    if not args.shapes_only:
        return _report(misses, args.no_check)
    sh = bench_shapes_only(args.shapes_ranks, args.profile)
    print(f"\n## shapes-only train step (meta tensors, fake process group), dp={sh['ranks']}\n")
    print(f"time: {sh['time']:.2f} s\n")
    print("| kind | axis | count | bytes per rank |")
    print("|--|--|--:|--:|")
    for (kind, axis), (count, nbytes) in sorted(sh["comms"].items()):
        print(f"| {kind} | {axis} | {count} | {nbytes:,} |")
    if sh["time"] > SHAPES_TARGET_S:
        misses.append(f"shapes-only step at dp={sh['ranks']}: {sh['time']:.1f} s")

    return _report(misses, args.no_check)


def _report(misses: list[str], no_check: bool) -> int:
    for m in misses:
        print(f"MISSED: {m}", file=sys.stderr)
    return 1 if misses and not no_check else 0


if __name__ == "__main__":
    sys.exit(main())
