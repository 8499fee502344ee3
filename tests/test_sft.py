"""Supervised fine-tuning data (``examples/sft_data.py``) against TRL 1.16's ``SFTTrainer``
on the same chat conversations, tokenizer and tiny Llama: the labels and trained positions
(every assistant turn, ``assistant_only_loss=True``; prompt-completion data), ``max_length``
truncation and dropping, best-fit-decreasing packing, and the step's loss and gradients,
padded and packed, on one process and on 2 gloo ranks. The sharded loader resumes exactly."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch

import functional_fsdp as ff

from . import _sft_workers as W

D = W.sft_data()


@pytest.fixture(scope="module")
def trl() -> dict[str, Any]:
    """TRL's prepared datasets, and its loss and gradients on all of them in one batch."""
    with warnings.catch_warnings():
        for message in TRL_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        return run_trl()


# Warnings TRL 1.16 and transformers 5.24 give on this setup, none about the numbers.
TRL_WARNINGS = [
    "`gradient_checkpointing` is deprecated",  # SFTConfig's default meets transformers 5.24's rename
    "`is_gradient_checkpointing` is deprecated",  # DPOTrainer reads the old name
]


def trl_step(dataset: Any, folder: str, **config: Any) -> dict[str, Any]:
    """``SFTTrainer``'s prepared dataset, and its loss and gradients on all of it in one batch
    (``config``: ``SFTConfig`` fields)."""
    from trl import SFTConfig, SFTTrainer

    tok = W.tokenizer()
    args = SFTConfig(output_dir=folder, report_to=[], use_cpu=True, **config)
    model = W.llama(W.vocab_size(tok))
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
    data = trainer.train_dataset
    batch = trainer.data_collator(list(data))
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"data": data, "loss": loss.detach(), "grads": grads, "batch": batch}


def prompt_completion() -> list[dict[str, Any]]:
    """The conversations split after their first user turn: the prompt, and the completion."""
    out = []
    for c in W.conversations():
        cut = next(i for i, m in enumerate(c) if m["role"] == "user") + 1
        out.append({"prompt": c[:cut], "completion": c[cut:]})
    return out


def run_trl() -> dict[str, Any]:
    from datasets import Dataset

    chats = Dataset.from_list([{"messages": c} for c in W.conversations()])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, packing in (("pad", False), ("pack", True)):
            out[name] = trl_step(
                chats, folder, assistant_only_loss=True, max_length=W.MAX_LENGTH, packing=packing
            )
        # prompt-completion data: the first turn of each conversation as the prompt
        split = prompt_completion()
        pc = trl_step(Dataset.from_list(split), folder, assistant_only_loss=True, max_length=None)
        out["prompt_completion"] = {"data": pc["data"], "examples": split}
    return out


def test_labels_are_trls_every_assistant_turn_trained(trl) -> None:
    """``assistant_only_loss=True``: every assistant turn; ``max_length`` keeps 40 tokens and
    the example with nothing left to train is dropped; with or without the template's
    ``{% generation %}`` markers."""
    theirs = trl["pad"]["data"]
    chats = W.conversations()
    assert len(theirs) == len(chats) - 1  # the over-long prompt is dropped
    ours = W.chat_examples()
    assert [e["input_ids"] for e in ours] == theirs["input_ids"]
    assert [e["labels"] for e in ours] == theirs["labels"]
    assert max(len(e["input_ids"]) for e in ours) == W.MAX_LENGTH
    multi = [e for e, c in zip(ours, chats) if sum(m["role"] == "assistant" for m in c) > 1]
    assert len(multi) >= 5 and all(
        len(D._runs([x != -100 for x in e["labels"]])) > 1 for e in multi
    )
    plain = W.tokenizer(D.PLAIN_TEMPLATE)  # no markers: turns found from rendered prefixes
    assert [D.encode({"messages": c}, plain) for c in chats] == [
        D.encode({"messages": c}, W.tokenizer()) for c in chats
    ]
    # TRL-prepared examples are taken as they are
    assert [D.encode(e, None) for e in theirs] == [
        {"input_ids": e["input_ids"], "labels": e["labels"]} for e in theirs
    ]


