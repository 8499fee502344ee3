"""Two collectives of one gloo group in flight at once, with torch's two gloo threads and with one.

Runs torch's functional collectives only (no functional_fsdp code in the workers): each step
issues an all-gather and an all-reduce on the world group, allocates a few small tensors, and
waits for both. With torch 2.13's default of two threads per gloo group, the two collectives
run at the same time, and the process's heap gets corrupted ("malloc(): unaligned tcache chunk
detected", or a segmentation fault) within tens of thousands of steps. With one thread
(functional_fsdp/distributed/gloo.py, what the library's process groups use) they run one
after the other, still asynchronously to the caller.

    python benchmarks/gloo_threads.py --steps 250000

prints, per thread count, whether the two workers finished, the last step reached (printed
every 10,000) and the crash message if there was one. A run takes minutes: the steps are tiny
collectives, so their latency dominates (one thread takes longer per step).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import subprocess
import sys
import time


def worker(threads: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    gloo = dist.ProcessGroupGloo

    class Threads(gloo):  # torch's constructor, with `threads` threads
        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            options = gloo._Options()
            options._threads, options._timeout = threads, timeout
            options._devices = [gloo.create_default_device()]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = Threads
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    rng = random.Random(0)
    for step in range(steps):
        n = rng.choice([1, 3, 7, 16, 33, 100, 257, 1000])
        gathered = ops.all_gather_into_tensor(torch.randn(n), 2, group)
        reduced = ops.all_reduce(torch.randn(n), "sum", group)
        scratch = [torch.empty(rng.randint(1, 200)) for _ in range(5)]
        ops.wait_tensor(gathered)
        ops.wait_tensor(reduced)
        del scratch
        if rank == 0 and step % 10_000 == 0:
            print(f"step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"step {steps} done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250_000)
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_threads is not None:
        worker(args.worker_threads, args.steps)
        return
    print(f"{args.steps:,} steps of an all-gather and an all-reduce in flight together, 2 ranks")
    for threads in args.threads:
        start = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(29500 + threads + random.randint(1, 900)),
             __file__, "--steps", str(args.steps), "--worker-threads", str(threads)],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        lines = (run.stdout + run.stderr).splitlines()
        steps = [line for line in run.stdout.splitlines() if line.startswith("step")]
        crash = [
            line
            for line in lines
            if "malloc()" in line or "SIGSEGV" in line or "SIGABRT" in line or "corrupted" in line
        ]
        outcome = "finished" if run.returncode == 0 else f"failed (exit {run.returncode})"
        print(
            f"threads={threads}: {outcome} in {time.perf_counter() - start:.0f} s; "
            f"last: {steps[-1] if steps else 'none'}" + (f"; {crash[0].strip()}" if crash else "")
        )


if __name__ == "__main__":
    main()
