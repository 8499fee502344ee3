"""Supervised fine-tuning data: chat-formatted examples with the prompt masked, batched by
padding or by packing, read by a stateful loader that shards over the data ranks.

Used by ``examples/finetune_sft.py`` and its tests; every function is pure but the loader.

* :func:`write_instructions` writes a small instruction dataset (JSON lines of chat
  ``messages``) so that nothing is downloaded.
* :func:`chat_tokenizer` trains a byte-level BPE tokenizer on it and gives it a chat
  template, saved so that ``AutoTokenizer.from_pretrained`` reads it like a real one.
* :func:`encode` formats one example with ``tokenizer.apply_chat_template`` and labels only
  the assistant's answer: the prompt's labels are -100.
* :func:`pad` pads a batch to its longest sequence; :func:`pack` packs it into rows of a
  fixed length, each token carrying its position within its own document
  (``position_ids``, as transformers' ``DataCollatorWithFlattening``) and a block-diagonal
  causal mask, so attention never crosses documents. transformers' sdpa and eager attention
  do not isolate documents from ``position_ids`` alone (only flash-attention's varlen path
  does), so the mask is built here: a 4-D additive mask, which both honour.
* :class:`Batches` is a ``torchdata`` ``StatefulDataLoader`` over this data rank's share
  (``DistributedSampler``), epoch after epoch; its position is a small tensor to save in a
  checkpoint, so a resumed run reads exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Sequence
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "echo",
    "fox",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
]


def write_instructions(path: str, n: int = 64, seed: int = 0) -> None:
    """``n`` instruction examples of very different lengths (reverse, sort, count words)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 9))]
            task = rng.choice(["reverse", "sort", "count"])
            answer = {
                "reverse": " ".join(reversed(words)),
                "sort": " ".join(sorted(words)),
                "count": str(len(words)),
            }[task]
            messages = [
                {"role": "user", "content": f"{task}: {' '.join(words)}"},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def read_instructions(path: str) -> list[list[dict[str, str]]]:
    """The ``messages`` of a local JSON-lines file, read by ``datasets``."""
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    return list(load_dataset("json", data_files=path, split="train")["messages"])


def chat_tokenizer(conversations: Sequence[Sequence[dict[str, str]]], path: str) -> None:
    """A byte-level BPE tokenizer trained on the conversations, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([m["content"] for c in conversations for m in c], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(path)


def encode(messages: Sequence[dict[str, str]], tokenizer: Any, max_length: int) -> dict[str, Any]:
    """``input_ids`` and next-token ``labels`` of one conversation, the prompt masked.

    The prompt is everything before the last (assistant) message, with the generation
    prompt; only the answer's tokens (and its end token) are labelled.
    """
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages)
    prompt, full = _ids(prompt), _ids(full)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the answer")
    full = full[: max_length + 1]
    labels = [-100] * len(prompt) + full[len(prompt) :]
    return {"input_ids": full[:-1], "labels": labels[1:]}


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _rows_multiple(n: int, multiple: int) -> int:
    return -(-max(n, 1) // multiple) * multiple


def pad(examples: Sequence[dict[str, Any]], pad_id: int, rows_multiple: int = 1) -> dict:
    """Right-pad to the longest sequence of the batch (labels -100 on padding); empty rows
    are added up to a multiple of ``rows_multiple`` (the micro-batches of a step)."""
    length = max(len(e["input_ids"]) for e in examples)
    rows = _rows_multiple(len(examples), rows_multiple)
    ids = torch.full((rows, length), pad_id)
    labels = torch.full((rows, length), -100)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        labels[r, :n] = torch.tensor(e["labels"])
    return {"input_ids": ids, "labels": labels}


def pack(
    examples: Sequence[dict[str, Any]], length: int, pad_id: int, rows_multiple: int = 1
) -> dict:
    """Pack the examples, in order, into rows of ``length`` tokens (a new row when the next
    one does not fit). ``position_ids`` restart at 0 for each document, and
    ``attention_mask`` is the additive ``[rows, 1, length, length]`` block-diagonal causal
    mask: a token sees only the earlier tokens of its own document."""
    rows: list[list[dict[str, Any]]] = [[]]
    used = 0
    for e in examples:
        n = len(e["input_ids"])
        if n > length:
            raise ValueError(f"an example of {n} tokens does not fit a packed row of {length}")
        if used + n > length:
            rows.append([])
            used = 0
        rows[-1].append(e)
        used += n
    count = _rows_multiple(len(rows), rows_multiple)
    ids = torch.full((count, length), pad_id)
    labels = torch.full((count, length), -100)
    positions = torch.zeros((count, length), dtype=torch.long)
    document = torch.full((count, length), -1)
    for r, row in enumerate(rows):
        at = 0
        for d, e in enumerate(row):
            n = len(e["input_ids"])
            ids[r, at : at + n] = torch.tensor(e["input_ids"])
            labels[r, at : at + n] = torch.tensor(e["labels"])
            positions[r, at : at + n] = torch.arange(n)
            document[r, at : at + n] = d
            at += n
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    # Padding attends to itself only, so that no row of the softmax is empty.
    allowed = (same & causal) | torch.eye(length, dtype=torch.bool)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": mask[:, None],
    }


class Batches:
    """This data rank's batches, epoch after epoch: a ``StatefulDataLoader`` over a
    ``DistributedSampler`` (shuffled per epoch with ``seed``), each batch collated by
    ``collate``. :meth:`position` and :meth:`restore` save and set where it is."""

    def __init__(
        self,
        examples: Sequence[dict[str, Any]],
        batch_size: int,
        collate: Any,
        rank: int,
        ranks: int,
        seed: int = 0,
    ) -> None:
        from torch.utils.data import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.sampler = DistributedSampler(
            list(examples), num_replicas=ranks, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.loader = StatefulDataLoader(
            list(examples), batch_size=batch_size, sampler=self.sampler, collate_fn=collate
        )
        self.epoch = 0
        self.iterator: Any = None

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict:
        while True:
            if self.iterator is None:
                self.sampler.set_epoch(self.epoch)
                self.iterator = iter(self.loader)
            try:
                return next(self.iterator)
            except StopIteration:
                self.epoch, self.iterator = self.epoch + 1, None

    SIZE = 4096  # bytes of a saved position (a fixed shape, so a checkpoint can load into it)

    def position(self) -> torch.Tensor:
        """Where the loader is, as a ``uint8[SIZE]`` tensor to save in a checkpoint.

        A checkpoint stores a plain tensor once for all ranks, so this must be the same on
        every rank, and it is: it holds the epoch and how many batches were read (the same
        count on each rank), not which examples; each rank's sampler knows its own share.
        """
        state = self.loader.state_dict() if self.iterator is not None else None
        data = pickle.dumps({"epoch": self.epoch, "loader": state})
        if len(data) + 4 > self.SIZE:
            raise ValueError(f"the loader's state takes {len(data)} bytes, over {self.SIZE}")
        out = torch.zeros(self.SIZE, dtype=torch.uint8)
        out[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
        out[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    def restore(self, saved: torch.Tensor) -> None:
        """Continue from a :meth:`position`."""
        n = int.from_bytes(bytes(saved[:4].tolist()), "little")
        state = pickle.loads(bytes(saved[4 : 4 + n].tolist()))
        self.epoch, self.iterator = state["epoch"], None
        if state["loader"] is not None:
            self.sampler.set_epoch(self.epoch)
            self.loader.load_state_dict(state["loader"])
            self.iterator = iter(self.loader)
