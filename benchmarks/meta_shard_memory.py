"""Peak memory per rank of the two ways to shard a model built on meta: ``sm.shard()`` and
``ff.init_sharded(sm)``.

Both go through one implementation (``FSDP.shard()`` of a meta module is
``ff.init_sharded``'s parameters), so their peaks should agree; this measures it. The
library's GPT (8 blocks of width 1024, vocabulary 8192, by default: Ψ = 418 MiB fp32; it has
no buffers, which ``sm.shard()`` could not return) is built on meta on every rank of a gloo
job, then sharded each way, alternately (``shard``,
``init_sharded``, ``shard``, ``init_sharded``), so that no path pays a first call's one-time
costs: both first run once on a tiny model of the same architecture. The method is
``benchmarks/lifecycle_memory.py``'s (resident memory: ``VmHWM`` above a warmed-up baseline,
large blocks mmapped so freed tensors leave RSS at once); the table shows the maximum over
ranks.

    torchrun --nproc-per-node 2 benchmarks/meta_shard_memory.py [--layers 8] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lifecycle_memory import MiB, _exact_rss, _measure, _settle

WAYS = ("shard", "init_sharded")


def _config(layers: int, hidden: int) -> GPTConfig:
    return GPTConfig(
        n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=8192, block_size=256
    )


def _meta_model(config: GPTConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(config)


def _way(name: str, config: GPTConfig, mesh: Any) -> Any:
    sm = ff.fsdp(_meta_model(config), mesh)

    def run() -> None:
        torch.manual_seed(0)  # the same model on every rank (shard and init_sharded check)
        params = sm.shard() if name == "shard" else ff.init_sharded(sm, init_fn=GPT._init)[0]
        del params

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    _exact_rss()
    mesh = ff.make_mesh({"dp": int(os.environ.get("WORLD_SIZE", "1"))})
    config, tiny = _config(args.layers, args.hidden), _config(2, 64)
    for name in WAYS:  # one-time costs (imports, decompositions, gloo) before the baseline
        _measure(_way(name, tiny, mesh), 0)
    base = _settle()
    psi = sum(p.numel() * 4 for p in _meta_model(config).parameters()) / MiB
    peaks: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(args.repeats):
        for name in WAYS:
            run = _way(name, config, mesh)
            _, figures = _measure(run, base)
            peaks[name].append(figures["peak"])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peaks)
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print(f"GPT {args.layers} x {args.hidden}: Ψ = {psi:.0f} MiB fp32, {n} gloo ranks")
        print("| way | peak MiB above baseline per rank (max over ranks), each repeat |")
        print("|---|---|")
        for name in WAYS:
            runs = [max(g[name][i] for g in gathered) for i in range(args.repeats)]
            label = "sm.shard()" if name == "shard" else "ff.init_sharded(sm)"
            print(f"| {label} | " + ", ".join(f"{p:.0f}" for p in runs) + " |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
