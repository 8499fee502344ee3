"""Step time of Muon (each matrix orthogonalized once, by its owner) against AdamW and
against the usual workaround (every matrix all-gathered and orthogonalized on every rank), on
4 gloo ranks with FSDP, at two GPT sizes.

``python benchmarks/muon_step.py [--steps 5] [--sizes n_embd=256] [--batches 8,32]``: for
each size, batch (sequences of 32 tokens per step, 8 by default) and optimizer, the median
time of a warm ``train_step`` and of the optimizer's ``update`` alone (on the step's sharded
gradients), and the all-to-all and all-gather bytes per rank the update sends. Writes
``benchmarks/results/muon_step.json``, one run per size (``"n_embd=256"``), or per size and
batch where ``--batches`` is given (``"n_embd=256, batch=32"``). CPU timings on a shared machine are noisy, and 4 ranks
on fewer than 4 cores cannot run the owners' work in parallel: read the update times as an
upper bound of what the balance buys.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

SIZES = {"n_embd=128": dict(n_embd=128, n_head=4), "n_embd=256": dict(n_embd=256, n_head=8)}


def matrices(path: str, p: Any) -> Any:
    if p.ndim != 2 or "emb" in path or "head" in path:
        return None
    return ff.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=0)


def _optimizer(name: str) -> ff.GradientTransformation:
    if name == "adamw":
        return ff.adamw(1e-3)
    return ff.contrib.muon(2e-2, muon_weight_dimension_numbers=matrices)


def worker(size: str, steps: int, rows: int = 8) -> dict[str, Any]:
    from functional_fsdp.optim import muon as M

    mesh = ff.make_mesh({"dp": torch.distributed.get_world_size()})
    out: dict[str, Any] = {}
    for name in ("adamw", "muon", "muon_everywhere"):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=4, vocab_size=1024, block_size=32, **SIZES[size])
        f = ff.fsdp(GPT(cfg), mesh)
        opt = _optimizer(name)
        owners = M._on_owners
        if name == "muon_everywhere":  # the workaround: gather everything everywhere
            M._on_owners = lambda mesh, leaves, ns: M._on_simulated(leaves, ns)
        try:
            step = ff.train_step(
                lambda p, b, f=f: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f
            )
            state = ff.TrainState.create(f.shard(), opt)
            gen = torch.Generator().manual_seed(1)
            batch = torch.randint(0, 1024, (rows, 33), generator=gen)
            state, _ = step(state, batch)  # warm-up
            step_s = []
            for _ in range(steps):
                torch.distributed.barrier()
                t = time.perf_counter()
                state, _ = step(state, batch)
                step_s.append(time.perf_counter() - t)
            grads = ff.tree_map(torch.randn_like, state.params)
            update_s = []
            for _ in range(steps):
                torch.distributed.barrier()
                t = time.perf_counter()
                with ff.count_comms() as comms:
                    opt.update(grads, state.opt_state, state.params)
                update_s.append(time.perf_counter() - t)
        finally:
            M._on_owners = owners
        out[name] = {
            "step_ms": 1e3 * statistics.median(step_s),
            "update_ms": 1e3 * statistics.median(update_s),
            "update_all_to_all_bytes": comms.bytes("all_to_all"),
            "update_all_gather_bytes": comms.bytes("all_gather"),
        }
    return out


def main(steps: int, sizes: list[str], batches: list[int] | None) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from _results import record

    pool = ff.ProcessPool(4, device_type="cpu")
    try:
        for size in sizes:
            for rows in batches or [8]:
                figures = pool.run(worker, size, steps, rows)
                worst = {
                    name: {k: max(r[name][k] for r in figures) for k in figures[0][name]}
                    for name in figures[0]
                }
                key = size if batches is None else f"{size}, batch={rows}"
                print(key, worst)
                record(
                    "muon_step",
                    key,
                    worst,
                    description=__doc__.split("\n\n")[0].replace("\n", " "),
                )
    finally:
        pool.close()


if __name__ == "__main__":
    argv = sys.argv
    main(
        int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 5,
        argv[argv.index("--sizes") + 1].split(",") if "--sizes" in argv else list(SIZES),
        [int(b) for b in argv[argv.index("--batches") + 1].split(",")]
        if "--batches" in argv
        else None,
    )
