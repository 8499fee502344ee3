"""Train a transformers Llama on long packed sequences, each sequence split over a ``cp`` axis.

Context parallelism: on ``--mesh dp=2,cp=2`` the batch is split over ``dp`` and every
sequence over ``cp`` (each rank holds two chunks of it, one early and one late, so that
causal attention costs every rank the same); the attention all-gathers keys and values over
``cp``, so the loss and gradients are those of one process on the whole sequences. The
documents are Python's help topics (``pydoc_data``, shipped with Python), character-level and
packed: ``position_ids`` restart at each document, which attention never crosses.

    torchrun --nproc-per-node 4 examples/train_long_context.py                    # dp=2, cp=2
    torchrun --nproc-per-node 4 examples/train_long_context.py --mesh cp=4 --seq-len 4096
    torchrun --nproc-per-node 4 examples/train_long_context.py --mesh cp=2,tp=2   # cp x tp

The first step's loss is compared with one process's on the same global batch (printed).
"""

from __future__ import annotations

import argparse
import pydoc_data.topics

import torch
import torch.distributed as dist
from chardata import parse_mesh
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import functional_fsdp as ff


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="dp=2,cp=2", help="axes, e.g. cp=4 or dp=2,cp=2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def documents() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every help topic as character ids, concatenated; a flag at each document's start; the
    alphabet size."""
    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    chars = sorted(set("".join(docs)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for d in docs for c in d], dtype=torch.long)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0)[:-1].tolist()])] = True
    return ids, starts, len(chars)


def packed_batch(
    ids: torch.Tensor, starts: torch.Tensor, rows: int, length: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """``rows`` windows of packed documents, in Hugging Face's padding-free convention:
    ``position_ids`` restart at each document (and at the window's start), labels are -100 at
    each document's first token; ``shift_labels`` are the labels moved one to the left over
    the whole sequence, before any split (a rank's last token predicts the next rank's first)."""
    at = torch.randint(0, len(ids) - length, (rows,), generator=gen).tolist()
    x = torch.stack([ids[s : s + length] for s in at])
    first = torch.stack([starts[s : s + length] for s in at])
    first[:, 0] = True
    index = torch.arange(length).expand(rows, length)
    last_start = torch.where(first, index, 0).cummax(dim=1).values
    labels = x.masked_fill(first, -100)
    return {
        "input_ids": x,
        "position_ids": index - last_start,
        "shift_labels": torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:],
    }


def main() -> None:
    args = parse_args()
    device = ff.init_distributed(device_type="cpu")
    rank = dist.get_rank()
    ids, starts, vocab = documents()
    torch.manual_seed(args.seed)  # the same initial model on every rank
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        use_cache=False,
        attn_implementation=ff.cp.register_attention(),  # exact over a split sequence
    )
    model = LlamaForCausalLM(config).to(device)
    mesh = ff.make_mesh(parse_mesh(args.mesh, {"dp": 2, "cp": 2}), device_type=device.type)
    policy = ff.Policy(activation_checkpointing=args.checkpointing)
    tp_mesh = None
    if "tp" in ff.axis_sizes(mesh):
        tp = ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model))
        sharded = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers, policy=policy)
        tp_mesh = mesh  # the head's logits are this rank's block of the vocabulary
    else:
        sharded = ff.fsdp(model, mesh, policy=policy)

    def loss_fn(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
        logits = sharded.apply(params, **inputs).logits
        return ff.causal_lm_loss(logits, shift_labels=batch["shift_labels"], mesh=tp_mesh)

    optimizer = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(args.lr))
    step = ff.train_step(loss_fn, optimizer, model=sharded)
    state = ff.TrainState.create(sharded.shard(), optimizer, trainable=sharded)

    gen = torch.Generator().manual_seed(args.seed + 1)  # the same global batches on every rank
    first_batch = packed_batch(ids, starts, args.batch_size, args.seq_len, gen)
    with torch.no_grad():  # one process on the whole global batch, for the comparison below
        inputs = {k: v for k, v in first_batch.items() if k != "shift_labels"}
        one = ff.causal_lm_loss(model(**inputs).logits, shift_labels=first_batch["shift_labels"])
        one_process = float(one.sum / one.count)
    cp = ff.axis_size(mesh, sharded.sequence_axis) if sharded.sequence_axis else 1
    if rank == 0:
        print(
            f"mesh {ff.axis_sizes(mesh)}: {args.batch_size} sequences of {args.seq_len} tokens; "
            f"each rank holds {args.seq_len // cp} tokens of a sequence"
        )
    losses = []
    batch = first_batch
    for _ in tqdm(range(args.steps), disable=rank != 0, desc="context parallel"):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        batch = packed_batch(ids, starts, args.batch_size, args.seq_len, gen)
    if rank == 0:
        print(f"step 1 loss {losses[0]:.6f}, one process on the same batch {one_process:.6f}")
        print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
