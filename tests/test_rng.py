"""Randomness as an input, and activation checkpointing that replays its forward exactly.

Real gloo runs: gradients with ``Policy(activation_checkpointing=True)`` equal those without (bitwise) on
Hugging Face GPT-2 and Llama, the project's GPT and a peft LoRA model, with and without
dropout, in fp32 and bf16, on 1 and 2 ranks; on every architecture of the zoo with dropout
(and three under FSDP+TP); dropout masks under ``train_step`` differ
across data-parallel ranks and agree across tensor-parallel ranks; a simulated mesh draws
what the real ranks draw. The kill-and-resume tests with dropout are in test_reliability.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import functional_fsdp as ff

from . import _rng_workers as W

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing.*:FutureWarning",  # peft asks transformers
)


def _check_matrix(out: dict, ranks: int) -> None:
    assert len(out) >= 4 and len({name.split("-")[0] for name in out}) == 4
    for name, r in out.items():
        where = f"{name} on rank {ranks}"
        assert r["equal"] and r["max_diff"] == 0.0 and r["loss_equal"], (where, r)
        assert r["grads"] > 0
        if "-p0.1-" in name:
            assert r["key_matters"], (where, r)  # dropout is live: the replay was tested


# --------------------------------------------------------------------------- 2 ranks


def test_checkpointing_exact_two_ranks(pools):
    """Checkpoint on/off x dropout 0/0.1 x 4 models x fp32/bf16: bitwise equal gradients."""
    outs = pools.run(2, W.recompute_matrix, ["float32", "bfloat16"])
    for rank, out in enumerate(outs):
        assert len(out) == 16
        _check_matrix(out, rank)


def test_data_parallel_masks_independent_and_simulated_ranks_agree(pools):
    real = pools.run(2, W.dp_masks)
    for r in real:
        assert r["caller_restored"] and r["rng_kept"], r
        assert len(r["masks"]) == 8  # 2 steps x 2 micro-batches x 2 dropout calls
    masks0, masks1 = real[0]["masks"], real[1]["masks"]
    assert all(0.3 < m.float().mean() < 0.7 for m in masks0)  # p=0.5
    assert not any(torch.equal(a, b) for a, b in zip(masks0, masks1))  # across dp ranks
    # Each step and micro-batch has its own stream (same shapes, different masks).
    assert not torch.equal(masks0[0], masks0[2]) and not torch.equal(masks0[0], masks0[4])
    # A simulated mesh: each simulated rank draws bitwise what the real rank drew.
    simulated = W.dp_masks_simulated(2)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(simulated[rank], real[rank]["masks"]))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence"])
def test_tensor_parallel_ranks_share_replicated_masks_and_split_sequence_ones(
    pools, sequence_parallel
):
    """dp=1, tp=2: the residual stream's masks and draws made after each block's all-gather,
    gathered from both tp ranks.

    Replicated activations: the same mask on both ranks (the same values). Sequence-parallel
    (sharded) activations: each rank draws its own part of the sequence's mask, from its own
    stream; draws after a block's all-gather come from the common stream again.
    """
    out = pools.run(2, W.tp_masks, sequence_parallel)[0]
    length = 4 if sequence_parallel else 8
    assert out["shapes"] == [(4, length, 32)] * 2
    mine, theirs = out["all"]
    assert any(any(any(row) for row in m) for m in mine["masks"])  # something was dropped
    assert mine["draws"] == theirs["draws"]  # the common stream: equal across tp ranks
    assert mine["draws"][0] != mine["draws"][1]  # ... and advancing (block 0, block 1)
    if sequence_parallel:  # each rank's own part: no mask equals the other rank's
        assert all(a != b for a, b in zip(mine["masks"], theirs["masks"]))
    else:
        assert mine["masks"] == theirs["masks"]
    # Checkpointing under FSDP+TP: bitwise the same gradients, dropout on; and the backward
    # (recomputes included) leaves both streams where the forward left them.
    for r in pools.run(2, W.tp_recompute, sequence_parallel):
        assert r["equal"] and r["loss_equal"] and r["key_matters"], r
        assert not r["backward_draws"], r


def test_global_batch_randomness_draws_what_one_process_draws(pools):
    """randomness="global_batch" on 2 ranks: each rank's masks are its rows of the masks one
    process draws on the global batch, and the loss is that process's."""
    for r in pools.run(2, W.global_batch_masks):
        assert r["masks_equal"], r
        assert r["loss_diff"] < 1e-6, r
        assert all(0.3 < d < 0.7 for d in r["dropped"]), r


