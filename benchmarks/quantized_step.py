"""Step time and bytes of quantized FSDP (ZeRO++'s qwZ and qgZ, float8 all-gathers) against
exact FSDP and torch FSDP2: the example GPT trained with AdamW over a ``{"dp": N}`` mesh of
gloo ranks, at two sizes, every system in the same processes, in rotation step by step.

``python benchmarks/quantized_step.py [--steps 24] [--ranks 2,4] [--sizes 128,384]
[--batch 4] [--seq 64] [--compiled]``: for each number of ranks and each width (4 layers, ``--batch``
sequences of ``--seq`` tokens per rank, vocabulary 512), the median step time of
``ff.train_step`` with exact collectives, with int8 weights and int8 gradients
(``QuantizedGather`` and ``QuantizedReduce``, blocks of 256), with int8 weights and 4-bit
gradients (``QuantizedReduce(bits=4)``), with float8 weights (``Float8Gather``), and of torch
FSDP2 (``fully_shard`` per block, then the root, ``loss.backward()``,
``torch.optim.AdamW``); its ratios to the exact step and to FSDP2; and the bytes a rank sends
per step by kind of collective (``ff.count_comms``; FSDP2's counted as step_vs_fsdp2.py
counts them). The rotation also holds the exact step without collectives (on a
``{"ranks": N, "dp": 1}`` mesh: each rank alone on its batch, its parameters whole): the
exact step's excess over it is the share of the step its collectives (and the sharding
around them) take. ``--compiled`` adds the exact and the int8 steps compiled by ``ff.jit``
(inductor fuses the quantization's elementwise passes). Each rank runs one thread. Writes
``benchmarks/results/quantized_step.json``, one run per ranks and width (``"ranks=2,
n_embd=128"``). CPU times on a shared 2-core machine are noisy, 4 ranks share its 2 cores,
and gloo on one host moves bytes through memory: the bytes, not the times, are what a slow
interconnect would feel.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

HERE = Path(__file__).resolve().parent
BLOCK = 256
LOCAL = "exact, no collectives"
"""The exact step on one-rank data axes: what the exact step costs without its collectives."""
KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")

Step = Callable[[torch.Tensor], None]


def policies() -> dict[str, ff.Policy]:
    """The library's systems: their names and policies, exact first."""
    int8 = ff.QuantizedGather(block_size=BLOCK)
    return {
        "exact": ff.Policy(),
        "int8 weights + int8 grads": ff.Policy(
            gather_quantization=int8, grad_quantization=ff.QuantizedReduce(block_size=BLOCK)
        ),
        "int8 weights + 4-bit grads": ff.Policy(
            gather_quantization=int8,
            grad_quantization=ff.QuantizedReduce(block_size=BLOCK, bits=4),
        ),
        "float8 weights": ff.Policy(gather_quantization=ff.Float8Gather()),
    }


def _ff_step(
    model: torch.nn.Module, mesh: Any, policy: ff.Policy, *, jit: bool = False, **kw: Any
) -> Step:
    """``ff.train_step`` with AdamW on ``model`` sharded over ``mesh``; the state kept inside.
    ``jit``: the step compiled by ``ff.jit`` (inductor)."""
    sharded = ff.fsdp(model, mesh, policy=policy, **kw)
    opt = ff.adamw(1e-3, weight_decay=0.1)
    step = ff.train_step(
        lambda p, b: lm_loss(sharded.apply(p, b[:, :-1]), b[:, 1:]),
        opt,
        model=sharded,
        batch="local",
    )
    if jit:
        step = ff.jit(step)
    holder = {"state": ff.TrainState.create(sharded.shard(), opt)}

    def run(b: torch.Tensor) -> None:
        holder["state"], _ = step(holder["state"], b)

    return run


