"""Context parallelism: a ``cp`` mesh axis splits each sequence; the loss and gradients are
those of transformers' own ``sdpa`` attention and ``labels=`` loss on one process, for a
Llama and a Qwen2 with packed documents and padding, on simulated meshes and gloo ranks
(dp × cp, cp × tp, dp × cp × tp), with accumulation and activation checkpointing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

from . import _cp_workers as W

TOL = 1e-5  # float64 models; the loss is float32, as transformers' loss upcasts to


def _close(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert abs(got["loss"] - ref["loss"]) < TOL, (got["loss"], ref["loss"])
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        err = float((got["grads"][name] - g).abs().max())
        assert err < TOL, (name, err)


# --------------------------------------------------------------------------- the layout


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    assert ff.cp.chunk_layout(8, 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    layout = ff.cp.chunk_layout(24, 4)
    assert sorted(i for r in layout for i in r) == list(range(24))
    # Causal attention costs each rank the same: the sum of (index + 1) over its tokens.
    assert len({sum(i + 1 for i in r) for r in layout}) == 1
    with pytest.raises(ValueError, match=r"multiple of 2·cp = 4"):
        ff.cp.chunk_layout(6, 2)


def test_local_batch_splits_sequences_over_cp_and_rows_over_dp() -> None:
    ids = torch.arange(2 * 8).reshape(2, 8)
    batch = {"input_ids": ids, "weight": torch.tensor([1.0, 2.0]), "scalar": torch.tensor(3)}
    with ff.simulated_mesh({"dp": 2, "cp": 2}) as mesh:
        share = ff.local_batch(batch, mesh)
        rows = ff.rank_values(share["input_ids"])
        weights = ff.rank_values(share["weight"])
    # rank = dp * 2 + cp: dp picks the row, cp the two chunks of it.
    assert [r.tolist() for r in rows] == [
        [[0, 1, 6, 7]],
        [[2, 3, 4, 5]],
        [[8, 9, 14, 15]],
        [[10, 11, 12, 13]],
    ]
    assert [w.tolist() for w in weights] == [[1.0], [1.0], [2.0], [2.0]]
    with ff.simulated_mesh({"dp": 2, "cp": 2}) as mesh:
        rows4 = torch.arange(4 * 8).reshape(4, 8)
        plain = ff.local_batch(rows4, mesh, sequence_axis=None)  # cp splits rows instead
        assert [r.tolist() for r in ff.rank_values(plain)] == [[r] for r in rows4.tolist()]


def test_pad_sequence_pads_each_key_as_a_context_parallel_batch_needs() -> None:
    batch = W.cp_batch(W.batch("padded", rows=2, length=13))
    padded = ff.cp.pad_sequence(batch, 4, pad_id=7)
    assert all(v.shape[1] == 16 for v in padded.values())
    assert padded["input_ids"][:, 13:].eq(7).all()
    assert padded["shift_labels"][:, 13:].eq(-100).all()
    assert padded["attention_mask"][:, 13:].eq(0).all()
    assert padded["position_ids"][0, 12:].tolist() == [12, 13, 14, 15]
    assert batch["input_ids"].shape[1] == 13  # pure


def test_a_sequence_that_does_not_split_evenly_is_refused_with_the_fix() -> None:
    batch = {"input_ids": torch.zeros(2, 10, dtype=torch.long)}
    with (
        ff.simulated_mesh({"cp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"batch\['input_ids'\] \(shape \(2, 10\)\) has a sequence of 10 tokens .* "
            r"2·cp = 4 .* Pad the global batch to 12 tokens .*ff\.cp\.pad_sequence",
        ),
    ):
        ff.local_batch(batch, mesh)


# --------------------------------------------------------------------------- exact, simulated

SIMULATED = [
    ("cp2", "llama", "full", {}),
    ("cp4", "llama", "packed", {}),
    ("dp2_cp2", "llama", "padded", {}),
    ("cp2", "qwen2", "packed", {}),
    ("cp2_tp2", "llama", "packed", {}),
    ("dp2_cp2_tp2", "qwen2", "padded", {}),
    ("cp2", "llama", "packed", {"accumulate": 2}),
    ("dp2_cp2", "qwen2", "packed", {"checkpointing": True}),
    ("dp2_cp2", "llama", "padded", {"zero2": True}),
    ("hsdp_cp2", "llama", "packed", {}),
    ("cp2", "mistral", "packed", {}),
    ("cp2", "gemma", "padded", {}),
    ("cp2", "llama", "packed", {"hf_checkpointing": True}),
    ("cp2", "llama", "left_padded", {}),
    ("dp2_cp2", "qwen2", "left_padded", {}),
]


@pytest.mark.parametrize(("layout", "arch", "kind", "options"), SIMULATED)
def test_simulated_step_equals_transformers_on_one_process(
    layout: str, arch: str, kind: str, options: dict[str, Any]
) -> None:
    ref = W.reference(arch, kind)
    m, b = W.inputs(arch, kind)
    with ff.simulated_mesh(W.LAYOUTS[layout]) as mesh:
        got = W.step(mesh, m, b, **options)
    _close(got, ref)


def test_qwen2_sliding_window_is_honoured_across_the_split() -> None:
    config = {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 0}
    ref = W.reference("qwen2", "packed", config=dict(config))
    full = W.reference("qwen2", "packed")
    assert abs(ref["loss"] - full["loss"]) > 1e-4  # the window changes the numbers
    m, b = W.inputs("qwen2", "packed", config=dict(config))
    with ff.simulated_mesh({"cp": 4}) as mesh:
        got = W.step(mesh, m, b)
    _close(got, ref)


def test_checkpointing_leaves_the_gradients_bitwise() -> None:
    m, b = W.inputs("llama", "packed")
    with ff.simulated_mesh({"cp": 2}) as mesh:
        plain = W.step(mesh, m, b)
        ckpt = W.step(mesh, m, b, checkpointing=True)
    for name, g in plain["grads"].items():
        assert torch.equal(g, ckpt["grads"][name]), name


def test_the_library_gpt_splits_too() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))
    model = model.double()
    data = torch.randint(0, 64, (2, 33))
    x, y = data[:, :-1], data[:, 1:]
    lm_loss(model(x), y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    with ff.simulated_mesh({"dp": 2, "cp": 2}) as mesh:
        sharded = ff.fsdp(model, mesh)

        def loss_fn(params: Any, b: tuple[torch.Tensor, torch.Tensor]) -> Any:
            return lm_loss(sharded.apply(params, b[0]), b[1])

        params = sharded.shard()
        opt = ff.sgd(1.0)
        state = ff.TrainState.create(params, opt, trainable=sharded)
        new, _ = ff.train_step(loss_fn, opt, model=sharded)(state, (x, y))
        before, after = ff.gather(params), ff.gather(new.params)
        for name, g in ref.items():
            got = ff.rank_values(before[name] - after[name])[0]
            assert float((got - g).abs().max()) < TOL, name


# --------------------------------------------------------------------------- refused


def test_a_transformers_model_with_another_attention_is_refused_before_it_runs() -> None:
    model = W.model("llama", "sdpa")
    with ff.simulated_mesh({"cp": 2}) as mesh:
        sharded = ff.fsdp(model, mesh)
        with pytest.raises(
            ValueError,
            match=r"LlamaForCausalLM uses attn_implementation='sdpa', which attends within "
            r"each rank's chunks only, but the 'cp' axis of Mesh\(cp=2\).* "
            r"attn_implementation=ff\.cp\.register_attention\(\)",
        ):
            sharded.apply(sharded.shard(), torch.zeros(1, 8, dtype=torch.long))


def test_a_model_that_never_calls_the_split_attention_is_refused() -> None:
    class Plain(torch.nn.Module):  # attention written with sdpa directly
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.proj(x)[:, None]
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    with ff.simulated_mesh({"cp": 2}) as mesh:
        sharded = ff.fsdp(Plain(), mesh)
        with pytest.raises(ValueError, match=r"Plain ran on .* none of its attention went through"):
            sharded.apply(sharded.shard(), torch.zeros(1, 4, 8))
        ok = ff.fsdp(Plain(), mesh, sequence_axis=None)  # cp then splits rows
        ok.apply(ok.shard(), torch.zeros(1, 4, 8))


def test_position_ids_that_restart_on_each_rank_are_refused() -> None:
    m, b = W.inputs("llama", "full")
    del b["position_ids"]  # transformers then numbers each rank's chunks from 0
    wrong = r"position_ids are not positions in the global"
    with ff.simulated_mesh({"cp": 2}) as mesh, pytest.raises(ValueError, match=wrong):
        W.step(mesh, m, b)


def test_global_batch_randomness_is_refused_under_a_sequence_split() -> None:
    with ff.simulated_mesh({"cp": 2}) as mesh:
        sharded = ff.fsdp(torch.nn.Linear(2, 2), mesh)
        with pytest.raises(ValueError, match=r"'cp' axis .* splits each sequence"):
            ff.train_step(lambda p, b: p, ff.sgd(0.1), model=sharded, randomness="global_batch")


def test_the_sequence_axis_must_be_a_data_axis() -> None:
    with (
        ff.simulated_mesh({"dp": 2, "cp": 2}) as mesh,
        pytest.raises(ValueError, match=r"sequence_axis='cp'.* one of the data axes \('dp',\)"),
    ):
        ff.fsdp(torch.nn.Linear(2, 2), mesh, data_axes=("dp",), sequence_axis="cp")


# --------------------------------------------------------------------------- real processes

RANKS_4 = [
    ("dp2_cp2", "llama", "packed", {}),
    ("cp2_tp2", "llama", "padded", {}),
    ("cp4", "qwen2", "packed", {"checkpointing": True, "accumulate": 2}),
]
RANKS_2 = [
    ("cp2", "qwen2", "padded", {}),
    ("cp2", "llama", "packed", {"checkpointing": True}),
    ("cp2", "llama", "packed", {"jit": True}),
]


@pytest.mark.parametrize(("world", "cases"), [(2, RANKS_2), (4, RANKS_4)])
def test_gloo_ranks_equal_transformers_on_one_process(pools: Any, world: int, cases: Any) -> None:
    per_rank = pools.run(world, W.on_ranks, cases)
    for layout, arch, kind, options in cases:
        key = f"{layout}/{arch}/{kind}/{sorted(options.items())}"
        ref = W.reference(arch, kind, length=W.GLOO_LENGTH)
        for got in per_rank:
            _close(got[key], ref)


def test_a_checkpoint_saved_on_dp_x_cp_resumes_on_dp_alone(pools: Any, tmp_path: Any) -> None:
    """The state does not depend on cp: saved on dp2 x cp2, the next step on dp2 (whole
    sequences per rank) or cp2 gives the same loss and parameters."""
    path = str(tmp_path / "ckpt")
    saved = pools.run(4, W.checkpoint_save, path)[0]
    for axes in ({"dp": 2}, {"cp": 2}):
        resumed = pools.run(2, W.checkpoint_resume, path, axes)[0]
        assert abs(resumed["loss"] - saved["loss"]) < TOL, axes
        for name, p in saved["params"].items():
            assert float((resumed["params"][name] - p).abs().max()) < TOL, (axes, name)
