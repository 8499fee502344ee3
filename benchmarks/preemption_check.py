"""What ``CheckpointManager.reached_preemption`` costs a step: the call's own time, k=1 and k=10.

Every ``preemption_check_every`` steps the call reads the previous asynchronous all-reduce
(finished by then) and starts the next; other steps only compare integers. Prints the median
and 90th percentile of the call's time and the median step with and without the calls.

    torchrun --nproc-per-node 2 benchmarks/preemption_check.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss


def main() -> None:
    ff.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64)
    f = ff.fsdp(GPT(cfg), ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(1e-3)
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    batch = torch.randint(0, 128, (8, 65), generator=torch.Generator().manual_seed(1))
    rows = []
    for every in (None, 1, 10):
        state = ff.TrainState.create(f.shard(), opt)
        mgr = None
        if every is not None:
            mgr = ff.checkpoint.CheckpointManager(
                tempfile.mkdtemp(), save_every=10**9, preemption_check_every=every
            )
        steps, calls = [], []
        for i in range(60):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            float(metrics["loss"])
            t1 = time.perf_counter()
            if mgr is not None:
                assert not mgr.reached_preemption(i + 1)
                calls.append(time.perf_counter() - t1)
            steps.append(time.perf_counter() - t0)
        if mgr is not None:
            mgr.close()
        steps, calls = steps[10:], calls[10:]
        rows.append((every, statistics.median(steps), calls))
    if dist.get_rank() == 0:
        print("| preemption_check_every | step (ms) | call median (us) | call p90 (us) |")
        print("|---|---|---|---|")
        for every, s, calls in rows:
            if calls:
                q = statistics.quantiles(calls, n=10)[-1]
                med = statistics.median(calls)
                print(f"| {every} | {s * 1e3:.1f} | {med * 1e6:.0f} | {q * 1e6:.0f} |")
            else:
                print(f"| (no calls) | {s * 1e3:.1f} | - | - |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
