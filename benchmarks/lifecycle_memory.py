"""Peak memory per rank to *create* a sharded GPT: functional_fsdp vs FSDP2 vs naive.

Three ways to get the sharded parameters of the same GPT on ``--ranks`` gloo processes:

* ``init_sharded``: the model is built on the meta device; ``init_sharded`` materialises one
  unit at a time (bitwise the eager values on any mesh);
* FSDP2's meta recipe: ``fully_shard`` on the meta model, ``to_empty``, every module's
  ``reset_parameters()`` and the model's own init on the local shards (values depend on the
  mesh);
* naive: build the full model eagerly on every rank, then shard it.

Each method runs in fresh processes (so that no earlier allocation is reused); large blocks
are mmapped so that resident memory follows live tensors. Prints the peak resident memory
each rank adds while creating, as a Markdown table, next to Ψ (the fp32 parameter bytes).

    python benchmarks/lifecycle_memory.py [--size 200] [--ranks 4]   # --size in MB; 1100 for >= 1 GiB
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.fsdp.init import init_sharded
from functional_fsdp.models import GPT, GPTConfig

MiB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _exact_rss() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD, fixed
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    gc.collect()
    libc.malloc_trim(0)


def create(how: str, cfg: GPTConfig) -> dict[str, Any]:
    """Run on every rank: the peak resident memory added while creating the shards."""
    _exact_rss()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    dist.barrier()
    rss0 = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    start = time.perf_counter()
    torch.manual_seed(0)
    if how == "init_sharded":
        with torch.device("meta"):
            model = GPT(cfg)
        params, _ = init_sharded(ff.fsdp(model, mesh), init_fn=GPT._init)
        held = sum(p.local.numel() * p.local.element_size() for p in params.values())
    elif how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", UserWarning)  # DTensor random ops on a CPU mesh
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            model.apply(GPT._init)
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    else:
        model = GPT(cfg)
        params = ff.fsdp(model, mesh).shard()
        del model
        held = sum(p.local.numel() * p.local.element_size() for p in params.values())
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - rss0
    dist.barrier()
    return {"peak": peak, "held": held, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=200, help="fp32 parameter MB (approx.)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    block = 12 * args.width**2 * 4  # bytes of one block's fp32 weights
    layers = max(2, round(args.size * 1e6 / block))
    cfg = GPTConfig(n_layer=layers, n_embd=args.width, n_head=16, vocab_size=512, block_size=64)
    with torch.device("meta"):
        psi = sum(p.numel() * 4 for p in GPT(cfg).parameters())
    unit = 12 * args.width**2 * 4
    print(
        f"GPT {layers} layers x width {args.width}: Ψ = {psi / MiB:.0f} MiB fp32, largest unit "
        f"{unit / MiB:.0f} MiB, {args.ranks} gloo ranks; Ψ/N = {psi / args.ranks / MiB:.0f} MiB\n"
    )
    print("| method | peak added per rank (max over ranks) | shards held | seconds |")
    print("|---|---|---|---|")
    for how, label in [
        ("init_sharded", "ff `init_sharded` (meta, one unit at a time)"),
        ("fsdp2", "FSDP2 meta recipe (`to_empty` + `reset_parameters`)"),
        ("naive", "naive: full model on every rank, then shard"),
    ]:
        with ff.ProcessPool(args.ranks, timeout=3600) as pool:
            results = pool.run(create, how, cfg)
        peak = max(r["peak"] for r in results)
        held = max(r["held"] for r in results)
        secs = max(r["seconds"] for r in results)
        print(f"| {label} | {peak / MiB:.0f} MiB | {held / MiB:.0f} MiB | {secs:.1f} |")


if __name__ == "__main__":
    main()
