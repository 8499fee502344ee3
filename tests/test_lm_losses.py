"""Hugging Face's label convention: ``ff.causal_lm_loss`` (and the guide's ``loss_fn``) fed
transformers-style labels is the model's own ``labels=`` loss, vocabulary-parallel too;
labels shifted by hand are refused with the convention named; which attention
implementations isolate packed documents from ``position_ids`` alone."""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff

from ._hf import tiny_llama_config


def llama(**overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (3, 10), generator=g)
    labels = ids.clone()  # transformers-style: aligned with input_ids
    labels[:, :4] = -100  # a prompt
    labels[2, 7:] = -100  # padding
    return ids, labels


def test_the_guides_loss_is_the_models_own_labels_loss() -> None:
    model = llama()
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    total, count = ff.causal_lm_loss(out.logits, labels)
    torch.testing.assert_close(total / count, out.loss)
    assert int(count) == int((labels[:, 1:] != -100).sum())
    # the same through transformers' shift_labels=
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    again = ff.causal_lm_loss(out.logits, shift_labels=shifted)
    torch.testing.assert_close(again.sum, total)
    # each row's log-probability of its labelled tokens
    logps = ff.sequence_logps(out.logits, labels)
    per_token = out.logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logps, (per_token * (labels[:, 1:] != -100)).sum(-1))


def test_vocabulary_parallel_under_tp() -> None:
    model = llama()
    ids, labels = batch()
    logits = model(input_ids=ids).logits.detach()
    expected = ff.causal_lm_loss(logits, labels)
    with ff.simulated_mesh({"tp": 2}) as mesh:
        local = ff.shard(logits, mesh, ff.P(None, None, "tp")).local
        got = ff.causal_lm_loss(local, labels, mesh=mesh)
        logps = ff.sequence_logps(local, labels, mesh=mesh)
        total, count = ff.rank_values(got.sum)[0], ff.rank_values(got.count)[0]
        logps = ff.rank_values(logps)[1]
    torch.testing.assert_close(total, expected.sum)
    assert int(count) == int(expected.count)
    torch.testing.assert_close(logps, ff.sequence_logps(logits, labels))


def test_labels_shifted_by_hand_are_refused() -> None:
    logits = torch.randn(2, 10, 96)  # of all 10 input ids
    ids = torch.randint(0, 96, (2, 10))
    with pytest.raises(ValueError, match=r"labels has shape \(2, 9\) but the logits.*aligned with"):
        ff.causal_lm_loss(logits, ids[:, 1:])
    with pytest.raises(ValueError, match="not both"):
        ff.causal_lm_loss(logits, ids[:, 1:], shift_labels=ids[:, 1:])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_position_ids_alone_isolate_documents_without_the_cache(attention: str) -> None:
    """Two documents packed in one row with per-document ``position_ids`` and no mask: with
    ``use_cache=False`` their logits are those of each document alone (transformers 5.24's
    sdpa and eager attention derive the block-diagonal mask from ``position_ids``); with the
    cache on (a fresh ``LlamaConfig``'s default), the second document sees the first."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 96, (1, 7), generator=g), torch.randint(1, 96, (1, 5), generator=g)
    row, positions = torch.cat([a, b], 1), torch.cat([torch.arange(7), torch.arange(5)])[None]
    model = llama(attn_implementation=attention)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits
        cached = model(input_ids=row, position_ids=positions, use_cache=True).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (cached[:, 7:] - alone[:, 7:]).abs().max() > 1e-3
