"""Supervised fine-tuning (SFT) with LoRA, fully sharded, as TRL's ``SFTTrainer`` does it:
chat data with every assistant turn trained, truncated, padded or packed, the token mean of
the global batch as the loss, a resumable sharded loader.

1. Data: a JSON-lines file (``--data``; without it a small chat set is written) read and
   mapped by ``datasets``: chat ``messages``, prompt-completion pairs, or a TRL-prepared
   dataset (``input_ids`` with ``labels``, ``assistant_masks`` or ``completion_mask``), taken
   as it is: its vocabulary is ``--tokenizer``'s (the tokenizer that prepared it) or, without
   one, read from the data (the largest token id + 1 is the padding id).
   Conversations are formatted with the tokenizer's chat template and every assistant turn is
   labelled (TRL's ``assistant_only_loss=True``; ``--turns last``: the last one only). Labels
   are aligned with ``input_ids``, ``-100`` where not trained (Hugging Face's convention).
   ``--max-length`` is TRL's ``max_length``: examples are cut to it and those left with
   nothing to train are dropped. Each data rank reads its own share of every epoch
   (torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``).
2. Batches: ``--batching pad`` pads each rank's batch to its longest sequence;
   ``--batching pack`` packs it into rows of ``--max-length`` tokens, best fit decreasing
   (TRL's default ``packing_strategy="bfd"``; ``--packing-strategy in_order``), with
   per-document ``position_ids`` and a block-diagonal causal mask (``--padding-free``: the
   ``position_ids`` alone, which sdpa and eager attention honour with ``use_cache=False``);
   ``--batching flatten`` concatenates each micro-batch's examples into one row with
   transformers' ``DataCollatorWithFlattening`` (TRL's ``padding_free`` without packing).
3. The loss: ``ff.causal_lm_loss`` returns ``(sum of the trained tokens' cross entropy,
   their count)``, so the step's loss and gradient are the global sum over the global count:
   the token mean of the global batch, as one process computes it and as TRL's and Hugging
   Face's Trainer do by default. Padding and packing give the same loss.
4. Checkpoints hold the train state and the loader's position, so ``--resume`` reads exactly
   the batches the uninterrupted run would and ends on its loss, bit for bit.
5. ``--quantize nf4``: the QLoRA recipe of ``examples/finetune_lora.py`` on the same data.

Nothing is downloaded: a tokenizer is trained on the data (with a chat template; or
``--tokenizer`` names a saved one) and a small Llama built from a config, its vocabulary the
tokenizer's, stands in for a pretrained checkpoint.

    torchrun --nproc-per-node 2 examples/finetune_sft.py
    torchrun --nproc-per-node 2 examples/finetune_sft.py --batching pack --resume
    torchrun --nproc-per-node 2 examples/finetune_sft.py --quantize nf4
    torchrun --nproc-per-node 2 examples/finetune_sft.py --data trl_rows.jsonl --tokenizer tok/
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from typing import Any

import sft_data
import torch
import torch.distributed as dist
from chardata import add_device_arg
from finetune_lora import bnb_config, lora_init, tiny_llama
from tqdm import tqdm

import functional_fsdp as ff


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arg(p)
    p.add_argument("--data", default=None, help="a local .jsonl of {'messages': [...]}, ...")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer saved with save_pretrained (the one that prepared a tokenized --data); "
        "default: one trained on chat data, or, for tokenized data, none (vocabulary from the data)",
    )
    p.add_argument("--examples", type=int, default=256, help="examples written without --data")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="examples per rank and step")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--batching", choices=("pad", "pack", "flatten"), default="pad")
    p.add_argument("--packing-strategy", choices=("bfd", "in_order"), default="bfd")
    p.add_argument("--padding-free", action="store_true", help="packed rows without the mask")
    p.add_argument("--max-length", type=int, default=64, help="tokens kept; the packed row")
    p.add_argument("--turns", choices=("all", "last"), default="all", help="assistant turns")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--quantize", choices=("none", "nf4", "fp4"), default="none")
    p.add_argument("--checkpoint-dir", default="checkpoints/finetune_sft")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def prepare(args: argparse.Namespace, rank: int) -> tuple[str, str, str | None]:
    """The data file, a folder holding the tiny Llama, and the tokenizer's folder: ``--tokenizer``,
    else one trained on chat data (in the model's folder), else None for tokenized (TRL-prepared)
    data, whose vocabulary is then read from the data: its largest token id + 1, that last id
    being the padding. The model's vocabulary is the tokenizer's, rounded up to a multiple of 8.
    Rank 0 writes; call :func:`torch.distributed.barrier` before the other ranks read."""
    from transformers import AutoTokenizer

    data = args.data
    name = f"ff-sft-chat-{args.examples}-{args.seed}"
    if data is not None:  # a model (and a tokenizer) for this file
        stat = os.stat(data)
        name = f"ff-sft-data-{stat.st_size}-{int(stat.st_mtime)}"
    if args.tokenizer is not None:
        name += "-" + hashlib.sha1(os.path.abspath(args.tokenizer).encode()).hexdigest()[:8]
    folder = os.path.join(tempfile.gettempdir(), name)
    if data is None:
        data = os.path.join(folder, "instructions.jsonl")
    tokenized = args.data is not None and sft_data.is_tokenized(sft_data.load(data))
    tokenizer = args.tokenizer
    if tokenizer is None and not tokenized:
        tokenizer = folder
    if args.tokenizer is not None and tokenized:
        size = len(AutoTokenizer.from_pretrained(tokenizer))
        largest = sft_data.largest_token_id(sft_data.load(data))
        if largest >= size:
            raise ValueError(
                f"--data {data} holds token id {largest}, but --tokenizer {tokenizer} has "
                f"{size} tokens: pass the tokenizer that prepared the data, or none (the "
                f"vocabulary is then read from the data)."
            )
    if rank == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        os.makedirs(folder, exist_ok=True)
        if args.data is None:
            sft_data.write_instructions(data, args.examples, args.seed)
        if tokenizer == folder:  # chat data and no tokenizer given: one trained on it
            sft_data.chat_tokenizer(sft_data.conversations_of(sft_data.load(data)), folder)
        if tokenizer is not None:
            vocab = len(AutoTokenizer.from_pretrained(tokenizer))
        else:  # the ids the data uses, and one more for padding
            vocab = sft_data.largest_token_id(sft_data.load(data)) + 2
        tiny_llama(folder, vocab_size=-(-vocab // 8) * 8)
    return data, folder, tokenizer


def pad_id_of(tokenizer: Any, data: Any) -> int:
    """The padding id: the tokenizer's (its end-of-sequence token where it has no padding
    token, as TRL does), or, without a tokenizer, the id after the data's largest."""
    if tokenizer is None:
        return sft_data.largest_token_id(data) + 1
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id


