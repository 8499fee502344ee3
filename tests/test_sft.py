"""Supervised fine-tuning data (``examples/sft_data.py``): chat examples with the prompt
masked, padded or packed with per-document positions and a block-diagonal mask, give one
process's token mean, on one process and on 2 gloo ranks; the sharded loader resumes
exactly where it was."""

from __future__ import annotations

import pytest
import torch

from . import _sft_workers as W


def test_prompt_is_masked_and_the_answer_labelled() -> None:
    examples, _, _ = W.chat_examples(4)
    for e in examples:
        labels = torch.tensor(e["labels"])
        counted = (labels != -100).nonzero().flatten()
        assert len(e["input_ids"]) == len(e["labels"]) and len(counted) > 0
        # the prompt is unlabelled, the answer a contiguous run to the end
        assert counted.tolist() == list(range(counted[0].item(), len(labels)))
        assert counted[0] > 3


def test_packed_equals_padded_on_one_process() -> None:
    pad_sum, pad_count, pad_grads = W.one_process("pad")
    pack_sum, pack_count, pack_grads = W.one_process("pack")
    assert pad_count == pack_count
    torch.testing.assert_close(pack_sum, pad_sum, rtol=1e-5, atol=1e-5)
    for name, g in pad_grads.items():
        torch.testing.assert_close(pack_grads[name], g, rtol=1e-4, atol=1e-5)


def test_packed_equals_padded_on_two_ranks(pools) -> None:
    """Each rank pads or packs its own share (batch='local', 2 micro-batches): the step's
    loss and gradients are one process's token mean of all examples either way."""
    total, count, grads = W.one_process("pad")
    results = pools.run(2, W.gloo_pad_vs_pack)
    assert results[0]["pad"]["shape"] != results[0]["pack"]["shape"]
    for batching in ("pad", "pack"):
        got = results[0][batching]
        assert int(got["count"]) == int(count)
        torch.testing.assert_close(got["loss"], total / count, rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(got["grads"][name], g / count, rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("rank", [0, 1])
def test_loader_resumes_exactly_across_epochs(rank: int) -> None:
    D = W.sft_data()
    examples = [{"input_ids": [i] * (1 + i % 5), "labels": [i] * (1 + i % 5)} for i in range(20)]

    def loader() -> D.Batches:
        return D.Batches(examples, 3, lambda b: D.pad(b, 0), rank=rank, ranks=2, seed=7)

    run = loader()
    seen = [next(run)["input_ids"] for _ in range(4)]  # an epoch is 3 batches per rank
    saved = run.position()
    rest = [next(run)["input_ids"] for _ in range(5)]
    resumed = loader()
    resumed.restore(saved)
    assert all(torch.equal(a, b) for a, b in zip(rest, [next(resumed)["input_ids"] for _ in rest]))
    # epochs are reshuffled, and the other rank reads other examples
    assert not torch.equal(seen[0], seen[3]) or not torch.equal(seen[1], rest[0])
