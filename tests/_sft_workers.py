"""Worker functions for the supervised fine-tuning data tests: padded and packed batches of
chat data give the same token mean, on one process and on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import functional_fsdp as ff

from ._hf import tiny_llama_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def sft_data() -> Any:
    """``examples/sft_data.py``, imported by path."""
    if "sft_data" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sft_data", EXAMPLES / "sft_data.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["sft_data"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["sft_data"]


def chat_examples(n: int = 16) -> tuple[list[dict[str, Any]], int, int]:
    """``n`` encoded chat examples (prompt masked), the pad id and the vocabulary size."""
    from transformers import AutoTokenizer

    D = sft_data()
    with tempfile.TemporaryDirectory() as folder:
        D.write_instructions(f"{folder}/data.jsonl", n, seed=3)
        conversations = D.read_instructions(f"{folder}/data.jsonl")
        D.chat_tokenizer(conversations, folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    examples = [D.encode(c, tokenizer, 48) for c in conversations]
    return examples, tokenizer.pad_token_id, -(-len(tokenizer) // 8) * 8


def llama(vocab: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=vocab, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return total, (labels != -100).sum()


def one_process(batching: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The sum, count and gradients of the sum on one process, all examples in one batch."""
    D = sft_data()
    examples, pad_id, vocab = chat_examples()
    model = llama(vocab)
    params = {n: p.detach() for n, p in model.named_parameters()}
    batch = D.pack(examples, 48, pad_id) if batching == "pack" else D.pad(examples, pad_id)

    def loss(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = torch.func.functional_call(model, p, (), inputs).logits
        return token_loss(logits, batch["labels"])

    grads, (total, count) = torch.func.grad_and_value(loss, has_aux=True)(params)
    return total, count, grads


def gloo_pad_vs_pack() -> dict[str, Any]:
    """One SGD step (learning rate 1) on this rank's share, padded and packed separately
    (``batch="local"``, 2 micro-batches): losses, counts and gradients of each."""
    import torch.distributed as dist

    D = sft_data()
    examples, pad_id, vocab = chat_examples()
    rank, ranks = dist.get_rank(), dist.get_world_size()
    share = examples[rank * len(examples) // ranks : (rank + 1) * len(examples) // ranks]
    out: dict[str, Any] = {}
    for batching in ("pad", "pack"):
        model = llama(vocab)
        mesh = ff.make_mesh({"dp": ranks})
        sm = ff.fsdp(model, mesh)

        def loss_fn(p: Any, b: dict[str, torch.Tensor]) -> Any:
            inputs = {k: v for k, v in b.items() if k != "labels"}
            return token_loss(sm.apply(p, **inputs).logits, b["labels"])

        opt = ff.sgd(1.0)
        step = ff.train_step(loss_fn, opt, model=sm, batch="local", accumulate=2)
        if batching == "pack":
            batch = D.pack(share, 48, pad_id, rows_multiple=2)
        else:
            batch = D.pad(share, pad_id, rows_multiple=2)
        params = sm.shard()
        new, metrics = step(ff.TrainState.create(params, opt), batch)
        before, after = ff.gather(params), ff.gather(new.params)
        out[batching] = {
            "loss": metrics["loss"],
            "count": metrics["count"],
            "grads": {n: before[n] - after[n] for n in before},
            "shape": tuple(batch["input_ids"].shape),
        }
    return out
