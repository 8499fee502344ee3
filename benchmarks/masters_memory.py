"""Peak memory of one warm bf16 step with ``ff.master_weights`` (CPU memory timeline of
``torch.profiler``; one process, gloo).

``python benchmarks/masters_memory.py {ddp,fsdp} {float32,bfloat16} {1,0} {reduce_each,local}``:
the layout, the policy's ``reduce_dtype``, masters (1) or fp32 parameters (0), and the
accumulation mode. Prints the step's peak above its start, next to the bf16 parameter bytes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss


def main(layout: str, reduce: str, masters: bool, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, vocab_size=1024, n_embd=256, n_head=8, block_size=16))
    psi = sum(p.numel() for p in model.parameters())
    mp = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce))
    specs = ff.P() if layout == "ddp" else None
    f = ff.fsdp(model, ff.make_mesh({"dp": 1}), specs=specs, policy=ff.Policy(mixed_precision=mp))
    opt = ff.sgd(0.1)
    if masters:
        opt = ff.master_weights(opt, param_dtype=torch.bfloat16)
    state = ff.TrainState.create(f.shard(), opt)
    del model

    def loss_fn(p: dict, b: torch.Tensor) -> torch.Tensor:
        return lm_loss(f.apply(p, b[:, :-1]), b[:, 1:])

    step = ff.train_step(loss_fn, opt, model=f, accumulate_mode=mode)
    batch = torch.randint(0, 1024, (2, 9))
    state, _ = step(state, batch)  # warm-up
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        state, _ = step(state, batch)
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    prof.export_memory_timeline(path, device="cpu")
    with open(path) as file:
        _, sizes = json.load(file)
    peak = max(sum(row) for row in sizes) - sum(sizes[0])
    print(
        f"{layout} {mode} reduce={reduce} masters={masters}: peak above the step's start "
        f"{peak / 2**20:.1f} MiB (bf16 parameters {2 * psi / 2**20:.1f} MiB)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4])
