"""What a ``(sum, count)`` loss costs over a scalar loss: one train_step of a small Llama on
2 gloo ranks, each way, timed (median of ``--steps``) with the collectives it issues.

    torchrun --nproc-per-node 2 benchmarks/token_mean.py

The count rides in the all-reduce that averages the loss in every step, so the collectives
are the same; the extra work is a 2-element instead of 1-element all-reduce and one
multiplication of the local gradient shards by ``micro-batches x data ranks / count``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_fsdp as ff


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    args = p.parse_args()
    ff.init_distributed(device_type="cpu")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh)
    ids = torch.randint(0, 256, (8, 64))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.4, -100)
    opt = ff.adamw(1e-3)
    steps, states, comms = {}, {}, {}
    for kind in ("scalar", "sum_count"):

        def loss_fn(params, b, kind=kind):
            logits = sm.apply(params, b[0]).logits.flatten(0, 1)
            if kind == "scalar":
                return F.cross_entropy(logits, b[1].flatten())
            total = F.cross_entropy(logits, b[1].flatten(), reduction="sum")
            return total, (b[1] != -100).sum()

        steps[kind] = ff.train_step(loss_fn, opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
        state, _ = steps[kind](state, (ids, labels))  # warm-up
        with ff.count_comms() as counted:
            states[kind], _ = steps[kind](state, (ids, labels))
        comms[kind] = counted.summary()
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(args.steps):  # interleaved, so that load on the machine hits both alike
        for kind, step in steps.items():
            dist.barrier()
            t = time.perf_counter()
            states[kind], metrics = step(states[kind], (ids, labels))
            metrics["loss"].item()
            times[kind].append(time.perf_counter() - t)
    results = {kind: (statistics.median(times[kind]), comms[kind]) for kind in steps}
    if dist.get_rank() == 0:
        for kind, (t, summary) in results.items():
            print(f"{kind}: median step {t * 1e3:.1f} ms\n{summary}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
