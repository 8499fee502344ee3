"""Supervised fine-tuning data in Hugging Face's and TRL's conventions: chat conversations
tokenized with the chat template, every assistant turn trained, truncated and packed as TRL 1.16's
``SFTTrainer`` does, read by a stateful loader that shards over the data ranks.

Used by ``examples/finetune_sft.py``, ``examples/finetune_dpo.py`` and their tests; every
function is pure but the loader.

**Labels** follow Hugging Face's convention: aligned with ``input_ids``, ``-100`` where a token
is not trained; the loss shifts them (``ff.causal_lm_loss``, or transformers' own ``labels=``).

* :func:`write_instructions` writes a small chat dataset (JSON lines of ``messages``: some
  conversations multi-turn, some with a system prompt) so that nothing is downloaded.
* :func:`chat_tokenizer` trains a byte-level BPE tokenizer on it and gives it a chat template
  with ``{% generation %}`` markers, saved so that ``AutoTokenizer.from_pretrained`` reads it.
* :func:`encode` tokenizes one example and labels what TRL's ``assistant_only_loss=True``
  labels: every assistant turn (``turns="last"``: only the last one). It reads the template's
  ``{% generation %}`` markers where it has them, and finds the turns by rendering the
  conversation's prefixes where it does not. Prompt-completion examples (TRL's
  ``completion_mask``) are taken too, and so are TRL-prepared ones (:func:`prepared`:
  ``input_ids`` with ``labels``, ``assistant_masks`` or ``completion_mask``, rows packed by TRL
  with their ``seq_lengths`` or ``position_ids`` among them), as they are.
* :func:`prepare` maps a ``datasets.Dataset`` through :func:`encode` (cached by ``datasets``)
  and, as TRL, truncates to ``max_length`` (``keep_start``) and drops the examples left with
  nothing to train, unless the data is to be packed.
* :func:`pad` pads a batch to its longest sequence; :func:`pack` packs it into rows of a fixed
  length, best-fit decreasing (TRL's default ``packing_strategy="bfd"``) or in order, an
  over-long example truncated (TRL's ``bfd``) or refused; rows packed already are kept
  whole. Each token carries its position within its own document (``position_ids``, as
  ``DataCollatorWithFlattening``), each document's first label is ``-100``, and the batch
  carries a block-diagonal causal mask, optionally: transformers' sdpa and eager attention isolate documents from ``position_ids``
  alone when the model runs with ``use_cache=False`` and no other mask (measured in
  ``tests/test_sft.py``). :func:`flatten` batches with transformers'
  ``DataCollatorWithFlattening`` instead, one row per micro-batch.
* :class:`Batches` is a ``torchdata`` ``StatefulDataLoader`` over this data rank's share
  (``DistributedSampler``), epoch after epoch; its position is a small tensor to save in a
  checkpoint, so a resumed run reads exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import bisect
import json
import pickle
import random
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import torch

# Assistant turns are wrapped in {% generation %} markers, as TRL's assistant_only_loss needs
# (transformers' return_assistant_tokens_mask reads them).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The same rendering without the markers, as most chat templates are written.
PLAIN_TEMPLATE = (
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
SYSTEM = "answer with the words only"


def _task(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 9))]
    task = rng.choice(["reverse", "sort", "count"])
    answer = {
        "reverse": " ".join(reversed(words)),
        "sort": " ".join(sorted(words)),
        "count": str(len(words)),
    }[task]
    return f"{task}: {' '.join(words)}", answer


def write_instructions(path: str, n: int = 64, seed: int = 0) -> None:
    """``n`` chat examples of very different lengths (reverse, sort, count words): about a
    third with a second or third turn, about a quarter with a system prompt."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.25 else []
            for _ in range(rng.choice([1, 1, 2, 3])):
                question, answer = _task(rng)
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": answer})
            f.write(json.dumps({"messages": messages}) + "\n")


