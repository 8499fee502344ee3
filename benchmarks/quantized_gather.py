"""Quantized weight all-gathers (ZeRO++'s qwZ, FSDP2 + torchao's float8) against exact ones:
the example GPT trained on Python's help topics on 2 gloo ranks, the same seed, batches and
steps, with ``Policy(gather_quantization=ff.QuantizedGather(block_size))``, with
``ff.Float8Gather()`` and without.

``python benchmarks/quantized_gather.py [--steps 600] [--block-size 256] [--runs
exact,int8,float8]``: the loss curve of each run (every 10 steps), the mean loss of the last
50 steps and its ratio to the exact run's, the all-gather and reduction bytes per step and
the median step time. ``--runs exact,qgz`` trains with int8 gradient reduction
(``ff.QuantizedReduce``, ZeRO++'s qgZ) instead; ``qgz4`` with 4-bit gradients. Writes
``benchmarks/results/quantized_gather.json``. CPU times on a shared 2-core machine are noisy,
and gloo on one host moves bytes through memory: the bytes, not the times, are what a slow
interconnect would feel.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import functional_fsdp as ff

ROOT = Path(__file__).resolve().parents[1]
RUNS = ["exact", "int8", "float8"]  # "exact" first: the others' ratios are to it


def _policy(run: str, block_size: int) -> ff.Policy:
    """The policy of a run's name (``qgz``: int8 gradient reduction, exact gathers)."""
    return {
        "exact": ff.Policy(),
        "int8": ff.Policy(gather_quantization=ff.QuantizedGather(block_size=block_size)),
        "float8": ff.Policy(gather_quantization=ff.Float8Gather()),
        "qgz": ff.Policy(grad_quantization=ff.QuantizedReduce(block_size=block_size)),
        "qgz4": ff.Policy(grad_quantization=ff.QuantizedReduce(block_size=block_size, bits=4)),
    }[run]


def worker(steps: int, run: str, block_size: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "examples"))
    from chardata import load_text, random_batch

    from functional_fsdp.models import GPT, GPTConfig, lm_loss

    data, chars = load_text()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    mesh = ff.make_mesh({"dp": torch.distributed.get_world_size()})
    sharded = ff.fsdp(model, mesh, policy=_policy(run, block_size))
    schedule = ff.warmup_cosine_decay_schedule(0.0, 3e-3, steps // 10, steps, 3e-4)
    opt = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(schedule, weight_decay=0.1))
    step = ff.train_step(
        lambda p, b: lm_loss(sharded.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sharded
    )
    state = ff.TrainState.create(sharded.shard(), opt)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    with ff.count_comms() as comms:
        state, metrics = step(state, random_batch(data, 16, cfg.block_size, gen))
    losses.append(float(metrics["loss"]))
    for _ in range(steps - 1):
        batch = random_batch(data, 16, cfg.block_size, gen)
        t = time.perf_counter()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    return {
        "losses": losses,
        "all_gather_bytes": comms.bytes("all_gather"),
        "all_reduce_bytes": comms.bytes("all_reduce"),
        "reduce_bytes": comms.bytes("reduce_scatter") + comms.bytes("all_to_all"),
        "step_s": statistics.median(times),
    }


def main(steps: int, block_size: int, runs: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import record

    runs = ["exact", *(r for r in runs if r != "exact")]  # the ratios' reference, first
    pool = ff.ProcessPool(2, device_type="cpu", timeout=3600)
    try:
        names = {
            "exact": "exact",
            "int8": f"int8, block {block_size}",
            "float8": "float8 e4m3",
            "qgz": f"int8 gradients, block {block_size}",
            "qgz4": f"4-bit gradients, block {block_size}",
        }
        results = {names[run]: pool.run(worker, steps, run, block_size)[0] for run in runs}
    finally:
        pool.close()
    tail = {k: statistics.fmean(r["losses"][-50:]) for k, r in results.items()}
    figures = {
        name: {
            "final_loss": round(tail[name], 4),
            "final_loss_ratio": round(tail[name] / tail["exact"], 4),
            "all_gather_bytes": r["all_gather_bytes"],
            "bytes_ratio": round(r["all_gather_bytes"] / results["exact"]["all_gather_bytes"], 4),
            "all_reduce_bytes": r["all_reduce_bytes"],
            "reduce_bytes": r["reduce_bytes"],  # reduce-scatter or qgZ's all-to-all
            "step_s": round(r["step_s"], 4),
            "step_ratio": round(r["step_s"] / results["exact"]["step_s"], 4),
            "losses_every_10": [round(x, 4) for x in r["losses"][::10]],
        }
        for name, r in results.items()
    }
    for name, f in figures.items():
        print(name, {k: v for k, v in f.items() if k != "losses_every_10"})
    record(
        "quantized_gather",
        f"steps={steps}" + ("" if runs == RUNS else f", runs={','.join(runs)}"),
        figures,
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )


if __name__ == "__main__":
    argv = sys.argv
    main(
        int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 600,
        int(argv[argv.index("--block-size") + 1]) if "--block-size" in argv else 256,
        argv[argv.index("--runs") + 1].split(",") if "--runs" in argv else RUNS,
    )