def test_checkpointing_exact_on_the_zoo(pools):
    """Every zoo architecture torch.func differentiates, with each dropout knob of its config
    (attention_dropout, resid_pdrop, hidden_dropout, ...) at 0.1, fp32, dp=2: checkpointed gradients bitwise those without; and FSDP+TP (dp=1 x
    tp=2) from the model's own plan on three of them, with sequence parallelism on two."""
    from ._zoo import ZOO

    names = [n for n, a in ZOO.items() if a.torch_func]
    skipped = {n: a.why_not for n, a in ZOO.items() if not a.torch_func}
    assert set(skipped) == {"bloom"}, skipped  # its GELU's autograd.Function: see _zoo.py
    tp_names = ["llama", "qwen3", "phi"]
    # Sequence parallel, dropout in both streams (attention: common; residual: sequence).
    sp_names = ["starcoder2", "phi3"]
    for rank, out in enumerate(pools.run(2, W.zoo_recompute, names, tp_names, sp_names)):
        assert len(out) == len(names) + len(tp_names) + len(sp_names)
        for name, r in out.items():
            where = f"{name} on rank {rank}"
            assert r["equal"] and r["max_diff"] == 0.0 and r["loss_equal"], (where, r)
            assert r["knobs"] and r["grads"] > 0, (where, r)  # every config has a dropout
            assert r["key_matters"], (where, r)  # dropout is live: the replay was tested


# --------------------------------------------------------------------------- 1 rank


def test_checkpointing_exact_one_rank(pools):
    """Dropout on, fp32 (the rest of the matrix runs on 2 ranks, to keep the suite short)."""
    (out,) = pools.run(1, W.recompute_matrix, ["float32"], (0.1,))
    assert len(out) == 4
    _check_matrix(out, 0)


# --------------------------------------------------------------------------- one process


def test_keys_fold_in_and_errors():
    k = ff.rng_key(3)
    assert k.dtype == torch.int64 and k.shape == (2,)
    assert torch.equal(ff.fold_in(k, 5), ff.fold_in(ff.rng_key(3), 5))
    folded = {tuple(ff.fold_in(k, i).tolist()) for i in range(100)}
    assert len(folded) == 100 and tuple(k.tolist()) not in folded
    assert not torch.equal(ff.fold_in(ff.fold_in(k, 1), 2), ff.fold_in(ff.fold_in(k, 2), 1))
    with pytest.raises(TypeError, match=r"rng_key: seed must be an int, got float 1\.5"):
        ff.rng_key(1.5)
    with pytest.raises(TypeError, match=r"fold_in: .*got a float32 tensor of shape \(2,\)"):
        ff.fold_in(torch.zeros(2), 1)
    with pytest.raises(TypeError, match=r"TrainState.create: rng must be an int seed, a key"):
        ff.TrainState.create({"w": torch.ones(2)}, ff.sgd(0.1), rng="0")
    with pytest.raises(TypeError, match=r"TrainState.create\(rng=...\): a random key is the"):
        ff.TrainState.create({"w": torch.ones(2)}, ff.sgd(0.1), rng=torch.zeros(3))


def test_seeded_restores_the_callers_generator():
    torch.manual_seed(11)
    before = torch.get_rng_state()
    with ff.seeded(ff.rng_key(0)):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with ff.seeded(ff.rng_key(0)):
        assert torch.equal(a, torch.rand(3))
    with pytest.raises(RuntimeError), ff.seeded(ff.rng_key(0)):
        torch.rand(1)
        raise RuntimeError
    assert torch.equal(torch.get_rng_state(), before)  # also after an exception


def _dropout_step(rng):
    opt = ff.sgd(0.0)
    step = ff.train_step(lambda p, b: nn.functional.dropout(p["w"] * b, 0.5).sum(), opt,
                         batch="local")  # fmt: skip
    state = ff.TrainState.create({"w": torch.ones(64)}, opt, rng=rng)
    return step, state