def test_last_turn_only_labels_a_subset() -> None:
    tok = W.tokenizer()
    for c in W.conversations():
        every = D.encode({"messages": c}, tok)["labels"]
        last = D.encode({"messages": c}, tok, turns="last")["labels"]
        runs = D._runs([x != -100 for x in every])
        assert D._runs([x != -100 for x in last]) == runs[-1:]


def test_prompt_completion_labels_are_trls(trl) -> None:
    tok = W.tokenizer()
    theirs = trl["prompt_completion"]["data"]
    ours = [D.encode(e, tok) for e in trl["prompt_completion"]["examples"]]
    assert [e["input_ids"] for e in ours] == theirs["input_ids"]
    assert [e["labels"] for e in ours] == theirs["labels"]


def test_best_fit_packing_is_trls(trl) -> None:
    """The same rows as TRL's ``packing_strategy="bfd"`` (documents reordered, the over-long
    one truncated), each document's first label -100 as TRL's padding-free collator sets it."""
    theirs = trl["pack"]["data"]
    batch = D.pack(W.chat_examples(packing=True), W.MAX_LENGTH, 0)
    assert len(batch["input_ids"]) == len(theirs)
    for r, row in enumerate(theirs):
        n = sum(row["seq_lengths"])
        assert batch["input_ids"][r, :n].tolist() == row["input_ids"]
        starts = torch.tensor(row["seq_lengths"]).cumsum(0)[:-1].tolist()
        assert (batch["position_ids"][r, :n] == 0).nonzero().flatten().tolist() == [0, *starts]
    flat = trl["pack"]["batch"]
    ours = torch.cat(
        [batch["labels"][r, : sum(row["seq_lengths"])] for r, row in enumerate(theirs)]
    )
    assert ours.tolist() == flat["labels"][0].tolist()
    in_order = D.pack(W.chat_examples(packing=True), W.MAX_LENGTH, 0, strategy="in_order")
    assert len(in_order["input_ids"]) > len(batch["input_ids"])  # best fit pads less
    with pytest.raises(ValueError, match=r"example \d+ has \d+ tokens, over the packed row's 40"):
        D.pack(W.chat_examples(packing=True), W.MAX_LENGTH, 0, overflow="error")


@pytest.mark.parametrize("batching", ["pad", "pack", "pack_positions"])
def test_loss_and_gradients_are_trls_on_one_process(trl, batching: str) -> None:
    """Padded, packed with the block-diagonal mask, and packed with ``position_ids`` alone
    (sdpa, ``use_cache=False``): TRL's loss and gradients (its padded and its padding-free
    packed batch)."""
    ref = trl["pad" if batching == "pad" else "pack"]
    mean, _, grads = W.one_process(batching)
    torch.testing.assert_close(mean, ref["loss"], rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trl["pack"]["loss"], trl["pad"]["loss"], rtol=1e-6, atol=1e-6)


def test_packed_and_padded_steps_on_two_ranks_are_trls(trl, pools) -> None:
    """Each rank pads or packs its own share (batch='local', 2 micro-batches): the step's
    loss and gradients are TRL's token mean of all the examples either way."""
    results = pools.run(2, W.gloo_pad_vs_pack)
    assert results[0]["pad"]["shape"] != results[0]["pack"]["shape"]
    for batching in ("pad", "pack"):
        got, ref = results[0][batching], trl[batching]
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6)