def read_instructions(path: str) -> list[list[dict[str, str]]]:
    """The ``messages`` of a local JSON-lines file, read by ``datasets``."""
    return list(load(path)["messages"])


def load(path: str) -> Any:
    """A local JSON-lines file as a ``datasets.Dataset`` (cached by ``datasets``)."""
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    return load_dataset("json", data_files=path, split="train")


def is_tokenized(dataset: Any) -> bool:
    """Whether a dataset is tokenized already (TRL-prepared: it has ``input_ids``)."""
    return "input_ids" in dataset.column_names


def largest_token_id(dataset: Any) -> int:
    """The largest token id in a tokenized dataset's ``input_ids`` (its vocabulary is at least
    one more).

    Example:
        >>> from datasets import Dataset
        >>> largest_token_id(Dataset.from_list([{"input_ids": [3, 9]}, {"input_ids": [4]}]))
        9
    """
    largest = dataset.map(
        lambda rows: {"largest": [max(ids, default=-1) for ids in rows["input_ids"]]},
        batched=True,
        remove_columns=dataset.column_names,
    )
    return max(largest["largest"], default=-1)


def conversations_of(dataset: Any) -> list[list[dict[str, str]]]:
    """The conversations of a dataset of ``messages`` or of prompt-completion pairs."""
    if "messages" in dataset.column_names:
        return list(dataset["messages"])
    return [[*r["prompt"], *r["completion"]] for r in dataset]


def chat_tokenizer(
    conversations: Sequence[Sequence[dict[str, str]]], path: str, template: str = CHAT_TEMPLATE
) -> None:
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
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<pad>", chat_template=template
    )
    fast.save_pretrained(path)


# --------------------------------------------------------------------------- one example


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], **kwargs: Any) -> dict:
    return dict(
        tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True, **kwargs)
    )


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of ones of a 0/1 mask."""
    runs, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def assistant_mask(
    tokenizer: Any, messages: Sequence[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """The conversation's ``input_ids`` and a 0/1 mask of its assistant turns' tokens.

    With ``{% generation %}`` markers in the chat template, transformers' own
    ``return_assistant_tokens_mask`` (what TRL's ``assistant_only_loss`` reads). Without them,
    each assistant turn is the tokens that rendering the conversation up to that turn adds to
    the rendering of the conversation before it with the generation prompt: the same tokens
    where the template could carry markers.
    """
    template = tokenizer.chat_template or ""
    if "{% generation %}" in template or "{%- generation %}" in template:
        out = _render(tokenizer, messages, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    ids = list(_render(tokenizer, messages)["input_ids"])
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(
                "encode: a conversation that opens with an assistant turn has no prompt to "
                "render before it; add the chat template's {% generation %} markers."
            )
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)["input_ids"]
        upto = _render(tokenizer, messages[: i + 1])["input_ids"]
        if ids[: len(upto)] != list(upto):
            raise ValueError(
                f"encode: the chat template does not render turn {i} as a prefix of the "
                f"whole conversation, so its tokens cannot be found without markers; add "
                f"{{% generation %}} markers around the assistant's content in the template."
            )
        for t in range(_common(before, upto), len(upto)):
            mask[t] = 1
    return ids, mask


def encode(example: dict[str, Any], tokenizer: Any, turns: str = "all") -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` (aligned, ``-100`` where not trained) of one example.

    * ``{"messages": [...]}``: every assistant turn is labelled (TRL's
      ``assistant_only_loss=True``); ``turns="last"``: only the last assistant turn.
    * ``{"prompt": [...], "completion": [...]}`` (conversational prompt-completion): the
      completion's assistant tokens, as TRL labels them (``completion_mask`` and
      ``assistant_masks``; the completion starts where the prompt rendered with the
      generation prompt and the whole conversation diverge).
    * a TRL-prepared example (``input_ids`` with ``labels``, or with ``assistant_masks``
      and/or ``completion_mask``, perhaps a packed row): taken as it is, see :func:`prepared`.
    """
    if turns not in ("all", "last"):
        raise ValueError(f"encode: turns must be 'all' or 'last', got {turns!r}.")
    if "input_ids" in example:
        return prepared(example)
    if "prompt" in example:
        ids, mask = assistant_mask(tokenizer, [*example["prompt"], *example["completion"]])
        prompt = _render(tokenizer, example["prompt"], add_generation_prompt=True)["input_ids"]
        start = _common(prompt, ids)
        mask = [0] * start + mask[start:]
    elif "messages" in example:
        ids, mask = assistant_mask(tokenizer, example["messages"])
    else:
        raise ValueError(
            f"encode: an example needs 'messages', 'prompt' and 'completion', or 'input_ids'; "
            f"got the fields {sorted(example)}."
        )
    if turns == "last":
        runs = _runs(mask)
        mask = [0] * len(ids)
        if runs:
            mask[runs[-1][0] : runs[-1][1]] = [1] * (runs[-1][1] - runs[-1][0])
    if 1 not in mask:
        raise ValueError(
            "encode: an example has no assistant tokens to train; the chat template may lack "
            "the {% generation %} markers, or the conversation has no assistant turn."
        )
    return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]}


