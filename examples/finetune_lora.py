"""Fine-tune a pretrained Hugging Face causal LM with LoRA, fully sharded, from a checkpoint on disk.

The real user's path, end to end, with no rank ever holding the whole model:

1. the model is built on the ``meta`` device and LoRA adapters are added with ``peft``;
2. the adapters are initialised one unit at a time (``ff.init_sharded``) and the frozen base
   weights are read shard by shard from the safetensors checkpoint
   (``ff.checkpoint.load_safetensors``: each rank reads only its own rows);
3. training: FSDP over the data axes (optionally tensor parallel too), activation
   checkpointing per decoder layer, bf16 compute with fp32 master weights, gradient
   accumulation; only the adapters have gradients and optimizer state;
4. checkpoints every ``--save-every`` steps, the last ``--keep`` kept; ``--resume`` continues
   from the latest one exactly (the data order is a function of the step);
5. the adapter is exported in peft's format, reloaded with ``transformers`` + ``peft`` in one
   process, and a sample is generated.

Nothing is downloaded: without ``--model`` a small Llama is built from a config and saved with
``save_pretrained`` (it stands in for a downloaded checkpoint), trained on Python's bundled
documentation with a character vocabulary. ``--model PATH`` takes a real local checkpoint
(its tokenizer is read from the same folder with ``AutoTokenizer``).

``--data PATH`` trains on a local dataset read by ``datasets`` (``.jsonl``/``.json``, ``.txt``
or ``.parquet``; the text is in the field ``--text-field``): texts are tokenized, joined with
the end-of-sequence token and packed into ``--block-size`` sequences, read in order; the global
batch of step ``i`` starts at sequence ``i * batch_size``, so the step saved in a checkpoint is
the data position and ``--resume`` continues exactly. Without ``--model``, a tokenizer is
trained on that text with ``tokenizers`` and saved beside the tiny Llama, so the tokenizer is
read back with ``AutoTokenizer`` as a real one would be.

``--quantize nf4`` is the QLoRA recipe (``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bfloat16)``,
``model.gradient_checkpointing_enable()``, ``prepare_model_for_kbit_training(model)``, LoRA
dropout 0.05): the base's linear layers become bitsandbytes 4-bit layers on ``meta``, each rank
quantizes its own blocks while reading the checkpoint, and the packed 4-bit bytes are what is
sharded and gathered. The recipe's two lines run unchanged on the meta model; Hugging Face's
checkpointing then recomputes each decoder layer (the library's own is off), and since
``torch.func`` cannot differentiate through it, ``train_step`` computes the gradients with plain
autograd (a one-line notice). One difference from ``from_pretrained``: on a model that
``from_pretrained`` did not quantize, ``prepare_model_for_kbit_training`` only freezes the base
and casts half-precision weights to fp32 (its checkpointing part, for quantized loads, is what
the line before it already did).

    torchrun --nproc-per-node 2 examples/finetune_lora.py
    torchrun --nproc-per-node 2 examples/finetune_lora.py --resume        # continue
    torchrun --nproc-per-node 4 examples/finetune_lora.py --mesh dp=2,tp=2
    torchrun --nproc-per-node 2 examples/finetune_lora.py --quantize nf4 --data train.jsonl
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from chardata import add_device_arg, load_text, parse_mesh
from tqdm import tqdm

import functional_fsdp as ff


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="a local save_pretrained folder (default: a tiny Llama)"
    )
    p.add_argument("--mesh", default=None, help="e.g. dp=2 or dp=2,tp=2 (default: dp=world)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--checkpoint-dir", default="checkpoints/finetune_lora")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--out", default=None, help="where the adapter goes (default: <checkpoint-dir>/adapter)"
    )
    p.add_argument(
        "--quantize",
        choices=("none", "nf4", "fp4"),
        default="none",
        help="a 4-bit frozen base (bitsandbytes; nf4 is the QLoRA recipe)",
    )
    p.add_argument("--data", default=None, help="a local .jsonl/.json/.txt/.parquet dataset")
    p.add_argument("--text-field", default="text", help="the field of --data holding the text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-tokens", type=int, default=200)
    add_device_arg(p)
    return p.parse_args()


class CharTokenizer:
    """The tiny model's vocabulary: one id per character of the training text."""

    def __init__(self, chars: list[str]):
        self.chars, self.index = chars, {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


def tiny_llama(path: str, vocab_size: int) -> None:
    """Stand-in for a downloaded checkpoint: a small Llama saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="1MB")


def lora_init(module: torch.nn.Module) -> None:
    """peft's own initialisation of its adapters (``lora_B`` zero: training starts at the base)."""
    from peft.tuners.lora import LoraLayer

    if isinstance(module, LoraLayer):
        for name in module.lora_A:
            module.reset_lora_parameters(name, True)


DATA_KINDS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


def load_texts(path: str, field: str) -> list[str]:
    """The texts of a local dataset file, read by ``datasets`` (nothing from a hub)."""
    from datasets import load_dataset

    kind = DATA_KINDS.get(os.path.splitext(path)[1])
    if kind is None:
        raise SystemExit(
            f"--data {path}: unknown file type; use one of {sorted(DATA_KINDS)} (JSON lines, "
            f"plain text with one text per line, or parquet)."
        )
    if not os.path.exists(path):
        raise SystemExit(f"--data {path}: no such file.")
    records = load_dataset(kind, data_files=path, split="train")
    if field not in records.column_names:
        raise SystemExit(
            f"--data {path}: the records have no field {field!r}; their fields are "
            f"{records.column_names}. Pass --text-field with the one that holds the text."
        )
    return [t for t in records[field] if t]


def train_tokenizer(texts: list[str], path: str) -> None:
    """A byte-level BPE tokenizer trained with ``tokenizers`` on ``texts``, saved to ``path``
    so that ``AutoTokenizer.from_pretrained(path)`` reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def packed(texts: list[str], tokenizer: Any) -> torch.Tensor:
    """All texts tokenized and joined by the end-of-sequence token: one stream to pack."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def packed_batch(stream: torch.Tensor, step: int, args: argparse.Namespace) -> torch.Tensor:
    """The global batch of ``step``: sequences ``step * batch_size`` onwards of the packed
    stream, in order (wrapping around): the step is the data position."""
    n = max(1, (len(stream) - 1) // args.block_size)
    rows = [(step * args.batch_size + j) % n for j in range(args.batch_size)]
    return torch.stack([stream[r * args.block_size : (r + 1) * args.block_size] for r in rows])


def bnb_config(args: argparse.Namespace) -> Any:
    """The QLoRA recipe's quantization config."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_type=args.quantize,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def batch_at(data: torch.Tensor, step: int, args: argparse.Namespace) -> torch.Tensor:
    """The global batch of ``step``: a pure function of the step, so a resumed run sees the
    same data as an uninterrupted one."""
    if args.data is not None:
        return packed_batch(data, step, args)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.block_size - 1, (args.batch_size,), generator=gen)
    return torch.stack([data[s : s + args.block_size] for s in starts.tolist()])


def main() -> None:
    args = parse_args()
    device = ff.init_distributed(device_type=args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # 1. The pretrained checkpoint: a real local one, or a tiny stand-in written by rank 0.
    text_ids, chars = load_text()
    path = args.model
    if args.data is not None:
        texts = load_texts(args.data, args.text_field)
        if path is None:  # a tiny Llama and a tokenizer trained on the data, beside it
            stat = os.stat(args.data)
            path = os.path.join(
                tempfile.gettempdir(), f"ff-tiny-llama-data-{stat.st_size}-{int(stat.st_mtime)}"
            )
            if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
                train_tokenizer(texts, path)
                size = len(AutoTokenizer.from_pretrained(path))
                tiny_llama(path, vocab_size=-(-size // 8) * 8)
            dist.barrier()
        tokenizer = AutoTokenizer.from_pretrained(path)
        data = packed(texts, tokenizer)
    elif path is None:
        path = os.path.join(tempfile.gettempdir(), f"ff-tiny-llama-{len(chars)}")
        if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
            tiny_llama(path, vocab_size=-(-len(chars) // 8) * 8)  # a multiple of 8 for tp
        dist.barrier()
        tokenizer: Any = CharTokenizer(chars)
        data = text_ids
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        text = "".join(chars[i] for i in text_ids[:200_000].tolist())
        data = torch.tensor(tokenizer.encode(text), dtype=torch.long)

    # 2. The model on meta, LoRA adapters, the sharding.
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    dropout = 0.0
    quantized = args.quantize != "none"
    if quantized:  # the base's linear layers as bitsandbytes 4-bit, on meta
        from peft import prepare_model_for_kbit_training
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        base = replace_with_bnb_linear(
            base, modules_to_not_convert=["lm_head"], quantization_config=bnb_config(args)
        )
        # The QLoRA recipe's own lines: Hugging Face's checkpointing in every decoder layer
        # (instead of the library's, below), and peft's preparation of a k-bit base.
        base.gradient_checkpointing_enable()
        base = prepare_model_for_kbit_training(base)
        dropout = 0.05
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        target_modules=args.targets.split(","),
        lora_dropout=dropout,
    )
    model = get_peft_model(base, lora)
    mesh = ff.make_mesh(parse_mesh(args.mesh, default={"dp": world}), device_type=device.type)
    bf16 = args.mixed_precision == "bf16"
    policy = ff.Policy(
        # recompute activations per unit (one per decoder layer), unless HF's checkpointing does
        activation_checkpointing=not quantized,
        mixed_precision=ff.MixedPrecision(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
        ),
    )
    specs, wrappers = None, ()
    if "tp" in mesh.mesh_dim_names:
        plan = ff.llama_plan(config, prefix="base_model.model.", loss_parallel=False)
        tp = ff.tensor_parallel(model, mesh, plan)
        specs, wrappers = tp.specs, tp.wrappers
    sm = ff.fsdp(model, mesh, policy=policy, specs=specs, wrappers=wrappers)

    # 3. Adapters initialised unit by unit; the frozen base read shard by shard.
    torch.manual_seed(args.seed)  # the same adapters on every rank (init_sharded checks)
    params, buffers = ff.init_sharded(sm, init_fn=lora_init)
    frozen = set(params) - sm.trainable
    to_file = lambda name: name.removeprefix("base_model.model.").replace(".base_layer", "")  # noqa: E731
    params.update(ff.checkpoint.load_safetensors(sm, path, rename=to_file, names=frozen))

    schedule = ff.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10
    )
    optimizer = ff.chain(
        ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(schedule, weight_decay=0.0)
    )

    def loss_fn(p: dict, batch: torch.Tensor) -> torch.Tensor:
        return sm.apply(p, input_ids=batch, labels=batch, buffers=buffers).loss

    # engine "auto": torch.func where it can; HF's checkpointing (the QLoRA recipe) makes the
    # step compute its gradients with plain autograd instead, with a one-line notice.
    step = ff.train_step(
        loss_fn, optimizer, model=sm, accumulate=args.accumulate, learning_rate=schedule
    )
    state = ff.TrainState.create(params, optimizer, trainable=sm)
    n_train = sum(math.prod(params[n].global_shape) for n in sm.trainable)
    n_all = sum(math.prod(v.global_shape) for v in params.values())

    # 4. Checkpoints: every --save-every steps, the last --keep kept; --resume from the latest.
    manager = ff.checkpoint.CheckpointManager(
        args.checkpoint_dir, save_every=args.save_every, keep_last=args.keep
    )
    if args.resume and manager.latest_step() is not None:
        state = manager.restore(state)
        if rank == 0:
            print(f"resumed at step {state.step} from {args.checkpoint_dir}")
        try:
            check_steps_left(int(state.step), args.steps, args.checkpoint_dir)
        except ValueError as e:
            manager.close()
            dist.destroy_process_group()
            raise SystemExit(f"finetune_lora.py: {e}") from None
    if rank == 0:
        print(
            f"{type(base).__name__} from {path}: {n_all:,} parameters, {n_train:,} trainable "
            f"(LoRA r={args.rank}); mesh {dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))}"
        )
    t0, first = time.perf_counter(), state.step
    bar = tqdm(range(state.step, args.steps), disable=rank != 0, desc="finetune", unit="step")
    losses: list[float] = []
    for i in bar:
        state, metrics = step(state, batch_at(data, i, args).to(device))
        losses.append(metrics["loss"].item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        manager.save(state.step, state)
    manager.save(state.step, state, force=True)
    manager.close()
    elapsed = time.perf_counter() - t0

    # 5. Export the adapter in peft's format, reload it with transformers + peft, sample.
    out = args.out or os.path.join(args.checkpoint_dir, "adapter")
    ff.checkpoint.export_peft_adapter(sm, state.params, out)
    if rank == 0:
        if losses:
            print(
                f"steps {first}..{state.step}: loss {losses[0]:.4f} -> {losses[-1]:.6f} "
                f"in {elapsed:.1f}s ({(state.step - first) / max(elapsed, 1e-9):.2f} steps/s)"
            )
        print(f"adapter written to {out}")
        sample(path, out, tokenizer, args)
    dist.barrier()
    dist.destroy_process_group()


def check_steps_left(step: int, steps: int, checkpoint_dir: str) -> None:
    """Refuse a resume with nothing left to train: the checkpoint already reached ``--steps``.

    Example:
        >>> check_steps_left(100, 200, "ckpt")
        >>> check_steps_left(200, 200, "ckpt")
        Traceback (most recent call last):
        ...
        ValueError: --resume: the latest checkpoint in 'ckpt' is at step 200 and --steps is 200, so there is nothing left to train. Pass --steps N with N above 200 to train more (the learning-rate schedule then runs to N), or leave out --resume to start again.
    """
    if step >= steps:
        raise ValueError(
            f"--resume: the latest checkpoint in {checkpoint_dir!r} is at step {step} and "
            f"--steps is {steps}, so there is nothing left to train. Pass --steps N with N "
            f"above {step} to train more (the learning-rate schedule then runs to N), or leave "
            f"out --resume to start again."
        )


def sample(path: str, adapter: str, tokenizer: Any, args: argparse.Namespace) -> None:
    """Reload the base model and the exported adapter in this process and generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    quantized = {}
    if args.quantize != "none":
        quantized = dict(quantization_config=bnb_config(args), device_map="cpu")
    base = AutoModelForCausalLM.from_pretrained(path, **quantized)
    model = PeftModel.from_pretrained(base, adapter).eval()
    prompt = torch.tensor([tokenizer.encode("The ")])  # type: ignore[attr-defined]
    torch.manual_seed(args.seed)
    with torch.no_grad():
        ids = model.generate(
            input_ids=prompt, max_new_tokens=args.sample_tokens, do_sample=True, top_k=20
        )
    print("sample:", repr(tokenizer.decode(ids[0].tolist())))  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