def tokenized_by_trl(dataset: Any, folder: str, **config: Any) -> Any:
    """The rows ``SFTTrainer``'s own preparation tokenizes, before it folds the masks into
    labels (``input_ids`` with ``assistant_masks``, and ``completion_mask`` for
    prompt-completion data): the output of its tokenizing ``Dataset.map``, recorded."""
    from unittest import mock

    from datasets import Dataset

    outputs: list[Any] = []
    original = Dataset.map

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs.append(original(self, *args, **kwargs))
        return outputs[-1]

    with mock.patch.object(Dataset, "map", recorded):
        trl_step(dataset, folder, **config)
    tokenized = next(d for d in outputs if "assistant_masks" in d.column_names)
    return tokenized.remove_columns(
        [c for c in tokenized.column_names if c in ("messages", "prompt", "completion")]
    )


@pytest.fixture(scope="module")
def trl_rows() -> dict[str, Any]:
    """Rows tokenized by TRL (chat data: ``assistant_masks``; prompt-completion data:
    ``completion_mask`` too), and ``SFTTrainer`` fed them as they are: padded, packed, and
    (prompt-completion) with ``completion_only_loss=True``, which reads ``completion_mask``."""
    from datasets import Dataset

    chats = Dataset.from_list([{"messages": c} for c in W.conversations()])
    split = Dataset.from_list(prompt_completion())
    out: dict[str, Any] = {}
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
        for message in TRL_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        rows = tokenized_by_trl(chats, folder, assistant_only_loss=True, max_length=None)
        masked = tokenized_by_trl(split, folder, assistant_only_loss=True, max_length=None)
        for name, data, config in (
            ("assistant_masks", rows, {}),
            ("assistant_masks_packed", rows, {"packing": True}),
            ("completion_mask", masked, {"completion_only_loss": True}),
        ):
            out[name] = trl_step(data, folder, max_length=W.MAX_LENGTH, **config)
            out[name]["rows"] = data
    return out