def _document_lengths(example: dict[str, Any], n: int) -> list[int] | None:
    """The lengths of the documents packed in a row (``seq_lengths``, or the runs of
    ``position_ids`` that start at 0), or None for a row that is one sequence."""
    if example.get("seq_lengths") is not None:
        lengths = [int(m) for m in example["seq_lengths"]]
        if sum(lengths) != n or min(lengths, default=1) < 1:
            raise ValueError(
                f"prepared: a packed row has {n} input_ids but seq_lengths {lengths} (sum "
                f"{sum(lengths)}); seq_lengths must be the row's document lengths, as TRL's "
                f"pack_dataset writes them."
            )
        return lengths
    if example.get("position_ids") is not None:
        positions = list(example["position_ids"])
        if len(positions) != n or (positions and positions[0] != 0):
            raise ValueError(
                f"prepared: a packed row has {n} input_ids and position_ids {positions[:8]}... "
                f"({len(positions)} of them); position_ids must have one entry per token and "
                f"restart at 0 at each document, as DataCollatorWithFlattening writes them."
            )
        starts = [i for i, p in enumerate(positions) if p == 0]
        return [b - a for a, b in zip(starts, [*starts[1:], n])]
    return None


def prepared(example: dict[str, Any]) -> dict[str, list[int]]:
    """A TRL-prepared (already tokenized) example as ``input_ids`` and ``labels``, taken as it
    is: no template is applied, nothing is re-tokenized.

    * ``labels`` given (what ``SFTTrainer`` leaves in its ``train_dataset``): kept.
    * else ``assistant_masks`` and/or ``completion_mask`` (what TRL's tokenization writes,
      0/1 per token): a token is labelled where every mask is 1, as TRL's ``build_labels``
      does; with neither mask, every token is. (TRL reads ``completion_mask`` only with
      ``completion_only_loss=True``, its default for prompt-completion data; a mask in the
      data is always read here.)
    * a packed row (TRL's ``seq_lengths``, or ``position_ids`` restarting at 0 at each
      document): its document lengths are kept as ``seq_lengths``, so that :func:`pack`
      keeps the row whole and gives each document its own positions and mask.

    Example:
        >>> prepared({"input_ids": [5, 6, 7, 8], "assistant_masks": [0, 0, 1, 1]})
        {'input_ids': [5, 6, 7, 8], 'labels': [-100, -100, 7, 8]}
        >>> prepared({"input_ids": [5, 6, 7], "labels": [5, 6, 7], "position_ids": [0, 1, 0]})
        {'input_ids': [5, 6, 7], 'labels': [5, 6, 7], 'seq_lengths': [2, 1]}
    """
    ids = list(example["input_ids"])
    if example.get("labels") is not None:
        labels = list(example["labels"])
    else:
        masks = [example[k] for k in ("completion_mask", "assistant_masks") if example.get(k)]
        labels = [t if all(m[i] for m in masks) else -100 for i, t in enumerate(ids)]
    if len(labels) != len(ids):
        raise ValueError(
            f"prepared: an example has {len(ids)} input_ids but {len(labels)} labels or mask "
            f"entries; labels and masks are aligned with input_ids, one entry per token."
        )
    out = {"input_ids": ids, "labels": labels}
    lengths = _document_lengths(example, len(ids))
    if lengths is not None:
        out["seq_lengths"] = lengths
    return out


