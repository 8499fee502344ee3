"""Muon against AdamW on the example GPT: the same model, seed, batches and steps, trained on
Python's help topics on 2 gloo ranks with FSDP.

``python benchmarks/muon_loss.py [--steps 200]``: the loss curve of each run (every 10
steps), the mean loss of the last 20 steps and its ratio to AdamW's, and the median step time.
Writes ``benchmarks/results/muon_loss.json``. AdamW: ``ff.adamw`` at a peak learning rate
of 3e-3. Muon: ``ff.contrib.muon`` at 0.02 for the hidden matrices (torch's ``[out, in]``
numbers), its Adam branch at 3e-3 for the embeddings, the head and the norms. Both with weight
decay 0.1, the same warmup-cosine schedule shape and clipping at global norm 1. No tuning
beyond these usual values; a short run on a small model, not a claim about large ones. CPU
times on a shared 2-core machine are noisy.
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


def matrices(path: str, p: Any) -> Any:
    """Hidden matrices to Muon, in torch's [out, in] layout; embeddings, head, norms to Adam."""
    if p.ndim != 2 or "emb" in path or "head" in path:
        return None
    return ff.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=0)


def optimizer(name: str, steps: int) -> ff.GradientTransformation:
    def schedule(peak: float) -> ff.Schedule:
        return ff.warmup_cosine_decay_schedule(0.0, peak, steps // 10, steps, peak / 10)

    if name == "adamw":
        opt = ff.adamw(schedule(3e-3), weight_decay=0.1)
    else:
        opt = ff.contrib.muon(
            schedule(0.02),
            weight_decay=0.1,
            adam_weight_decay=0.1,
            adam_learning_rate=schedule(3e-3),
            muon_weight_dimension_numbers=matrices,
        )
    return ff.chain(ff.clip_by_global_norm(1.0), opt)


def worker(name: str, steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "examples"))
    from chardata import load_text, random_batch

    from functional_fsdp.models import GPT, GPTConfig, lm_loss

    data, chars = load_text()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=4, n_head=4, n_embd=128)
    mesh = ff.make_mesh({"dp": torch.distributed.get_world_size()})
    sharded = ff.fsdp(GPT(cfg), mesh)
    opt = optimizer(name, steps)
    step = ff.train_step(
        lambda p, b: lm_loss(sharded.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sharded
    )
    state = ff.TrainState.create(sharded.shard(), opt)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        batch = random_batch(data, 16, cfg.block_size, gen)
        t = time.perf_counter()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "step_s": statistics.median(times[1:])}


def main(steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import record

    pool = ff.ProcessPool(2, device_type="cpu", timeout=3600)
    try:
        runs = {name: pool.run(worker, name, steps)[0] for name in ("adamw", "muon")}
    finally:
        pool.close()
    tail = {k: statistics.fmean(r["losses"][-20:]) for k, r in runs.items()}
    figures = {
        name: {
            "final_loss": round(tail[name], 4),
            "final_loss_ratio": round(tail[name] / tail["adamw"], 4),
            "step_s": round(r["step_s"], 4),
            "losses_every_10": [round(x, 4) for x in r["losses"][::10]]
            + [round(r["losses"][-1], 4)],
        }
        for name, r in runs.items()
    }
    for name, f in figures.items():
        print(name, {k: v for k, v in f.items() if k != "losses_every_10"})
    record(
        "muon_loss",
        f"steps={steps}",
        figures,
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )


if __name__ == "__main__":
    argv = sys.argv
    main(int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 200)