def _fsdp2_step(model: torch.nn.Module, mesh: Any) -> Step:
    """torch FSDP2 on a copy of ``model``: one unit per block, then the root; AdamW."""
    from torch.distributed.fsdp import fully_shard

    ref = copy.deepcopy(model)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)

    def run(b: torch.Tensor) -> None:
        lm_loss(ref(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def worker(width: int, steps: int, rows: int, seq: int, compiled: bool) -> dict[str, Any]:
    """Every system on this rank, in rotation; rank 0's times, and each system's bytes.
    ``compiled``: the exact and the int8 steps compiled by ``ff.jit`` too."""
    from step_vs_fsdp2 import _CountC10d, _rotation

    torch.set_num_threads(1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=seq, n_layer=4, n_head=width // 64, n_embd=width)
    model = GPT(cfg)
    mesh = ff.make_mesh({"dp": world})
    systems = {name: _ff_step(model, mesh, policy) for name, policy in policies().items()}
    if compiled:
        for name in ("exact", "int8 weights + int8 grads"):
            systems[f"{name}, ff.jit"] = _ff_step(model, mesh, policies()[name], jit=True)
    alone = ff.make_mesh({"ranks": world, "dp": 1})
    systems[LOCAL] = _ff_step(model, alone, ff.Policy(), data_axes=["dp"])
    systems["torch FSDP2"] = _fsdp2_step(model, mesh)

    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {name: [] for name in systems}
    warm = 4 if compiled else 2  # warm-up steps (compilation's among them)
    for i in range(steps + warm):
        b = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=gen)
        for name in _rotation(list(systems), i):
            torch.distributed.barrier()
            t = time.perf_counter()
            systems[name](b)
            torch.distributed.barrier()
            if i >= warm:
                times[name].append(time.perf_counter() - t)

    sent: dict[str, dict[str, int]] = {}
    for name, run in systems.items():
        if name == "torch FSDP2":
            counting = _CountC10d(world)
            with counting:
                run(b)
            sent[name] = {k: counting.counts.get(k, [0, 0])[1] for k in KINDS}
        else:
            with ff.count_comms() as comms:
                run(b)
            sent[name] = {k: comms.bytes(k) for k in KINDS}
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"times": times, "bytes": sent, "param_mib": psi / 2**20}


def figures(out: dict[str, Any], ranks: int, width: int, steps: int) -> dict[str, Any]:
    """The JSON figures of one (ranks, width) run from rank 0's measurements."""
    med = {k: statistics.median(v) * 1e3 for k, v in out["times"].items()}
    total = {k: sum(v.values()) for k, v in out["bytes"].items()}
    systems = {
        name: {
            "median_ms": round(med[name], 1),
            "quartiles_ms": [round(q * 1e3, 1) for q in statistics.quantiles(t, n=4)[::2]],
            "time_ratio_exact": round(med[name] / med["exact"], 3),
            "time_ratio_fsdp2": round(med[name] / med["torch FSDP2"], 3),
            "bytes": out["bytes"][name],
            "bytes_ratio_exact": round(total[name] / total["exact"], 4),
        }
        for name, t in out["times"].items()
    }
    return {
        "ranks": ranks,
        "n_embd": width,
        "param_mib": round(out["param_mib"], 1),
        "steps": steps,
        "collective_share": round(1 - med[LOCAL] / med["exact"], 3),
        "systems": systems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed steps per system")
    parser.add_argument("--ranks", default="2,4", help="numbers of gloo ranks")
    parser.add_argument("--sizes", default="128,384", help="widths (n_embd), 4 layers each")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument(
        "--compiled", action="store_true", help="the exact and int8 steps under ff.jit too"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))  # the workers get this path too: step_vs_fsdp2's helpers
    from _results import record

    for ranks in [int(r) for r in args.ranks.split(",")]:
        pool = ff.ProcessPool(ranks, device_type="cpu", timeout=1800)
        try:
            for width in [int(s) for s in args.sizes.split(",")]:
                out = pool.run(worker, width, args.steps, args.batch, args.seq, args.compiled)[0]
                f = figures(out, ranks, width, args.steps)
                print(f"ranks={ranks}, n_embd={width}: {f}")
                record(
                    "quantized_step",
                    f"ranks={ranks}, n_embd={width}",
                    f,
                    description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
                )
        finally:
            pool.close()


if __name__ == "__main__":
    main()