def truncate(example: dict[str, Any], max_length: int) -> dict[str, list[int]]:
    """The first ``max_length`` tokens and labels (TRL's ``truncation_mode="keep_start"``)."""
    return {
        "input_ids": example["input_ids"][:max_length],
        "labels": example["labels"][:max_length],
    }


def trains_something(example: dict[str, Any]) -> bool:
    """Whether any label counts (TRL drops the examples that truncation left without one)."""
    return any(label != -100 for label in example["labels"])


def prepare(
    dataset: Any,
    tokenizer: Any,
    max_length: int | None,
    *,
    turns: str = "all",
    packing: bool = False,
) -> Any:
    """A ``datasets.Dataset`` of chat (or prompt-completion, or TRL-prepared) examples as
    ``input_ids`` and ``labels``, as TRL's ``SFTTrainer`` prepares it: :func:`encode` mapped
    over it (``datasets`` caches the result beside a dataset read from files), then, unless
    ``packing``, truncated to ``max_length`` and the examples left with no label dropped.
    Packed data is truncated per document by :func:`pack` instead, as TRL's does. Rows that
    are already packed (TRL's ``seq_lengths``, or ``position_ids``) are taken as they are
    (:func:`prepared`; ``tokenizer`` may be None) and batched by :func:`pack`."""
    columns = [c for c in dataset.column_names if c not in ("input_ids", "labels")]
    packed = any(c in dataset.column_names for c in ("seq_lengths", "position_ids"))
    dataset = dataset.map(
        encode, fn_kwargs={"tokenizer": tokenizer, "turns": turns}, remove_columns=columns
    )
    if max_length is not None and not packing and not packed:
        dataset = dataset.map(truncate, fn_kwargs={"max_length": max_length})
        dataset = dataset.filter(trains_something)
    return dataset


# --------------------------------------------------------------------------- batches


