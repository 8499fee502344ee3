"""Train a character-level GPT with functional_fsdp on Python's own documentation.

The text is ``pydoc_data.topics``, the help topics that ship with every Python install, so
nothing is downloaded. Every rank builds the same model and the same global batches; the
step keeps each rank's share, so the loss is the global-batch mean.

    torchrun --nproc-per-node 2 examples/train_gpt.py                     # FSDP (ZeRO-3)
    torchrun --nproc-per-node 2 examples/train_gpt.py --strategy zero2    # or ddp, zero1, shard_grad_op
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh replicate=2,shard=2
    torchrun --nproc-per-node 2 examples/train_gpt.py --mixed-precision bf16
    torchrun --nproc-per-node 2 examples/train_gpt.py --compile              # ff.jit: one graph

Checkpoints and resume: with ``--checkpoint-dir`` the run saves every ``--save-every`` steps
(atomically, on a background thread; the data generator's state is saved too), and with
``--resume`` it continues from the latest complete checkpoint, bitwise as if uninterrupted.
On SIGTERM (a scheduler's preemption notice) to any rank, every rank saves at the same step
and the job exits 0 for the scheduler to requeue (docs/guides/preemption.md).
Under torchrun's restarts a crashed rank costs at most the steps since the last checkpoint
(the variable gives each restart a fresh rendezvous store; see pytorch/pytorch#135712):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \
        --rdzv-backend c10d --rdzv-endpoint localhost:29400 examples/train_gpt.py \
        --checkpoint-dir ckpt/gpt --save-every 100 --resume
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from chardata import add_device_arg, load_text, parse_mesh, random_batch
from tqdm import tqdm

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig

# zero1/zero2 are the ZeRO paper's (params replicated, optimizer state sharded, DDP's traffic);
# shard_grad_op is FSDP's (params sharded, gathered once in forward and kept for backward).
STRATEGIES = ("fsdp", "shard_grad_op", "zero2", "zero1", "ddp")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp")
    p.add_argument(
        "--mesh", default=None, help="axes, e.g. dp=2 or replicate=2,shard=2 (default: dp=world)"
    )
    p.add_argument("--mixed-precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument(
        "--compile",
        action="store_true",
        help="ff.jit: trace the whole step once into one graph and compile it (inductor)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-chars", type=int, default=300)
    add_device_arg(p)
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (step_<n>)")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = ff.init_distributed(device_type=args.device)  # cuda:LOCAL_RANK, or the CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    data, chars = load_text()

    torch.manual_seed(args.seed)  # the same initial model on every rank
    cfg = GPTConfig(
        vocab_size=len(chars),
        block_size=args.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    model = GPT(cfg).to(device)
    mesh = ff.make_mesh(parse_mesh(args.mesh, default={"dp": world}), device_type=device.type)
    bf16 = args.mixed_precision == "bf16"
    policy = ff.Policy(
        reshard_after_forward=args.strategy != "shard_grad_op",
        mixed_precision=ff.MixedPrecision(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        ),
    )
    replicated = args.strategy in ("ddp", "zero1", "zero2")
    sharded_model = ff.fsdp(model, mesh, policy=policy, specs=ff.P() if replicated else None)
    zero = args.strategy in ("zero1", "zero2")
    opt_specs = ff.P(sharded_model.data_axes[-1]) if zero else None

    schedule = ff.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10
    )
    no_decay = lambda path, p: p.ndim >= 2  # noqa: E731  (decay matrices, not biases and norms)
    optimizer = ff.chain(
        ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(schedule, weight_decay=0.1, mask=no_decay)
    )
    if bf16 and replicated:  # bf16 replicas; fp32 masters with the (sharded) optimizer state
        optimizer = ff.master_weights(optimizer, param_dtype=torch.bfloat16)

    def loss_fn(params, batch):
        # The GPT sees batch[:, :-1], so its logits are already one shorter: the targets go in
        # shifted (transformers' shift_labels=). A (sum, count): the step divides the global
        # sum by the global count (docs/guides/fine-tuning-sft.md, "The label convention").
        logits = sharded_model.apply(params, batch[:, :-1])
        return ff.causal_lm_loss(logits, shift_labels=batch[:, 1:])

    step = ff.train_step(
        loss_fn,
        optimizer,
        model=sharded_model,
        accumulate=args.accumulate,
        accumulate_mode="local" if args.strategy == "zero1" else "reduce_each",
        learning_rate=schedule,
    )
    if args.compile:  # forward, backward, collectives and AdamW: one compiled graph
        step = ff.jit(step)
    state = ff.TrainState.create(sharded_model.shard(), optimizer, opt_specs=opt_specs)

    gen = torch.Generator().manual_seed(args.seed + 1)  # the same global batches on every rank
    manager = None
    if args.checkpoint_dir:
        manager = ff.checkpoint.CheckpointManager(
            args.checkpoint_dir, save_every=args.save_every, async_save=True
        )
    if args.resume and manager is not None and manager.latest_step() is not None:
        # The data order is part of the state: the generator continues where it stopped.
        ckpt = manager.restore({"state": state, "data": {"rng": gen.get_state()}})
        state = ckpt["state"]
        gen.set_state(ckpt["data"]["rng"])
        if rank == 0:
            print(f"resumed from step {state.step} of {args.checkpoint_dir}")
    first = int(state.step)  # a tensor once a compiled step has run
    tokens_per_step = args.batch_size * args.block_size
    losses = []
    bar = tqdm(
        range(first, args.steps),
        disable=rank != 0,
        desc=f"{args.strategy} on {ff.axis_sizes(mesh)}",
    )
    start = time.perf_counter()
    for i in bar:
        batch = random_batch(data, args.batch_size, args.block_size, gen, device)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if manager is not None:
            tree = {"state": state, "data": {"rng": gen.get_state()}}
            if manager.reached_preemption(int(state.step)):  # SIGTERM on any rank
                manager.save(int(state.step), tree, force=True)
                manager.close()  # waits for the save
                if rank == 0:
                    print(f"preempted: saved step {int(state.step)}; rerun with --resume")
                dist.barrier()
                dist.destroy_process_group()
                raise SystemExit(0)  # a clean exit: the scheduler requeues the job
            manager.save(state.step, tree)
        tok_s = tokens_per_step * (i + 1 - first) / (time.perf_counter() - start)
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}",
            tok_s=f"{tok_s:,.0f}",
            grad_norm=f"{float(metrics['grad_norm']):.2f}",
        )

    if manager is not None:
        manager.close()  # waits for the last background save
    full = ff.gather(state.params)  # every rank gets the full parameters
    if rank == 0 and losses:
        print(
            f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f} (mean of last 10: {sum(losses[-10:]) / 10:.3f})"
        )
    if rank == 0:
        print("sample:\n" + sample(model, full, chars, args.sample_chars, args.seed))
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def sample(model: GPT, params: dict[str, torch.Tensor], chars: list[str], n: int, seed: int) -> str:
    """Greedy-free sampling (temperature 0.8) from the trained parameters, on one rank."""
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.full((1, 1), chars.index("\n"), device=device)
    for _ in range(n):
        logits = torch.func.functional_call(model, params, (idx[:, -model.cfg.block_size :],))[
            0, -1
        ]
        probs = torch.softmax(logits / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)[None]], dim=1)
    return "".join(chars[i] for i in idx[0].tolist())


if __name__ == "__main__":
    main()