@pytest.mark.parametrize("rows", ["assistant_masks", "assistant_masks_packed", "completion_mask"])
def test_rows_tokenized_by_trl_are_taken_as_they_are(trl_rows, rows: str) -> None:
    """Rows with ``input_ids`` and TRL's masks, never re-tokenized (no tokenizer is passed):
    the labels, loss and gradients are those of ``SFTTrainer`` fed the same rows."""
    ref = trl_rows[rows]
    assert {"input_ids", "assistant_masks"} <= set(ref["rows"].column_names)
    assert (rows == "completion_mask") == ("completion_mask" in ref["rows"].column_names)
    packing = rows.endswith("packed")
    examples = list(D.prepare(ref["rows"], None, W.MAX_LENGTH, packing=packing))
    if not packing:
        assert [e["labels"] for e in examples] == ref["data"]["labels"]
    batch = D.pack(examples, W.MAX_LENGTH, 0) if packing else D.pad(examples, 0)
    mean, count, grads = W.loss_and_grads(batch, W.vocab_size(W.tokenizer()))
    assert int(count) == int((ref["batch"]["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(mean, ref["loss"], rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("documents", ["seq_lengths", "position_ids"])
@pytest.mark.parametrize("mask", [True, False], ids=["mask", "positions_alone"])
def test_rows_packed_by_trl_are_kept_whole(trl, documents: str, mask: bool) -> None:
    """``SFTTrainer``'s packed ``train_dataset`` (``input_ids``, ``labels``, ``seq_lengths``),
    or the same rows with ``position_ids`` as TRL's collator derives them: each row is kept
    as it is, each document gets its own positions; TRL's loss and gradients."""
    from datasets import Dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ref = trl["pack"]
    data = ref["data"]
    if documents == "position_ids":
        positions = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths(
            data["seq_lengths"]
        )
        data = Dataset.from_list(
            [
                {"input_ids": r["input_ids"], "labels": r["labels"], "position_ids": p.tolist()}
                for r, p in zip(data, positions)
            ]
        )
    examples = list(D.prepare(data, None, W.MAX_LENGTH))
    assert [e["seq_lengths"] for e in examples] == ref["data"]["seq_lengths"]
    batch = D.pack(examples, W.MAX_LENGTH, 0, mask=mask)
    for r, row in enumerate(ref["data"]):  # the rows as TRL packed them
        assert batch["input_ids"][r, : len(row["input_ids"])].tolist() == row["input_ids"]
    mean, _, grads = W.loss_and_grads(batch, W.vocab_size(W.tokenizer()))
    torch.testing.assert_close(mean, ref["loss"], rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][name], rtol=1e-5, atol=1e-6)


def test_the_sft_example_takes_a_trl_tokenized_file_as_it_is(trl_rows, tmp_path, monkeypatch):
    """``examples/finetune_sft.py --data`` with rows TRL tokenized (``input_ids`` and
    ``assistant_masks``): nothing is re-tokenized and TRL's labels come out; the model's
    vocabulary is ``--tokenizer``'s, or without one read from the data (its largest id + 1 is
    the padding id); a tokenizer smaller than the data's ids is refused. (The example trains on
    such a file under torchrun in ``tests/test_examples.py``.)"""
    import argparse
    import importlib.util
    import json

    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.syspath_prepend(str(W.EXAMPLES))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's model folders
    spec = importlib.util.spec_from_file_location("_finetune_sft", W.EXAMPLES / "finetune_sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ref = trl_rows["assistant_masks"]
    path = tmp_path / "trl.jsonl"
    ref["rows"].select_columns(["input_ids", "assistant_masks"]).to_json(str(path))
    largest = max(max(ids) for ids in ref["rows"]["input_ids"])
    tok = W.tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))

    args = argparse.Namespace(data=str(path), tokenizer=None, examples=0, seed=0)
    data, folder, tokenizer = example.prepare(args, 0)
    assert tokenizer is None
    assert AutoConfig.from_pretrained(folder).vocab_size == -(-(largest + 2) // 8) * 8
    assert example.pad_id_of(None, D.load(data)) == largest + 1
    examples = list(D.prepare(D.load(data), None, W.MAX_LENGTH))
    assert [e["labels"] for e in examples] == ref["data"]["labels"]

    args.tokenizer = str(tmp_path / "tok")  # the tokenizer that prepared the data
    _, folder, tokenizer = example.prepare(args, 0)
    assert tokenizer == args.tokenizer
    assert AutoConfig.from_pretrained(folder).vocab_size == W.vocab_size(tok)
    assert example.pad_id_of(AutoTokenizer.from_pretrained(tokenizer), None) == tok.pad_token_id

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, len(tok)], "assistant_masks": [0, 1]}) + "\n")
    args.data = str(bad)
    with pytest.raises(ValueError, match=rf"holds token id {len(tok)}, but --tokenizer .* has"):
        example.prepare(args, 0)


