"""Direct preference optimisation (DPO), fully sharded, as TRL's ``DPOTrainer`` does it: a
policy and a frozen reference on the same mesh, TRL's sigmoid loss, a resumable loader.

1. Data: a JSON-lines file of preference pairs in TRL's conversational format
   (``{"prompt": [...], "chosen": [...], "rejected": [...]}``; ``--data``, or a small set is
   written), read by ``datasets`` and tokenized as ``DPOTrainer`` tokenizes it; each data rank
   reads its own share of every epoch (a stateful, sharded loader).
2. The models: with LoRA (the default) the policy is the base with adapters and the reference
   is the same base with the adapters disabled (``model.disable_adapter()``), as TRL does
   it: no second copy. With ``--full`` every weight is trained and the reference is a second
   copy of the checkpoint, frozen and sharded on the same mesh: gathered one unit at a time in
   its forward, without gradients or optimizer state. ``--quantize nf4`` (or ``fp4``) makes the
   reference 4-bit: with LoRA the base is quantized (QLoRA, as ``examples/finetune_sft.py``),
   so the adapters-disabled reference is the 4-bit base; with ``--full`` the frozen copy alone
   is quantized, the trained weights staying in full precision.
3. The loss: ``ff.sequence_logps`` of chosen and rejected under both models, then
   ``ff.dpo_loss`` (TRL's ``beta``; ``--loss-type robust`` with ``--label-smoothing``), with
   TRL's reward metrics as auxiliary outputs, each the mean over the global batch.
4. Checkpoints hold the train state and the loader's position, so ``--resume`` ends on the
   uninterrupted run's loss, bit for bit.

Nothing is downloaded: a tokenizer is trained on the data and a small Llama built from a
config stands in for the model after supervised fine-tuning.

    torchrun --nproc-per-node 2 examples/finetune_dpo.py
    torchrun --nproc-per-node 2 examples/finetune_dpo.py --quantize nf4       # 4-bit base
    torchrun --nproc-per-node 2 examples/finetune_dpo.py --full --resume
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--data", default=None, help="a local .jsonl of preference pairs")
    p.add_argument("--pairs", type=int, default=128, help="pairs written without --data")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="pairs per rank and step")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--max-length", type=int, default=64, help="tokens kept per sequence")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", choices=("sigmoid", "robust"), default="sigmoid")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="robust DPO's flip rate")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--full", action="store_true", help="train every weight (a frozen copy)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument(
        "--quantize",
        choices=("none", "nf4", "fp4"),
        default="none",
        help="a 4-bit reference: the base under LoRA (QLoRA), the frozen copy with --full",
    )
    p.add_argument("--checkpoint-dir", default="checkpoints/finetune_dpo")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def prepare(args: argparse.Namespace, rank: int) -> tuple[str, str]:
    """The data file and a folder holding the tokenizer and the tiny Llama (rank 0 writes)."""
    from transformers import AutoTokenizer

    data = args.data
    name = f"ff-dpo-{args.pairs}-{args.seed}"
    if data is not None:
        stat = os.stat(data)
        name = f"ff-dpo-data-{stat.st_size}-{int(stat.st_mtime)}"
    folder = os.path.join(tempfile.gettempdir(), name)
    if data is None:
        data = os.path.join(folder, "pairs.jsonl")
    if rank == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        os.makedirs(folder, exist_ok=True)
        if args.data is None:
            sft_data.write_preferences(data, args.pairs, args.seed)
        with open(data) as f:
            pairs = [json.loads(line) for line in f]
        chats = [[*p["prompt"], *p["chosen"], *p["rejected"]] for p in pairs]
        sft_data.chat_tokenizer(chats, folder)
        tiny_llama(folder, vocab_size=-(-len(AutoTokenizer.from_pretrained(folder)) // 8) * 8)
    dist.barrier()
    return data, folder


def quantize(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model``'s linear layers (not ``lm_head``) as bitsandbytes' 4-bit ones, the QLoRA
    recipe's (``examples/finetune_lora.py``); the weights are quantized as they are loaded."""
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    return replace_with_bnb_linear(
        model, modules_to_not_convert=["lm_head"], quantization_config=bnb_config(args)
    )


