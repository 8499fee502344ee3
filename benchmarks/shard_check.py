"""What shard()'s default check costs: ``ff.shard`` of a GPT's parameters with and without it.

``ff.shard`` compares a checksum of the whole tree between the ranks before it splits the
values (one small all-gather per mesh axis, for the whole tree). This measures
``ff.shard(params, mesh, sharded_model.param_specs())`` with ``check=True`` (the default) and
``check=False``, interleaved, on real processes, and prints the median and best times and the
extra collectives. Run it under torchrun:

    torchrun --nproc-per-node 2 benchmarks/shard_check.py [--layers 12] [--width 768]
             [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.distributed import agreement
from functional_fsdp.models import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()

    device = ff.init_distributed()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    model = GPT(cfg).to(device)
    build_s = time.perf_counter() - start
    sm = ff.fsdp(model, mesh)
    params = {n: t.detach() for n, t in model.named_parameters()}
    specs = sm.param_specs()
    exchanges = []
    original = agreement._all_gather

    def counted(*a, **k):  # the check's collectives (count_comms does not record them)
        exchanges.append(a[2])
        return original(*a, **k)

    agreement._all_gather = counted
    digest_s = [0.0]
    original_digest = agreement.tree_digest

    def timed(*a, **k):  # the checksums' share of the check
        start = time.perf_counter()
        out = original_digest(*a, **k)
        digest_s[0] += time.perf_counter() - start
        return out

    agreement.tree_digest = timed
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for check in (False, True):
            dist.barrier()
            start = time.perf_counter()
            ff.shard(params, mesh, specs, check=check)
            times[check].append(time.perf_counter() - start)
    agreement._all_gather, agreement.tree_digest = original, original_digest
    if dist.get_rank() == 0:
        n = sum(t.numel() for t in params.values())
        print(
            f"GPT {args.layers} layers, width {args.width}: {n / 1e6:.1f}M parameters in "
            f"{len(params)} tensors ({4 * n / 2**20:.0f} MiB fp32), {dist.get_world_size()} "
            f"ranks ({mesh.device_type}), {args.repeats} interleaved repeats"
        )
        print("| shard() | median ms | best ms |\n|---|---|---|")
        for check in (False, True):
            ms = [1e3 * t for t in times[check]]
            print(f"| check={check} | {statistics.median(ms):.1f} | {min(ms):.1f} |")
        print(f"of which the checksums: {1e3 * digest_s[0] / args.repeats:.1f} ms per call")
        print(f"for scale: building the model took {1e3 * build_s:.0f} ms on rank 0")
        per_call = len(exchanges) // args.repeats
        print(f"the check's all-gathers per shard() call: {per_call} (over axes {exchanges[:1]})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
