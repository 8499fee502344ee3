"""Context parallelism: per-rank tensor memory and step time of one long sequence split over
cp = 1, 2 and 4 gloo ranks, at several sequence lengths, for a fixed transformers Llama.

``python benchmarks/cp_scaling.py [--lengths 1024,2048,4096,8192] [--steps 3]``: for each
length and cp (a mesh ``{"cp": cp}`` of cp processes; the global batch is one packed
sequence), the least tensor memory a step adds on a rank (``ff.tensor_peak``, the largest
over ranks, of ``--steps`` warm steps) and the median step time (the slowest rank). Writes
``benchmarks/results/cp_scaling.json``. Each rank holds ``length / cp`` tokens; the keys and
values of every attention layer are gathered whole on every rank. The machine has 2 cores:
cp = 4 runs 4 processes on them, so its times show the cost of the split, not its speed-up.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import functional_fsdp as ff

WIDTH, LAYERS, VOCAB = 256, 2, 256


def worker(lengths: list[int], steps: int) -> dict[int, dict[str, float]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    world = torch.distributed.get_world_size()
    mesh = ff.make_mesh({"cp": world})
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max(lengths),
        use_cache=False,
        attn_implementation=ff.cp.register_attention(),
    )
    model = LlamaForCausalLM(config)
    sharded = ff.fsdp(model, mesh)

    def loss_fn(params: Any, b: dict[str, torch.Tensor]) -> Any:
        logits = sharded.apply(
            params, input_ids=b["input_ids"], position_ids=b["position_ids"]
        ).logits
        return ff.causal_lm_loss(logits, shift_labels=b["shift_labels"])

    opt = ff.adamw(1e-3)
    step = ff.train_step(loss_fn, opt, model=sharded, donate=True)
    out: dict[int, dict[str, float]] = {}
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, VOCAB, (1, length), generator=gen)
        batch = {
            "input_ids": ids,
            "position_ids": torch.arange(length)[None],
            "shift_labels": torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:],
        }
        state = ff.TrainState.create(sharded.shard(), opt)
        state, _ = step(state, batch)  # warm-up
        peaks, times = [], []
        for _ in range(steps):
            torch.distributed.barrier()
            t = time.perf_counter()
            state, _ = step(state, batch)
            times.append(time.perf_counter() - t)
            holder: dict[str, Any] = {}

            def once(holder: dict[str, Any] = holder, state: Any = state) -> None:
                holder["state"] = step(state, batch)[0]

            peaks.append(ff.tensor_peak(once).added_mib)
            state = holder["state"]
        out[length] = {"tensor_mib": min(peaks), "step_s": statistics.median(times)}
    return out


def main(lengths: list[int], steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import record

    per_cp: dict[int, dict[int, dict[str, float]]] = {}
    for cp in (1, 2, 4):
        pool = ff.ProcessPool(cp, device_type="cpu", timeout=1800)
        try:
            ranks = pool.run(worker, lengths, steps)
        finally:
            pool.close()
        per_cp[cp] = {n: {k: max(r[n][k] for r in ranks) for k in ranks[0][n]} for n in lengths}
    for n in lengths:
        figures = {
            f"cp={cp}": {
                "tokens_per_rank": n // cp,
                "tensor_mib": round(per_cp[cp][n]["tensor_mib"], 1),
                "step_s": round(per_cp[cp][n]["step_s"], 3),
            }
            for cp in per_cp
        }
        print(f"length {n}:", figures)
        record(
            "cp_scaling",
            f"length={n}",
            figures,
            description=__doc__.split("\n\n")[0].replace("\n", " "),
        )


if __name__ == "__main__":
    argv = sys.argv
    lengths = "1024,2048,4096,8192"
    if "--lengths" in argv:
        lengths = argv[argv.index("--lengths") + 1]
    main(
        [int(x) for x in lengths.split(",")],
        int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 3,
    )
