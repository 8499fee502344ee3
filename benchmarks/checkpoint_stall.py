"""How long a checkpoint stalls the training step: synchronous, this library's async, DCP's async.

A GPT trains with ``ff.train_step`` on all ranks and is saved every ``--save-every`` steps by

- ``sync``: ``CheckpointManager(async_save=False)``: the loop waits for the whole write;
- ``async``: ``CheckpointManager(async_save=True)``: the loop waits for a staged copy of the
  rank's local tensors, the write runs on a thread over the manager's own gloo group;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the same state dict (DTensors)
  over a gloo group of its own (the training group would interleave its collectives with the
  step's), waiting for the previous save before starting the next, as the manager does.

The stall of one save is the time the loop is blocked in the save call plus what the steps
that run while the write is in flight lose against the median step without saves. Peak
memory: this rank's resident set at its highest during the mode (``VmHWM``, reset before each
mode through ``/proc/self/clear_refs``) above the resident set when the mode started; the
rank's checkpoint bytes (its local shards of parameters and optimizer state) for comparison.

    torchrun --nproc-per-node 2 benchmarks/checkpoint_stall.py [--widths 128 384]

Prints a Markdown table and writes ``benchmarks/results/checkpoint_stall.json`` (with the
command, the commit and the machine).
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
import torch.distributed.checkpoint as dcp

import functional_fsdp as ff
from functional_fsdp.checkpoint.manager import _state_dict
from functional_fsdp.models import GPT, GPTConfig, lm_loss

MODES = ("none", "sync", "async", "dcp_async")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def run_size(width: int, layers: int, steps: int, save_every: int, base: str) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=layers, n_head=4, n_embd=width)
    f = ff.fsdp(GPT(cfg), ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(1e-3)
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (8, 65), generator=gen) for _ in range(4)]
    dcp_group = dist.new_group(backend="gloo")
    out: dict[str, dict[str, float]] = {}
    local_bytes = 0
    for mode in MODES:
        state = ff.TrainState.create(f.shard(), opt)
        state, _ = step(state, data[0])  # warm up
        local_bytes = sum(
            _local(v).numel() * _local(v).element_size()
            for v in _state_dict({"state": state}).values()
            if isinstance(v, torch.Tensor)
        )
        mgr = None
        if mode in ("sync", "async"):
            mgr = ff.checkpoint.CheckpointManager(
                os.path.join(base, f"{width}-{mode}"),
                save_every=save_every,
                keep_last=2,
                async_save=mode == "async",
            )
        future = None
        dist.barrier()
        _reset_peak()
        rss0 = _status("VmRSS")
        plain, during, blocked = [], [], []
        saves = 0
        for i in range(steps):
            pending = mgr._pending if mgr is not None else future
            busy = pending is not None and not pending.done()
            dist.barrier()
            t0 = time.perf_counter()
            state, metrics = step(state, data[i % len(data)])
            float(metrics["loss"])
            t1 = time.perf_counter()
            (during if busy else plain).append(t1 - t0)
            if (i + 1) % save_every:
                continue
            if mgr is not None:
                mgr.save(int(state.step), {"state": state}, force=True)
            elif mode == "dcp_async":
                if future is not None:
                    future.result()
                path = os.path.join(base, f"{width}-dcp", f"step_{i + 1}")
                future = dcp.async_save(
                    _state_dict({"state": state}), checkpoint_id=path, process_group=dcp_group
                )
            else:
                continue
            blocked.append(time.perf_counter() - t1)
            saves += 1
        t0 = time.perf_counter()
        if mgr is not None:
            mgr.close()
        if future is not None:
            future.result()
        tail = time.perf_counter() - t0
        peak = _status("VmHWM") - rss0
        base_step = statistics.median(plain)
        lost = sum(d - base_step for d in during)
        out[mode] = {
            "step_ms": base_step * 1e3,
            "blocked_per_save_ms": (statistics.median(blocked) * 1e3) if blocked else 0.0,
            "step_while_writing_ms": statistics.median(during) * 1e3 if during else float("nan"),
            "stall_per_save_ms": ((sum(blocked) + lost) / saves * 1e3) if saves else 0.0,
            "saves": saves,
            "final_wait_ms": tail * 1e3,
            "peak_rss_above_start_mib": peak / 2**20,
        }
    dist.destroy_process_group(dcp_group)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    return {
        "width": width,
        "layers": layers,
        "parameters": params,
        "rank_checkpoint_mib": local_bytes / 2**20,
        "modes": out,
    }


DESCRIPTION = (
    "How long a save blocks the training loop, per rank, on 2 gloo ranks: a synchronous save, "
    "CheckpointManager(async_save=True) and torch DCP's async_save, for a 4-layer GPT at two "
    "widths (AdamW state included), with the resident memory the saves add."
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[128, 384])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=6)
    args = p.parse_args()
    ff.init_distributed()
    rank = dist.get_rank()
    root = [tempfile.mkdtemp(prefix="ff-stall-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    sizes = [run_size(w, args.layers, args.steps, args.save_every, root[0]) for w in args.widths]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)
        for s in sizes:
            print(
                f"\nGPT {s['layers']} layers, width {s['width']} ({s['parameters']:,} parameters;"
                f" {s['rank_checkpoint_mib']:.1f} MiB of checkpoint per rank)"
            )
            print(
                "| mode | step (ms) | blocked per save (ms) | step while writing (ms) "
                "| stall per save (ms) | peak RSS above start (MiB) |"
            )
            print("|---|---|---|---|---|---|")
            for mode, r in s["modes"].items():
                print(
                    f"| {mode} | {r['step_ms']:.1f} | {r['blocked_per_save_ms']:.1f} | "
                    f"{r['step_while_writing_ms']:.1f} | {r['stall_per_save_ms']:.1f} | "
                    f"{r['peak_rss_above_start_mib']:.1f} |"
                )
        from _results import record

        for size in sizes:
            path = record(
                "checkpoint_stall",
                f"width={size['width']}",
                size,
                description=DESCRIPTION,
                nproc=dist.get_world_size(),
            )
        print(f"\nwrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