def main() -> None:
    args = parse_args()
    device = ff.init_distributed(device_type=args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # 1. Data: read and mapped by datasets (cached), every assistant turn labelled, cut to
    # --max-length, this rank's share, padded or packed.
    data, path, tokenizer_path = prepare(args, rank)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    packing = args.batching == "pack"
    raw = sft_data.load(data)
    examples = sft_data.prepare(raw, tokenizer, args.max_length, turns=args.turns, packing=packing)
    pad_id = pad_id_of(tokenizer, raw)
    if rank == 0:
        print(f"vocabulary {tokenizer_path or 'read from the data'}: padding id {pad_id}")
    if packing:
        options = dict(strategy=args.packing_strategy, mask=not args.padding_free)
        collate = lambda b: sft_data.pack(b, args.max_length, pad_id, args.accumulate, **options)  # noqa: E731
    elif args.batching == "flatten":  # one row per micro-batch, DataCollatorWithFlattening's
        mask = not args.padding_free
        collate = lambda b: sft_data.flatten(b, pad_id, args.accumulate, mask=mask)  # noqa: E731
    else:
        collate = lambda b: sft_data.pad(b, pad_id, args.accumulate)  # noqa: E731
    batches = sft_data.Batches(examples, args.batch_size, collate, rank, world, args.seed)

    # 2. The model on meta, LoRA adapters (QLoRA with --quantize), sharded over the ranks.
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    quantized = args.quantize != "none"
    if quantized:
        from peft import prepare_model_for_kbit_training
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        base = replace_with_bnb_linear(
            base, modules_to_not_convert=["lm_head"], quantization_config=bnb_config(args)
        )
        base.gradient_checkpointing_enable()
        base = prepare_model_for_kbit_training(base)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
    model = get_peft_model(base, lora)
    mesh = ff.make_mesh({"dp": world}, device_type=device.type)
    sm = ff.fsdp(model, mesh, policy=ff.Policy(activation_checkpointing=not quantized))
    torch.manual_seed(args.seed)
    params, buffers = ff.init_sharded(sm, init_fn=lora_init)
    to_file = lambda name: name.removeprefix("base_model.model.").replace(".base_layer", "")  # noqa: E731
    frozen = set(params) - sm.trainable
    params.update(ff.checkpoint.load_safetensors(sm, path, rename=to_file, names=frozen))
    optimizer = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(args.lr, weight_decay=0.0))

    # 3. The token mean of the global batch: (sum, count), divided by the step. The labels
    # are aligned with input_ids; causal_lm_loss shifts them, as transformers' loss does.
    def loss_fn(p: dict, batch: dict[str, torch.Tensor]) -> Any:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = sm.apply(p, **inputs, buffers=buffers).logits
        return ff.causal_lm_loss(logits, batch["labels"])

    step = ff.train_step(loss_fn, optimizer, model=sm, batch="local", accumulate=args.accumulate)
    state = ff.TrainState.create(params, optimizer, trainable=sm)

    # 4. Checkpoints of the state and the loader's position.
    manager = ff.checkpoint.CheckpointManager(args.checkpoint_dir, save_every=args.save_every)
    if args.resume and manager.latest_step() is not None:
        saved = manager.restore({"state": state, "data": batches.position()})
        state = saved["state"]
        batches.restore(saved["data"])
        if rank == 0:
            print(f"resumed at step {state.step} from {args.checkpoint_dir}")
    first, losses = state.step, []
    real = slots = tokens = 0
    start = time.perf_counter()
    bar = tqdm(range(state.step, args.steps), disable=rank != 0, desc="sft", unit="step")
    for _ in bar:
        batch = next(batches)
        ids = batch["input_ids"]
        real += int((ids != pad_id).sum())  # this rank's tokens that are not padding
        slots += ids.numel()
        state, metrics = step(state, {k: v.to(device) for k, v in batch.items()})
        losses.append(metrics["loss"].item())
        tokens += int(metrics["count"])  # counted (answer) tokens of the global batch
        seconds = time.perf_counter() - start
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}",
            tok_s=f"{tokens / seconds:.0f}",
            padding=f"{1 - real / slots:.0%}",
        )
        manager.save(state.step, {"state": state, "data": batches.position()})
    manager.save(state.step, {"state": state, "data": batches.position()}, force=True)
    manager.close()
    if rank == 0 and losses:
        print(
            f"steps {first}..{state.step}: loss {losses[0]!r} -> {losses[-1]!r}; "
            f"{tokens} answer tokens, {tokens / (time.perf_counter() - start):.0f} tokens/s, "
            f"padding {1 - real / slots:.1%} of rank 0's slots ({args.batching})"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