def test_train_step_draws_from_the_key_and_leaves_the_caller_alone():
    step, state = _dropout_step(5)
    torch.manual_seed(0)
    caller = torch.get_rng_state()
    _, m1 = step(state, torch.ones(64))
    assert torch.equal(torch.get_rng_state(), caller)
    torch.manual_seed(123)  # the caller's generator does not matter
    _, m2 = step(state, torch.ones(64))
    assert torch.equal(m1["loss"], m2["loss"])
    state2, _ = step(state, torch.ones(64))
    _, m3 = step(state2, torch.ones(64))  # the next step: another mask
    assert not torch.equal(m1["loss"], m3["loss"])
    _, m4 = _dropout_step(6)[0](state, torch.ones(64))  # a state's own key decides
    assert torch.equal(m4["loss"], m1["loss"])
    _, m5 = step(_dropout_step(6)[1], torch.ones(64))
    assert not torch.equal(m5["loss"], m1["loss"])
    # rng=None: no key, the step draws from the caller's generator as it is.
    plain, none_state = _dropout_step(None)
    assert none_state.rng is None
    torch.manual_seed(1)
    _, a = plain(none_state, torch.ones(64))
    torch.manual_seed(1)
    _, b = plain(none_state, torch.ones(64))
    assert torch.equal(a["loss"], b["loss"])


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    note: str


class _KV:
    """A cache object that pytrees do not see into (as transformers' ``DynamicCache``)."""

    def __init__(self) -> None:
        self.entries: dict[int, list[torch.Tensor]] = {}


class _Appends(nn.Module):
    """A unit that appends to its entry of a mutable keyword input and reads the entry (as a
    layer of a KV cache does); run twice on one cache, it would see its entry twice."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index, self.lin = index, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, cache: _KV, scale: float) -> _Out:
        mine = cache.entries.setdefault(self.index, [])
        mine.append(self.lin(x))
        h = torch.stack(mine).sum(0) * scale
        return _Out(x + nn.functional.dropout(h, 0.5), note=f"{len(mine)} entry")


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Appends(i) for i in range(2))

    def forward(self, x: torch.Tensor, cache: _KV) -> tuple[torch.Tensor, str]:
        notes = []
        for block in self.blocks:
            out = block(x, cache=cache, scale=0.5)
            x = out.y
            notes.append(out.note)
        return x, " ".join(notes)


def test_recompute_replays_mutated_keyword_inputs_and_dataclass_outputs():
    """Keyword and non-tensor inputs, a dataclass output; the cache is appended to by the
    forward only (the recompute works on a snapshot of it), with dropout (simulated mesh)."""
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(3, 4)
    grads, caches = {}, {}
    with ff.simulated_mesh({"dp": 2}) as mesh:
        for ck in (False, True):
            sm = ff.fsdp(model, mesh, policy=ff.Policy(activation_checkpointing=ck))
            cache = _KV()

            def loss(p, cache=cache, sm=sm):
                y, note = sm.apply(p, x, cache)
                assert note == "1 entry 1 entry"  # a dataclass output's str round-trips
                return y.sum()

            with ff.seeded(ff.rng_key(0), mesh=mesh, axes=("dp",)):
                g = torch.func.grad(loss)(sm.shard())
            grads[ck], caches[ck] = ff.gather(g), {k: len(v) for k, v in cache.entries.items()}
    assert caches[False] == caches[True] == {0: 1, 1: 1}  # the recompute left it alone
    assert all(torch.equal(grads[False][k], grads[True][k]) for k in grads[False])


def test_global_batch_randomness_errors():
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        sm = ff.fsdp(nn.Linear(4, 4), mesh)
        with pytest.raises(ValueError, match=r"supports data-parallel meshes only; the mesh"):
            ff.train_step(lambda p, b: b, ff.sgd(0.1), model=sm, randomness="global_batch")
        with pytest.raises(ValueError, match=r"accumulate=2\): global-batch randomness .* needs "):
            ff.train_step(
                lambda p, b: b, ff.sgd(0.1), model=sm, accumulate=2, randomness="global_batch"
            )
    with pytest.raises(ValueError, match=r"needs model=ff.fsdp\(...\): it draws for the global"):
        ff.train_step(lambda p, b: b, ff.sgd(0.1), batch="local", randomness="global_batch")
    with pytest.raises(ValueError, match=r"randomness must be 'per_rank' or 'global_batch'"):
        ff.train_step(lambda p, b: b, ff.sgd(0.1), batch="local", randomness="global")
