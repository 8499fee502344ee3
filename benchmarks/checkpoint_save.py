"""What a checkpoint costs the step loop: synchronous vs asynchronous saves, and load verification.

A GPT trains with ``ff.train_step`` on all ranks; a ``CheckpointManager`` saves every
``--save-every`` steps, synchronously or on its background thread. Prints, as a Markdown
table: the median step time without saves, the time the step loop is blocked by a save
(sync: the whole write; async: the staged copy), the median time of the steps that run
while a background write is in flight, and a load with and without verification (CRC-32 of
every file, split across the ranks).

    torchrun --nproc-per-node 2 benchmarks/checkpoint_save.py [--layers 4] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.checkpoint import _atomic
from functional_fsdp.models import GPT, GPTConfig, lm_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=6)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = p.parse_args()
    ff.init_distributed()
    rank = dist.get_rank()

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    f = ff.fsdp(GPT(cfg), ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(1e-3, weight_decay=0.01)
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (8, 65), generator=gen) for _ in range(4)]

    root = [args.dir or (tempfile.mkdtemp(prefix="ff-ckpt-bench-") if rank == 0 else None)]
    dist.broadcast_object_list(root, src=0)
    base = root[0]

    results: dict[str, dict[str, float]] = {}
    for mode in ("none", "sync", "async"):
        state = ff.TrainState.create(f.shard(), opt)
        state, _ = step(state, data[0])  # warm up
        mgr = None
        if mode != "none":
            mgr = ff.checkpoint.CheckpointManager(
                os.path.join(base, mode),
                save_every=args.save_every,
                keep_last=2,
                async_save=mode == "async",
            )
        plain, during, blocked = [], [], []
        for i in range(args.steps):
            pending = mgr._pending if mgr is not None else None  # a background write
            busy = pending is not None and not pending.done()
            dist.barrier()
            t0 = time.perf_counter()
            state, metrics = step(state, data[i % len(data)])
            float(metrics["loss"])
            t1 = time.perf_counter()
            (during if busy else plain).append(t1 - t0)
            if mgr is not None and mgr.save(state.step, {"state": state}):
                blocked.append(time.perf_counter() - t1)
        if mgr is not None:
            t0 = time.perf_counter()
            mgr.close()
            tail = time.perf_counter() - t0
        else:
            tail = 0.0
        results[mode] = {
            "step": statistics.median(plain),
            "during": statistics.median(during) if during else float("nan"),
            "blocked": statistics.median(blocked) if blocked else 0.0,
            "tail": tail,
        }

    # Load: verified (marker, sizes, CRC-32 split across ranks) vs not.
    latest = ff.checkpoint.CheckpointManager(os.path.join(base, "sync"), save_every=1)
    path = os.path.join(base, "sync", f"step_{latest.latest_step():08d}")
    latest.close()
    like = {"state": ff.TrainState.create(f.shard(), opt)}
    load_t = {}
    for verify in (False, True, False, True):
        dist.barrier()
        t0 = time.perf_counter()
        ff.checkpoint.load(path, like, verify=verify)
        load_t.setdefault(verify, []).append(time.perf_counter() - t0)
    nbytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    t0 = time.perf_counter()
    for name in os.listdir(path):
        _atomic.file_digest(os.path.join(path, name))
    hash_s = time.perf_counter() - t0

    if rank == 0:
        mb = nbytes / 2**20
        print(f"checkpoint: {mb:.1f} MiB on {dist.get_world_size()} ranks ({path})")
        print("| mode | step (ms) | loop blocked per save (ms) | step while writing (ms) |")
        print("|---|---|---|---|")
        for mode, r in results.items():
            print(
                f"| {mode} | {r['step'] * 1e3:.1f} | {r['blocked'] * 1e3:.1f} | "
                f"{r['during'] * 1e3:.1f} |"
            )
        lv, lnv = min(load_t[True]), min(load_t[False])
        print(
            f"load: {lnv * 1e3:.1f} ms unverified, {lv * 1e3:.1f} ms verified "
            f"(+{(lv - lnv) * 1e3:.1f} ms); CRC-32 of the whole checkpoint on one rank: "
            f"{hash_s * 1e3:.1f} ms ({mb / hash_s:.0f} MiB/s)"
        )
    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(base)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