def _rows_multiple(n: int, multiple: int) -> int:
    return -(-max(n, 1) // multiple) * multiple


def pad(examples: Sequence[dict[str, Any]], pad_id: int, rows_multiple: int = 1) -> dict:
    """Right-pad to the longest sequence of the batch (labels -100 on padding); empty rows
    are added up to a multiple of ``rows_multiple`` (the micro-batches of a step)."""
    if any("seq_lengths" in e for e in examples):
        raise ValueError(
            "pad: the examples are rows that are already packed (they carry seq_lengths); "
            "padded as single sequences, their documents would attend to each other. Batch "
            "them with pack(...) (the example's --batching pack), which keeps each row whole "
            "and gives each document its own position_ids and mask."
        )
    length = max(len(e["input_ids"]) for e in examples)
    rows = _rows_multiple(len(examples), rows_multiple)
    ids = torch.full((rows, length), pad_id)
    labels = torch.full((rows, length), -100)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        labels[r, :n] = torch.tensor(e["labels"])
    return {"input_ids": ids, "labels": labels}


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of example indices, as TRL 1.16's ``pack_dataset(strategy="bfd")`` forms them:
    longest first (ties in order), each into the open bin with the least room that fits it
    (the earliest such bin), else into a new bin."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rooms: list[int] = []  # the distinct room left in open bins, ascending
    by_room: dict[int, deque[list[int]]] = defaultdict(deque)
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n == 0:
            continue
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            row = by_room[room].popleft()
            if not by_room[room]:
                rooms.pop(k)
        else:
            room, row = capacity, []
            bins.append(row)
        row.append(i)
        room -= n
        if room > 0:
            if not by_room[room]:
                bisect.insort(rooms, room)
            by_room[room].append(row)
    return bins


def in_order(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of example indices in order: a new bin when the next example does not fit."""
    bins: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return [b for b in bins if b]


def _documents(
    examples: Sequence[dict[str, Any]], length: int, strategy: str, overflow: str
) -> tuple[list[tuple[list[int], list[int]]], list[list[int]]]:
    """Each document's ``(input_ids, labels)``, cut to ``length``, and the rows as lists of
    document indices: binned by ``strategy``, or the given rows of packed examples."""
    documents: list[tuple[list[int], list[int]]] = []
    if examples and all("seq_lengths" in e for e in examples):
        bins: list[list[int]] = []
        for i, e in enumerate(examples):
            if len(e["input_ids"]) > length:
                raise ValueError(
                    f"pack: row {i} is already packed (it carries seq_lengths) and has "
                    f"{len(e['input_ids'])} tokens, over the row's {length}; pass a length of "
                    f"at least {len(e['input_ids'])} (TRL's max_length when it packed them)."
                )
            bins.append([])
            at = 0
            for n in e["seq_lengths"]:
                bins[-1].append(len(documents))
                documents.append((e["input_ids"][at : at + n], e["labels"][at : at + n]))
                at += n
        return documents, bins
    if any("seq_lengths" in e for e in examples):
        raise ValueError(
            "pack: some examples are packed rows (they carry seq_lengths) and some are not; "
            "prepare the whole dataset one way."
        )
    lengths = [len(e["input_ids"]) for e in examples]
    for i, n in enumerate(lengths):
        if n > length and overflow == "error":
            raise ValueError(
                f"pack: example {i} has {n} tokens, over the packed row's {length} "
                f"(overflow='error'). Pass overflow='truncate' to keep its first {length} "
                f"tokens, as TRL's packing does, or a longer row."
            )
    lengths = [min(n, length) for n in lengths]
    documents = [(e["input_ids"][:n], e["labels"][:n]) for e, n in zip(examples, lengths)]
    return documents, (best_fit_decreasing if strategy == "bfd" else in_order)(lengths, length)


def pack(
    examples: Sequence[dict[str, Any]],
    length: int,
    pad_id: int,
    rows_multiple: int = 1,
    *,
    strategy: str = "bfd",
    overflow: str = "truncate",
    mask: bool = True,
) -> dict:
    """Pack the examples into rows of ``length`` tokens.

    Args:
        examples: ``input_ids`` and ``labels`` (aligned) of each example; or rows that are
            already packed (with ``seq_lengths``, as :func:`prepared` gives TRL's packed rows),
            each kept whole as one row, ``strategy`` and ``overflow`` unused.
        length: tokens per row (TRL's ``max_length`` with ``packing=True``).
        pad_id: the padding token.
        rows_multiple: empty rows are added up to a multiple of it (the micro-batches).
        strategy: ``"bfd"``, best-fit decreasing (TRL's default ``packing_strategy``: rows
            are filled with the longest examples first, so there is less padding, and the
            documents are reordered), or ``"in_order"`` (a new row when the next example does
            not fit).
        overflow: an example longer than ``length``: ``"truncate"`` keeps its first
            ``length`` tokens (TRL's ``bfd``), ``"error"`` refuses it.
        mask: add the additive ``[rows, 1, length, length]`` block-diagonal causal mask as
            ``attention_mask`` (a token sees only the earlier tokens of its own document).
            Without it, the attention must isolate documents from ``position_ids``, which
            transformers' sdpa and eager attention do only with ``use_cache=False`` and no
            other mask.

    ``position_ids`` restart at 0 for each document (and are 0 on padding); each document's
    first label is -100, so that no document is trained to predict the next one's first
    token (``DataCollatorWithFlattening``'s and TRL's ``padding_free`` convention).
    """
    if strategy not in ("bfd", "in_order"):
        raise ValueError(f"pack: strategy must be 'bfd' or 'in_order', got {strategy!r}.")
    if overflow not in ("truncate", "error"):
        raise ValueError(f"pack: overflow must be 'truncate' or 'error', got {overflow!r}.")
    documents, bins = _documents(examples, length, strategy, overflow)
    count = _rows_multiple(len(bins), rows_multiple)
    ids = torch.full((count, length), pad_id)
    labels = torch.full((count, length), -100)
    positions = torch.zeros((count, length), dtype=torch.long)
    for r, row in enumerate(bins):
        at = 0
        for i in row:
            doc_ids, doc_labels = documents[i]
            n = len(doc_ids)
            ids[r, at : at + n] = torch.tensor(doc_ids)
            labels[r, at : at + n] = torch.tensor(doc_labels)
            labels[r, at] = -100
            positions[r, at : at + n] = torch.arange(n)
            at += n
    out = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if mask:
        out["attention_mask"] = block_causal_mask(positions)
    return out


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The additive ``[rows, 1, length, length]`` causal mask of packed rows: a token sees the
    earlier tokens of its own document, a document starting wherever ``position_ids`` is 0
    (so each padding token, at position 0, sees itself only and no softmax row is empty).

    Example:
        >>> (block_causal_mask(torch.tensor([[0, 1, 0]]))[0, 0] == 0).int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    document = (position_ids == 0).cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return additive[:, None]


def flatten(
    examples: Sequence[dict[str, Any]], pad_id: int, rows: int = 1, *, mask: bool = True
) -> dict:
    """transformers' ``DataCollatorWithFlattening``, one row per micro-batch: the examples
    split in order into ``rows`` groups, each group's examples concatenated into one row
    (``position_ids`` restarting at 0 for each, its first label -100), the rows right-padded
    to the longest (labels -100, ``position_ids`` 0).

    This is TRL's ``padding_free=True`` without packing: no row has a fixed length, nothing
    is reordered, and each micro-batch pads only to the longest micro-batch. ``pack`` fills
    rows of a fixed length instead. The collator flattens a whole batch into one row; the
    step splits the batch's rows into micro-batches, hence one row each.

    Args:
        examples: ``input_ids`` and ``labels`` (aligned) of each example.
        pad_id: the padding token.
        rows: rows of the batch (the step's micro-batches).
        mask: add :func:`block_causal_mask` as ``attention_mask``. Without it the attention
            must isolate the documents from ``position_ids`` alone, which transformers'
            sdpa and eager attention do only with ``use_cache=False`` and no other mask.

    Example:
        >>> batch = flatten([{"input_ids": [5, 6], "labels": [5, 6]},
        ...                  {"input_ids": [7, 8, 9], "labels": [-100, 8, 9]}], 0, mask=False)
        >>> batch["position_ids"].tolist(), batch["labels"].tolist()
        ([[0, 1, 0, 1, 2]], [[-100, 6, -100, 8, 9]])
    """
    from transformers import DataCollatorWithFlattening

    if any("seq_lengths" in e for e in examples):
        raise ValueError(
            "flatten: the examples are rows that are already packed (they carry "
            "seq_lengths); DataCollatorWithFlattening would take each row for one document. "
            "Batch them with pack(...), which keeps each row whole."
        )
    collator = DataCollatorWithFlattening(return_tensors="pt")
    n = len(examples)
    groups = [examples[r * n // rows : (r + 1) * n // rows] for r in range(rows)]
    flat = [
        collator([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in g]) if g else None
        for g in groups
    ]
    length = max([1] + [f["input_ids"].shape[1] for f in flat if f is not None])
    ids = torch.full((rows, length), pad_id)
    labels = torch.full((rows, length), -100)
    positions = torch.zeros((rows, length), dtype=torch.long)
    for r, f in enumerate(flat):
        if f is not None:
            width = f["input_ids"].shape[1]
            ids[r, :width] = f["input_ids"][0]
            labels[r, :width] = f["labels"][0]
            positions[r, :width] = f["position_ids"][0]
    out = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if mask:
        out["attention_mask"] = block_causal_mask(positions)
    return out


# --------------------------------------------------------------------------- preference pairs


def write_preferences(path: str, n: int = 64, seed: int = 0) -> None:
    """``n`` preference pairs in TRL's conversational format: a ``prompt`` (a user turn, some
    after a system prompt), the right answer ``chosen`` and a wrong one ``rejected``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            question, answer = _task(rng)
            wrong = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            prompt = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.25 else []
            prompt.append({"role": "user", "content": question})
            pair = {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
            f.write(json.dumps(pair) + "\n")


def encode_preference(example: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` of one conversational pair, as TRL's
    ``DPOTrainer`` tokenizes it: the completions start where the prompt rendered with the
    generation prompt and each whole conversation diverge (the earlier of the two)."""
    prompt = _render(tokenizer, example["prompt"], add_generation_prompt=True)["input_ids"]
    chosen = _render(tokenizer, [*example["prompt"], *example["chosen"]])["input_ids"]
    rejected = _render(tokenizer, [*example["prompt"], *example["rejected"]])["input_ids"]
    start = min(_common(prompt, chosen), _common(prompt, rejected))
    return {
        "prompt_ids": list(prompt[:start]),
        "chosen_ids": list(chosen[start:]),
        "rejected_ids": list(rejected[start:]),
    }


def preference_batch(
    pairs: Sequence[dict[str, Any]], pad_id: int, max_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Chosen and rejected sequences of each pair, cut to ``max_length`` (TRL's
    ``keep_start``) and right-padded to one length: ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` (``[pairs, length]``; labels aligned with the
    ids, -100 on the prompt and padding). Row ``i`` of each is pair ``i``, so a batch split
    along dim 0 keeps pairs whole."""
    rows: dict[str, list[dict[str, list[int]]]] = {"chosen": [], "rejected": []}
    for p in pairs:
        for side in rows:
            ids = [*p["prompt_ids"], *p[f"{side}_ids"]]
            labels = [-100] * len(p["prompt_ids"]) + list(p[f"{side}_ids"])
            if max_length is not None:
                ids, labels = ids[:max_length], labels[:max_length]
            rows[side].append({"input_ids": ids, "labels": labels})
    length = max(len(r["input_ids"]) for side in rows.values() for r in side)
    out = {}
    for side, examples in rows.items():
        padded = pad(
            [*examples, {"input_ids": [pad_id] * length, "labels": [-100] * length}], pad_id
        )
        out[f"{side}_input_ids"] = padded["input_ids"][:-1]
        out[f"{side}_labels"] = padded["labels"][:-1]
    return out


class Batches:
    """This data rank's batches, epoch after epoch: a ``StatefulDataLoader`` over a list or a
    ``datasets.Dataset`` of examples with a ``DistributedSampler`` (shuffled per epoch with
    ``seed``), each batch collated by ``collate``. :meth:`position` and :meth:`restore` save and set where it is."""

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

        # A list, or a datasets.Dataset read row by row (its map-style __getitem__).
        data = examples if hasattr(examples, "column_names") else list(examples)
        self.sampler = DistributedSampler(
            data, num_replicas=ranks, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.loader = StatefulDataLoader(
            data, batch_size=batch_size, sampler=self.sampler, collate_fn=collate
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
