"""One GPT training step (forward, backward, SGD update): functional_fsdp vs torch FSDP2.

Both run in the same processes on the same model, batch and mesh, alternating step by step
so machine noise hits them alike. Prints the median step time and the ratio, the bytes each
rank communicates per step, and the peak process memory.

    torchrun --nproc-per-node 2 benchmarks/step_vs_fsdp2.py [--steps 20] [--layers 4] [--width 256]
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    ff.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width
    )
    model = GPT(cfg)
    mesh = ff.make_mesh({"dp": world})
    lr = 1e-3

    # functional_fsdp: a pure step over Sharded params.
    sharded_model = ff.fsdp(model, mesh)
    params = sharded_model.shard()

    def ours_step(params, x, y):
        grads, loss = torch.func.grad_and_value(lambda p: lm_loss(sharded_model.apply(p, x), y))(
            params
        )
        new = {k: v.replace(v.local - lr * grads[k].local) for k, v in params.items()}
        return new, loss

    # torch FSDP2 on a copy of the same model.
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)

    def fsdp2_step(x, y):
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"functional_fsdp": [], "torch FSDP2": []}
    for step in range(args.steps + 2):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        for name in times:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "functional_fsdp":
                with ff.count_comms() as comms:
                    params, _loss = ours_step(params, x, y)
            else:
                fsdp2_step(x, y)
            dist.barrier()
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)

    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"GPT {args.layers} layers, width {args.width}, {psi / 2**20:.1f} MiB of fp32 params, "
            f"{world} ranks (gloo), batch {args.batch}x{args.seq} per rank, {args.steps} steps"
        )
        print(f"{'system':<18}{'median step ms':>16}")
        for k, v in med.items():
            print(f"{k:<18}{v:>16.1f}")
        print(
            f"step-time ratio functional_fsdp / FSDP2: {med['functional_fsdp'] / med['torch FSDP2']:.3f}"
        )
        print("functional_fsdp bytes per rank per step:")
        print(comms.summary())
        print(
            f"expected all-gather 2Ψ(N-1)/N = {2 * psi * (world - 1) // world:,}, "
            f"reduce-scatter Ψ(N-1)/N = {psi * (world - 1) // world:,}"
        )
        print(f"peak RSS of rank 0 (both systems in one process): {peak_mb:.0f} MiB")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
