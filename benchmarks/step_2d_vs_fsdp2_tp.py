"""One 2D (FSDP + TP) GPT training step: functional_fsdp vs torch FSDP2 + ``parallelize_module``.

Both run in the same processes on the same model, batch and (dp, tp) mesh, alternating step
by step so machine noise hits them alike. Both use the same TP plan (q, k, v, fc1 colwise;
wo, fc2 rowwise; vocab-parallel embedding; the tied head colwise over the vocabulary with a
loss-parallel cross entropy) and FSDP over "dp" on top, and both take an SGD step. Prints
the median step time, the ratio, and the bytes each rank sends per step on each mesh axis:
ours from ``ff.count_comms()``, torch's from the c10d ops it dispatches, counted the same way
(ring bytes: (n-1)/n of the gathered or reduced buffer, twice that for an all-reduce).

    torchrun --nproc-per-node 4 benchmarks/step_2d_vs_fsdp2_tp.py [--steps 10] [--layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan
from functional_fsdp.tp.ops import vocab_parallel_cross_entropy
from functional_fsdp.tp.plan import tensor_parallel


class TorchComms(TorchDispatchMode):
    """Count the bytes of the c10d collectives torch dispatches, per (kind, mesh axis)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.axis_of = {mesh.get_group(a).group_name: a for a in mesh.mesh_dim_names}
        self.size_of = {a: ff.axis_size(mesh, a) for a in mesh.mesh_dim_names}
        self.totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def _add(self, kind: str, group: Any, nbytes: int) -> None:
        if not isinstance(group, str):  # a boxed ProcessGroup in the c10d ops
            group = dist.ProcessGroup.unbox(group).group_name
        name = group
        axis = self.axis_of.get(name, "?")
        n = self.size_of.get(axis, 1)
        factor = 2 if kind == "all_reduce" else 1
        self.totals[(kind, axis)][0] += 1
        self.totals[(kind, axis)][1] += factor * nbytes * (n - 1) // n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        if name.startswith("c10d._allgather_base_"):
            self._add("all_gather", args[2], nb(args[0]))
        elif name.startswith("c10d._reduce_scatter_base_"):
            self._add("reduce_scatter", args[2], nb(args[1]))
        elif name.startswith("c10d.allreduce_"):
            self._add("all_reduce", args[1], sum(nb(t) for t in args[0]))
        elif name.startswith("_c10d_functional.all_reduce"):
            self._add("all_reduce", args[2], nb(args[0]))
        elif name.startswith("_c10d_functional.all_gather_into_tensor"):
            self._add("all_gather", args[2], nb(args[0]) * args[1])
        elif name.startswith("_c10d_functional.reduce_scatter_tensor"):
            self._add("reduce_scatter", args[3], nb(args[0]))
        return func(*args, **(kwargs or {}))


def torch_fsdp2_tp(model: GPT, mesh: Any) -> GPT:
    """torch's version of the same recipe: ``parallelize_module`` on "tp", ``fully_shard`` on "dp"."""
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref = copy.deepcopy(model)
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(ref.blocks)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.fc2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    parallelize_module(ref, mesh["tp"], plan)
    ref.head.weight = ref.tok_emb.weight  # parallelize_module unties them
    for block in ref.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(ref, mesh=mesh["dp"])
    return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    import logging

    # torch logs a warning per strided-shard redistribute (FSDP2 + TP full_tensor); quiet it.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    ff.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ff.make_mesh({"dp": world // args.tp, "tp": args.tp})
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width
    )
    model = GPT(cfg)
    lr = 1e-3

    # functional_fsdp: TP plan -> specs and wrappers -> FSDP over dp; a pure SGD step.
    tp = tensor_parallel(model, mesh, gpt_plan(cfg))
    sharded_model = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    params = sharded_model.shard()

    def loss_fn(params, x, y):
        return vocab_parallel_cross_entropy(sharded_model.apply(params, x), y, mesh)

    def ours_step(params, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        return {k: v.replace(v.local - lr * grads[k].local) for k, v in params.items()}, loss

    ref = torch_fsdp2_tp(model, mesh)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)

    def torch_step(x, y):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            logits = ref(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # tp ranks share a batch
    times: dict[str, list[float]] = {"functional_fsdp": [], "torch FSDP2+TP": []}
    for step in range(args.steps + 2):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        for name in times:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "functional_fsdp":
                with ff.count_comms() as ours:
                    params, _ = ours_step(params, x, y)
            else:
                with TorchComms(mesh) as theirs:
                    torch_step(x, y)
            dist.barrier()
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)

    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"GPT {args.layers} layers, width {args.width}, {psi / 2**20:.2f} MiB of fp32 params, "
            f"mesh {ff.axis_sizes(mesh)} (gloo), batch {args.batch}x{args.seq} per dp rank, "
            f"{args.steps} steps"
        )
        print(f"{'system':<18}{'median step ms':>16}")
        for k, v in med.items():
            print(f"{k:<18}{v:>16.1f}")
        ratio = med["functional_fsdp"] / med["torch FSDP2+TP"]
        print(f"step-time ratio functional_fsdp / torch FSDP2+TP: {ratio:.3f}")
        mine = ours.by_kind_and_axis()
        keys = sorted(set(mine) | set(theirs.totals))
        print("bytes sent per rank per step (count):")
        print(f"{'kind':<16}{'axis':<6}{'functional_fsdp':>22}{'torch FSDP2+TP':>22}")
        for kind, axis in keys:
            a, b = mine.get((kind, axis), (0, 0)), theirs.totals.get((kind, axis), (0, 0))
            print(f"{kind:<16}{axis:<6}{f'{a[1]:,} ({a[0]})':>22}{f'{b[1]:,} ({b[0]})':>22}")
        tp_size = args.tp
        dp_size = world // tp_size
        print(
            f"reference: FSDP over dp moves the TP-local params, about 2Ψ/tp·(N-1)/N = "
            f"{2 * psi // tp_size * (dp_size - 1) // dp_size:,} all-gather and "
            f"Ψ/tp·(N-1)/N = {psi // tp_size * (dp_size - 1) // dp_size:,} reduce-scatter "
            f"(replicated norms and biases are not split by tp, so slightly more)"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