def test_packed_rows_are_refused_where_they_would_leak() -> None:
    rows = [D.prepared({"input_ids": [5, 6, 7], "labels": [5, 6, 7], "seq_lengths": [2, 1]})]
    with pytest.raises(ValueError, match=r"pad: the examples are rows that are already packed"):
        D.pad(rows, 0)
    with pytest.raises(ValueError, match=r"pack: row 0 is already packed .* over the row's 2"):
        D.pack(rows, 2, 0)
    with pytest.raises(ValueError, match=r"seq_lengths \[2, 2\] \(sum 4\)"):
        D.prepared({"input_ids": [5, 6, 7], "labels": [5, 6, 7], "seq_lengths": [2, 2]})
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        D.prepared({"input_ids": [5, 6, 7], "labels": [5, 6]})


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "positions_alone"])
def test_flattening_collator_gives_the_packed_loss(trl, mask: bool) -> None:
    """``DataCollatorWithFlattening`` one row per micro-batch (2 rows, documents in order,
    no fixed row length): each document starts at position 0 with its first label -100, and
    the loss and gradients are those of the best-fit packed rows with the block-diagonal
    mask, and TRL's on the same examples."""
    tok = W.tokenizer()
    examples = W.chat_examples()
    flat = D.flatten(examples, tok.pad_token_id, rows=2, mask=mask)
    assert flat["input_ids"].shape[0] == 2 and ("attention_mask" in flat) == mask
    real = flat["input_ids"] != tok.pad_token_id
    starts = (flat["position_ids"] == 0) & real
    half = len(examples) // 2
    assert starts.sum(1).tolist() == [half, len(examples) - half]  # one document each
    assert (flat["labels"][starts] == -100).all()
    packed = D.pack(examples, W.MAX_LENGTH, tok.pad_token_id)
    assert packed["input_ids"].shape[1] != flat["input_ids"].shape[1]
    ref_mean, ref_count, ref_grads = W.loss_and_grads(packed, W.vocab_size(tok))
    mean, count, grads = W.loss_and_grads(flat, W.vocab_size(tok))
    assert int(count) == int(ref_count)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean, trl["pad"]["loss"], rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="flatten: the examples are rows that are already packed"):
        D.flatten([{"input_ids": [1, 2], "labels": [1, 2], "seq_lengths": [1, 1]}], 0)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_which_attention_isolates_packed_documents_from_position_ids(attention: str) -> None:
    """What the guide says, measured (transformers 5.24, a Llama from a config, the packed
    chat rows): with ``position_ids`` alone, ``use_cache=False`` and no other mask, the loss
    is that of the explicit block-diagonal mask; with the cache on (a fresh ``LlamaConfig``'s
    default), or with a 2-D ``attention_mask`` beside the positions, documents see each
    other and the loss moves. The explicit mask gives the padded (one document per row) loss
    either way."""
    tok = W.tokenizer()
    vocab, pad_id = W.vocab_size(tok), tok.pad_token_id
    examples = W.chat_examples()
    masked = D.pack(examples, W.MAX_LENGTH, pad_id)
    alone = {k: v for k, v in masked.items() if k != "attention_mask"}
    two_d = {**alone, "attention_mask": torch.ones_like(alone["input_ids"])}

    def loss(batch: dict[str, torch.Tensor], use_cache: bool) -> torch.Tensor:
        model = W.llama(vocab, attention, use_cache)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            total, count = ff.causal_lm_loss(model(**inputs).logits, batch["labels"])
        return total / count

    padded = loss(D.pad(examples, pad_id), use_cache=False)
    for use_cache in (False, True):
        torch.testing.assert_close(loss(masked, use_cache), padded, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss(alone, use_cache=False), padded, rtol=1e-6, atol=1e-6)
    assert (loss(alone, use_cache=True) - padded).abs() > 1e-5  # documents leak
    assert (loss(two_d, use_cache=False) - padded).abs() > 1e-5  # the 2-D mask turns it off


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("rank", [0, 1])
def test_loader_resumes_exactly_across_epochs(rank: int) -> None:
    from datasets import Dataset

    examples = [{"input_ids": [i] * (1 + i % 5), "labels": [i] * (1 + i % 5)} for i in range(20)]

    def loader(data: Any) -> Any:
        return D.Batches(data, 3, lambda b: D.pad(b, 0), rank=rank, ranks=2, seed=7)

    run = loader(examples)
    seen = [next(run)["input_ids"] for _ in range(4)]  # an epoch is 3 batches per rank
    saved = run.position()
    rest = [next(run)["input_ids"] for _ in range(5)]
    for data in (examples, Dataset.from_list(examples)):  # a list, or a datasets.Dataset
        resumed = loader(data)
        resumed.restore(saved)
        got = [next(resumed)["input_ids"] for _ in rest]
        assert all(torch.equal(a, b) for a, b in zip(rest, got))
    # epochs are reshuffled, and the other rank reads other examples
    assert not torch.equal(seen[0], seen[3]) or not torch.equal(seen[1], rest[0])
