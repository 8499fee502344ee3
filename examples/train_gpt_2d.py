"""Train a character-level GPT with 2D parallelism: FSDP over "dp" and tensor parallelism over "tp".

The same data as ``train_gpt.py`` (``pydoc_data.topics``, bundled with Python). The TP plan
(:func:`functional_fsdp.gpt_plan`) splits the attention heads and the MLP over "tp", makes
the token embedding vocab-parallel and the tied head colwise over the vocabulary, and the
loss (:func:`functional_fsdp.causal_lm_loss` with the mesh: vocabulary-parallel cross entropy)
never gathers the vocabulary.
FSDP shards every parameter's TP-local block over "dp" on top. Ranks that differ only in
"tp" train on the same batch.

    torchrun --nproc-per-node 4 examples/train_gpt_2d.py                        # dp=2, tp=2
    torchrun --nproc-per-node 4 examples/train_gpt_2d.py --sequence-parallel
    torchrun --nproc-per-node 4 examples/train_gpt_2d.py --mesh dp=1,tp=4       # TP alone
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from chardata import add_device_arg, load_text, parse_mesh, random_batch
from tqdm import tqdm

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan
from functional_fsdp.tp.plan import tensor_parallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default=None, help="axes, e.g. dp=2,tp=2 (default: tp=2, dp=rest)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    add_device_arg(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = ff.init_distributed(device_type=args.device)  # cuda:LOCAL_RANK, or the CPU
    rank = dist.get_rank()
    data, chars = load_text()
    world = dist.get_world_size()
    tp = 2 if world % 2 == 0 else 1
    axes = parse_mesh(args.mesh, default={"dp": world // tp, "tp": tp})
    mesh = ff.make_mesh(axes, device_type=device.type)
    tp_size = ff.axis_size(mesh, "tp")

    torch.manual_seed(args.seed)  # the same initial model on every rank
    vocab = -(-len(chars) // tp_size) * tp_size  # pad the vocabulary to a multiple of tp
    cfg = GPTConfig(
        vocab_size=vocab,
        block_size=args.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    model = GPT(cfg).to(device)

    # The recipe: TP plan -> specs and forward wrappers -> FSDP over the data axes on top.
    tp = tensor_parallel(model, mesh, gpt_plan(cfg, sequence_parallel=args.sequence_parallel))
    sharded_model = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    params = sharded_model.shard()
    if rank == 0:
        print(f"{'parameter':<26}{'shape':<12}{'TP spec':<18}{'at rest (FSDP+TP)':<24}local")
        for name in (
            "tok_emb.weight",
            "blocks.0.attn.wq.weight",
            "blocks.0.attn.wq.bias",
            "blocks.0.attn.wo.weight",
            "blocks.0.attn.wo.bias",
            "blocks.0.ln1.weight",
        ):
            v = params[name]
            print(
                f"{name:<26}{v.global_shape!s:<12}{tp.tp_specs[name]!s:<18}"
                f"{v.spec!s:<24}{tuple(v.local.shape)}"
            )

    schedule = ff.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10
    )
    no_decay = lambda path, p: p.ndim >= 2  # noqa: E731  (decay matrices, not biases and norms)
    optimizer = ff.chain(
        ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(schedule, weight_decay=0.1, mask=no_decay)
    )

    def loss_fn(params, batch):
        logits = sharded_model.apply(params, batch[:, :-1])  # split over the vocabulary
        # (sum, count): the step divides the global sum by the global count
        return ff.causal_lm_loss(logits, shift_labels=batch[:, 1:], mesh=mesh)

    step = ff.train_step(loss_fn, optimizer, model=sharded_model, learning_rate=schedule)
    state = ff.TrainState.create(params, optimizer)

    gen = torch.Generator().manual_seed(args.seed + 1)  # the same global batches on every rank
    losses = []
    desc = f"{'FSDP+TP+SP' if args.sequence_parallel else 'FSDP+TP'} on {ff.axis_sizes(mesh)}"
    bar = tqdm(range(args.steps), disable=rank != 0, desc=desc)
    start = time.perf_counter()
    for i in bar:
        batch = random_batch(data, args.batch_size, args.block_size, gen, device)
        if i == args.steps - 1:
            with ff.count_comms() as comms:
                state, metrics = step(state, batch)
        else:
            state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", grad_norm=f"{float(metrics['grad_norm']):.2f}")
    elapsed = time.perf_counter() - start

    if rank == 0:
        print(
            f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f} "
            f"(mean of last 10: {sum(losses[-10:]) / 10:.3f}), {elapsed / args.steps * 1e3:.0f} "
            f"ms/step"
        )
        print("collectives of one step, per rank:")
        print(comms.summary())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
