"""Shard a small GPT over the ranks, look at the layouts, gather it back, and take one step.

Run on 2 CPU processes:

    torchrun --nproc-per-node 2 examples/shard_gather_demo.py
    torchrun --nproc-per-node 2 examples/shard_gather_demo.py --device cpu   # CPU even with GPUs
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from chardata import add_device_arg
from rich.console import Console
from rich.table import Table

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arg(p)
    args = p.parse_args()
    device = ff.init_distributed(device_type=args.device)  # cuda:LOCAL_RANK, or the CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank builds the same initial model
    model = GPT(GPTConfig(n_layer=2, vocab_size=97, n_embd=48, n_head=4, block_size=32))
    model = model.to(device)
    mesh = ff.make_mesh({"dp": world}, device_type=device.type)
    sharded_model = ff.fsdp(model, mesh)
    params = sharded_model.shard()

    if rank == 0:
        table = Table(title=f"GPT parameters sharded over {ff.axis_sizes(mesh)}")
        for col in ("parameter", "global shape", "spec", "local block", "unit"):
            table.add_column(col)
        units = sharded_model.units
        for name, v in params.items():
            unit = max((u for u in units if name.startswith(u + ".")), key=len, default="<root>")
            table.add_row(
                name, str(v.global_shape), str(v.spec.trimmed()), str(tuple(v.local.shape)), unit
            )
        Console().print(table)

    full = ff.gather(params)
    exact = all(torch.equal(full[n], p.detach()) for n, p in model.named_parameters())

    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 97, (2 * world, 16), generator=g)
    local = idx[rank * 2 : rank * 2 + 2].to(device)
    global_count = idx[:, 1:].numel()  # every target of the global batch counts

    def share(p):
        # (sum, count) of this rank's share, the GPT fed local[:, :-1] (targets shifted). The
        # gradients are averaged over "dp": this share's sum over the global count, times the
        # ranks, has the gradient of the global batch's token mean.
        loss = ff.causal_lm_loss(sharded_model.apply(p, local[:, :-1]), shift_labels=local[:, 1:])
        return loss.sum * world / global_count

    with ff.count_comms() as comms:
        grads, loss = torch.func.grad_and_value(share)(params)
    mean_loss = ff.all_reduce(loss.detach(), mesh, "dp", op="mean")  # the global token mean
    if rank == 0:
        print(f"shard -> gather is exact: {exact}")
        print(
            f"one torch.func.grad step: loss {mean_loss.item():.4f}, grads are {type(grads['tok_emb.weight']).__name__}"
        )
        print(comms.summary())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
