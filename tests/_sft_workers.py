"""Worker functions for the supervised fine-tuning tests (``examples/sft_data.py``): chat
data labelled as TRL labels it, padded and packed, on one process and on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import functional_fsdp as ff

from ._hf import tiny_llama_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MAX_LENGTH = 40  # TRL's max_length: some conversations are truncated, one is dropped


def sft_data() -> Any:
    """``examples/sft_data.py``, imported by path."""
    if "sft_data" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sft_data", EXAMPLES / "sft_data.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["sft_data"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["sft_data"]


def conversations() -> list[list[dict[str, str]]]:
    """12 chat conversations (8 multi-turn, 3 with a system prompt), then one whose prompt
    alone is longer than ``MAX_LENGTH`` (TRL drops it after truncation)."""
    D = sft_data()
    with tempfile.TemporaryDirectory() as folder:
        D.write_instructions(f"{folder}/data.jsonl", 12, seed=3)
        out = D.read_instructions(f"{folder}/data.jsonl")
    words = " ".join(random.Random(1).choice(D.WORDS) for _ in range(60))
    return [
        *out,
        [{"role": "user", "content": f"count: {words}"}, {"role": "assistant", "content": "60"}],
    ]


def tokenizer(template: str | None = None) -> Any:
    """The tokenizer trained on :func:`conversations`, with ``template`` (default: the
    example's, with ``{% generation %}`` markers)."""
    from transformers import AutoTokenizer

    D = sft_data()
    with tempfile.TemporaryDirectory() as folder:
        D.chat_tokenizer(conversations(), folder, template or D.CHAT_TEMPLATE)
        return AutoTokenizer.from_pretrained(folder)


def vocab_size(tok: Any) -> int:
    return -(-len(tok) // 8) * 8


def chat_examples(packing: bool = False) -> list[dict[str, list[int]]]:
    """The conversations prepared as TRL's SFTTrainer prepares them (``max_length`` 40)."""
    from datasets import Dataset

    D = sft_data()
    data = Dataset.from_list([{"messages": c} for c in conversations()])
    return list(D.prepare(data, tokenizer(), MAX_LENGTH, packing=packing))


def llama(vocab: int, attention: str = "sdpa", use_cache: bool = False) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=vocab, max_position_embeddings=64)
    config._attn_implementation = attention
    config.use_cache = use_cache
    return LlamaForCausalLM(config)


def batch_of(batching: str, examples: list[dict[str, Any]], pad_id: int, rows: int = 1) -> dict:
    D = sft_data()
    if batching == "pad":
        return D.pad(examples, pad_id, rows_multiple=rows)
    return D.pack(examples, MAX_LENGTH, pad_id, rows_multiple=rows, mask=batching == "pack")


def one_process(batching: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The token mean, count and gradients on one process, all examples in one batch
    (``batching``: "pad", "pack" with the block-diagonal mask, "pack_positions" without)."""
    tok = tokenizer()
    examples = chat_examples(packing=batching != "pad")
    return loss_and_grads(batch_of(batching, examples, tok.pad_token_id), vocab_size(tok))


def loss_and_grads(
    batch: dict[str, torch.Tensor], vocab: int, **model: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The token mean (``ff.causal_lm_loss``), its count and the gradients of :func:`llama`
    (built with ``model``) on one batch of ``input_ids`` and ``labels`` (and whatever else
    the model takes)."""
    net = llama(vocab, **model)
    params = {n: p.detach() for n, p in net.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = torch.func.functional_call(net, p, (), inputs).logits
        total, count = ff.causal_lm_loss(logits, batch["labels"])
        return total / count, count

    grads, (mean, count) = torch.func.grad_and_value(loss, has_aux=True)(params)
    return mean, count, grads


def gloo_pad_vs_pack() -> dict[str, Any]:
    """One SGD step (learning rate 1) on this rank's share, padded and packed (best fit)
    separately (``batch="local"``, 2 micro-batches): losses, counts and gradients of each."""
    import torch.distributed as dist

    tok = tokenizer()
    rank, ranks = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for batching in ("pad", "pack"):
        examples = chat_examples(packing=batching == "pack")
        share = examples[rank * len(examples) // ranks : (rank + 1) * len(examples) // ranks]
        model = llama(vocab_size(tok))
        sm = ff.fsdp(model, ff.make_mesh({"dp": ranks}))

        def loss_fn(p: Any, b: dict[str, torch.Tensor]) -> Any:
            inputs = {k: v for k, v in b.items() if k != "labels"}
            return ff.causal_lm_loss(sm.apply(p, **inputs).logits, b["labels"])

        opt = ff.sgd(1.0)
        step = ff.train_step(loss_fn, opt, model=sm, batch="local", accumulate=2)
        batch = batch_of(batching, share, tok.pad_token_id, rows=2)
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