def main() -> None:
    args = parse_args()
    device = ff.init_distributed(device_type=args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # 1. Data: preference pairs tokenized as DPOTrainer does, this rank's share.
    data, path = prepare(args, rank)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pairs = (
        sft_data.load(data)
        .map(sft_data.encode_preference, fn_kwargs={"tokenizer": tokenizer})
        .select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    )
    pad_id = tokenizer.pad_token_id
    collate = lambda b: sft_data.preference_batch(b, pad_id, args.max_length)  # noqa: E731
    batches = sft_data.Batches(pairs, args.batch_size, collate, rank, world, args.seed)

    # 2. The policy (LoRA adapters, or every weight) and its reference, sharded on one mesh.
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    mesh = ff.make_mesh({"dp": world}, device_type=device.type)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(args.seed)
    quantized = args.quantize != "none"
    if args.full:
        model = base
        sm = ff.fsdp(model, mesh)
        params, buffers = ff.init_sharded(sm)
        params.update(ff.checkpoint.load_safetensors(sm, path))
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config).requires_grad_(False)
        if quantized:  # a 4-bit frozen copy: each rank quantizes its own blocks as it loads
            reference = quantize(reference, args)
        ref = ff.fsdp(reference, mesh)  # frozen: no gradient, no optimizer state
        ref_params, ref_buffers = ff.init_sharded(ref)
        ref_params.update(ff.checkpoint.load_safetensors(ref, path))

        def reference_logits(p: dict, ids: torch.Tensor) -> torch.Tensor:
            return ref.apply(ref_params, input_ids=ids, buffers=ref_buffers).logits
    else:
        if quantized:  # QLoRA: the 4-bit base is the reference, its adapters disabled
            from peft import prepare_model_for_kbit_training

            base = quantize(base, args)
            base.gradient_checkpointing_enable()
            base = prepare_model_for_kbit_training(base)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
        model = get_peft_model(base, lora)
        sm = ff.fsdp(model, mesh, policy=ff.Policy(activation_checkpointing=not quantized))
        params, buffers = ff.init_sharded(sm, init_fn=lora_init)
        to_file = lambda n: n.removeprefix("base_model.model.").replace(".base_layer", "")  # noqa: E731
        frozen = set(params) - sm.trainable
        params.update(ff.checkpoint.load_safetensors(sm, path, rename=to_file, names=frozen))

        def reference_logits(p: dict, ids: torch.Tensor) -> torch.Tensor:
            # The base without the adapters (TRL's reference for a peft model): the policy's
            # own frozen weights, gathered as they are for the policy. sm.apply runs with the
            # peft model's state at the call (a 4-bit base's storage view included).
            with model.disable_adapter():
                return sm.apply(p, input_ids=ids, buffers=buffers).logits

    optimizer = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(args.lr, weight_decay=0.0))

    # 3. TRL's DPO loss; the reference's forward without gradients.
    def loss_fn(p: dict, batch: dict[str, torch.Tensor]) -> Any:
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        logps = ff.sequence_logps(sm.apply(p, input_ids=ids, buffers=buffers).logits, labels)
        with torch.no_grad():
            ref_logps = ff.sequence_logps(reference_logits(p, ids), labels)
        n = len(batch["chosen_input_ids"])
        return ff.dpo_loss(
            logps[:n],
            logps[n:],
            ref_logps[:n],
            ref_logps[n:],
            beta=args.beta,
            loss_type=args.loss_type,
            label_smoothing=args.label_smoothing,
        )

    step = ff.train_step(
        loss_fn, optimizer, model=sm, batch="local", accumulate=args.accumulate, has_aux=True
    )
    state = ff.TrainState.create(params, optimizer, trainable=sm)

    # 4. Checkpoints of the state and the loader's position.
    manager = ff.checkpoint.CheckpointManager(args.checkpoint_dir, save_every=args.save_every)
    if args.resume and manager.latest_step() is not None:
        saved = manager.restore({"state": state, "data": batches.position()})
        state = saved["state"]
        batches.restore(saved["data"])
        if rank == 0:
            print(f"resumed at step {state.step} from {args.checkpoint_dir}")
    first, losses, accuracy = state.step, [], float("nan")
    start = time.perf_counter()
    bar = tqdm(range(state.step, args.steps), disable=rank != 0, desc="dpo", unit="step")
    for _ in bar:
        batch = next(batches)
        state, metrics = step(state, {k: v.to(device) for k, v in batch.items()})
        losses.append(metrics["loss"].item())
        aux = metrics["aux"]
        accuracy = aux["rewards/accuracies"].item()
        bar.set_postfix(
            loss=f"{losses[-1]:.4f}",
            margin=f"{aux['rewards/margins'].item():.3f}",
            accuracy=f"{accuracy:.2f}",
        )
        manager.save(state.step, {"state": state, "data": batches.position()})
    manager.save(state.step, {"state": state, "data": batches.position()}, force=True)
    manager.close()
    if rank == 0 and losses:
        print(
            f"steps {first}..{state.step}: loss {losses[0]!r} -> {losses[-1]!r}; reward "
            f"accuracy {accuracy:.2f}; {time.perf_counter() - start:.1f}s "
            f"({'full' if args.full else 'LoRA'}"
            f"{', 4-bit reference' if quantized else ''})"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
