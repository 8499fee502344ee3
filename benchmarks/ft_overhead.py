"""Fault tolerance across replica groups: what it costs per step, and how long a group's
death stalls the others.

``python benchmarks/ft_overhead.py [--widths 128,512] [--steps 12]``: for each GPT width,
on 4 gloo processes of this machine,

* ``hsdp``: one job, mesh ``{"replicate": 2, "shard": 2}`` (HSDP: reduce-scatter over
  ``shard``, all-reduce over ``replicate``), the step without fault tolerance;
* ``ft``: two replica groups of 2 ranks (mesh ``{"shard": 2}`` each) joined by
  ``ff.ft.ReplicaGroup`` (torchft: a lighthouse quorum per step, the gradients all-reduced
  over the groups through torchft's process group, a commit vote);
* ``death``: the same, with group 1 exiting between two steps: the time from its exit to
  the survivors' next committed step.

Each group's batch is half of HSDP's global batch, so both compute the same step. Step time:
the median over the steps after ``--warmup``, of the slowest rank. Writes
``benchmarks/results/ft_overhead.json``. Two cores run 4 processes here, so the times are
those of an oversubscribed CPU; the ratio is what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent

BATCH, SEQ = 8, 64  # the global batch of the HSDP step; each replica group takes half


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import functional_fsdp as ff
    import functional_fsdp.ft
    from functional_fsdp.models import GPT, GPTConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=args.width, n_head=4, vocab_size=256, block_size=SEQ)
    ft = args.mode != "hsdp"
    mesh = ff.make_mesh({"shard": 2} if ft else {"replicate": 2, "shard": 2})
    sm = ff.fsdp(GPT(cfg), mesh)
    opt = ff.adamw(1e-3)
    group = functional_fsdp.ft.ReplicaGroup(str(args.group), timeout=60) if ft else None

    def loss_fn(params, ids):
        return ff.causal_lm_loss(sm.apply(params, ids), ids)

    step = ff.train_step(loss_fn, opt, model=sm, replicas=group)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    rows = BATCH // 2 if ft else BATCH
    times, commits = [], []
    while state.step < args.steps:
        if ft and args.group == 1 and state.step == args.die_at:
            Path(args.out, "died").write_text(repr(time.time()))
            os._exit(0)
        g = torch.Generator().manual_seed(100 * args.group + int(state.step))
        ids = torch.randint(0, 256, (rows, SEQ), generator=g)
        t0 = time.perf_counter()
        state, metrics = step(state, ids)
        float(metrics["loss"])
        times.append(time.perf_counter() - t0)
        if not ft or metrics["committed"]:
            commits.append(time.time())
    Path(args.out, f"{args.mode}_{args.group}_{rank}.json").write_text(
        json.dumps({"times": times, "commits": commits})
    )
    if group is not None:
        group.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def _start(mode: str, group: int, world: int, args: argparse.Namespace, out: str, **env_) -> list:
    port = _port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **env_,
        }
        cmd = [
            sys.executable, __file__, "--worker", "--mode", mode, "--group", str(group),
            "--width", str(args.width), "--steps", str(args.steps), "--out", out,
            "--die-at", str(args.die_at),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def _wait(procs: list) -> None:
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a worker exited with {p.returncode}")


def _median_of_slowest(out: str, prefix: str, warmup: int) -> float:
    runs = [json.loads(p.read_text())["times"] for p in Path(out).glob(f"{prefix}_*.json")]
    return statistics.median(max(ts) for ts in zip(*(r[warmup:] for r in runs)))


def measure(args: argparse.Namespace) -> dict[str, float]:
    import torchft

    out = tempfile.mkdtemp()
    _wait(_start("hsdp", 0, 4, args, out))
    lighthouse = torchft._torchft.LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000
    )
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
    try:
        args.die_at = -1
        _wait(_start("ft", 0, 2, args, out, **env) + _start("ft", 1, 2, args, out, **env))
        args.die_at = args.steps // 2
        survivors = _start("death", 0, 2, args, out, **env)
        _wait(_start("death", 1, 2, args, out, **env) + survivors)
    finally:
        lighthouse.shutdown()
    died = float(Path(out, "died").read_text())
    commits = json.loads(Path(out, "death_0_0.json").read_text())["commits"]
    hsdp = _median_of_slowest(out, "hsdp", args.warmup)
    ft = _median_of_slowest(out, "ft", args.warmup)
    return {
        "hsdp_step_s": round(hsdp, 4),
        "ft_step_s": round(ft, 4),
        "ft_over_hsdp": round(ft / hsdp, 3),
        "death_to_next_commit_s": round(min(c for c in commits if c > died) - died, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", default="128,512")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="hsdp")
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--out", default="")
    p.add_argument("--die-at", type=int, default=-1)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from _results import record

    print(f"{'width':>6} {'hsdp s':>8} {'ft s':>8} {'ft/hsdp':>8} {'death->next commit s':>21}")
    for width in (int(w) for w in args.widths.split(",")):
        args.width = width
        fig = measure(args)
        print(
            f"{width:>6} {fig['hsdp_step_s']:>8.3f} {fig['ft_step_s']:>8.3f} "
            f"{fig['ft_over_hsdp']:>8.2f} {fig['death_to_next_commit_s']:>21.2f}"
        )
        record(
            "ft_overhead",
            f"width={width}",
            fig,
            description=__doc__.split("\n\n")[0],
        )


if __name__ == "__main__":
    main()
