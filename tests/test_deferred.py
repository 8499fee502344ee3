"""Deferred initialisation from the meta device: ``init_sharded`` on real gloo processes.

Every result is compared with the same model built eagerly with the same seed: the sharded
parameters must be bitwise equal to ``ff.fsdp(eager_model, mesh).shard()`` (and, gathered,
to the eager parameters), the buffers equal to the eager buffers, and the generator left in
the state eager construction leaves it. Models: the library's GPT (tied head, its own
``apply(_init)``), a ``transformers`` Llama built from a config (tied and untied, rotary
buffers) and plain torch modules with running statistics.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functional_fsdp as ff
from functional_fsdp.fsdp.materialize import init_sharded, init_steps

from . import _deferred_workers as W

KINDS = ["gpt", "llama_tied", "llama", "convnet"]
MiB = 2**20


def _assert_matches_eager(result: dict, where: str) -> None:
    assert result["keys"], where
    assert result["local_mismatch"] == [], where
    assert result["full_mismatch"] == [], where
    assert result["buffer_mismatch"] == [], where
    assert result["rng_same"], where
    assert result["module_untouched"], where
    assert result.get("forward_equal", True), where
    assert result.get("loss_close", True), where


def _check_all_kinds(pools, world: int) -> list[dict]:
    results = []
    for kind in KINDS:
        for rank, result in enumerate(pools.run(world, W.init_matches_eager, kind, {"dp": world})):
            _assert_matches_eager(result, f"{kind} on dp={world}, rank {rank}: {result}")
            results.append(result)
    return results


# Ordered by world size: the session's gloo pool is replaced when the size changes.


def test_bitwise_equal_to_eager_construction_on_one_rank(pools):
    _check_all_kinds(pools, 1)


def test_fsdp2_meta_recipe_depends_on_the_mesh(pools):
    # torch FSDP2's recipe (fully_shard on meta, to_empty, reset_parameters, the model's
    # init) draws each rank's local shard: eager values on one rank, not on two.
    assert pools.run(1, W.fsdp2_meta_recipe, 1)[0]["mismatch"] == []
    mismatch = pools.run(2, W.fsdp2_meta_recipe, 2)[0]["mismatch"]
    assert "blocks.0.attn.wq.weight" in mismatch and "tok_emb.weight" in mismatch


def test_bitwise_equal_to_eager_construction_on_two_ranks(pools):
    results = dict(zip(KINDS, _check_all_kinds(pools, 2)[::2]))  # rank 0 of each kind
    assert results["llama_tied"]["buffers"] == [
        "model.rotary_emb.inv_freq",  # non-persistent, computed in __init__: meta on meta
        "model.rotary_emb.original_inv_freq",
    ]
    stats = results["convnet"]["buffers"]  # BatchNorm running statistics
    assert "layers.1.1.running_var" in stats and "layers.0.1.num_batches_tracked" in stats


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_allocated_peak_is_shards_plus_one_unit(pools, kind):
    """72-81 MiB of fp32 on 2 ranks, bytes allocated counted by a dispatch-mode tracker:
    at most Ψ/N + the largest unit + 15%, which a full copy (Ψ) would break."""
    results = pools.run(2, W.create_allocated, kind, kind == "gpt")
    psi, unit = results[0]["psi"], results[0]["largest_unit"]
    bound = (psi / 2 + unit) * 1.15
    assert psi > bound, "the model must be big enough that a full copy breaks the bound"
    for rank, r in enumerate(results):
        assert psi / 2 <= r["held"] <= psi / 2 + MiB  # this rank's shards (and padding)
        assert r["peak"] <= bound, f"rank {rank}: {r['peak'] / MiB:.1f} > {bound / MiB:.1f} MiB"
        assert r["peak"] >= unit  # the tracker sees a unit's full tensors being built
        if kind == "gpt":  # the same tracker sees eager construction's full copy
            assert r["eager_peak"] >= psi > bound


def test_error_when_nothing_initialises_a_parameter(pools):
    message = pools.run(2, W.init_error, "no_init")[0]
    assert message.startswith(
        "init_sharded: parameter '0.scale' (shape (4,), torch.float32) of Sequential is on "
        "the meta device and nothing initialises it: Scaled has no reset_parameters() and no "
        "init_fn wrote it."
    ), message
    with torch.device("meta"):
        model = nn.Sequential(W.Scaled(4), W.Scaled(4))
    with ff.simulated_mesh({"dp": 2}) as mesh:
        with pytest.raises(ValueError, match=r"parameter '0\.scale' .* Give Scaled a reset_par"):
            init_sharded(ff.fsdp(model, mesh))
        fill = lambda m: nn.init.ones_(m.scale) if isinstance(m, W.Scaled) else None  # noqa: E731
        params, _ = init_sharded(ff.fsdp(model, mesh), init_fn=fill)
        assert torch.equal(ff.rank_values(ff.gather(params)["1.scale"])[0], torch.ones(4))


def test_error_when_init_writes_another_unit(pools):
    message = pools.run(2, W.init_error, "other_unit")[0]
    assert message.startswith(
        "init_sharded: ResetsChildren.reset_parameters() at module '' wrote to a tensor of "
        "another unit (aten.zero_.default on a meta tensor of shape (4,))."
    ), message


def test_error_when_ranks_would_draw_from_different_generators(pools):
    # Each rank keeps its blocks of what its own generator draws: seeded differently, the
    # blocks would come from different models. A model that draws nothing may differ.
    for message in [
        *pools.run(2, W.init_seeded_per_rank, "draws"),
        *pools.run(2, W.init_seeded_per_rank, "llama"),
    ]:
        assert message == (
            "init_sharded: the ranks of Mesh(dp=2) start from different random-number "
            "generator states, and this model's initialisation draws random numbers: each rank "
            "would keep its blocks of a different model (and replicated values would differ "
            "between ranks). Seed every rank the same before calling it: torch.manual_seed(seed), "
            "one seed on every rank."
        )
    assert pools.run(2, W.init_seeded_per_rank, "no_draws") == ["no error", "no error"]


def test_init_steps_follow_eager_construction():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.MultiheadAttention(4, 2))
    steps = [(s.path, s.what) for s in init_steps(model, init_fn=lambda m: None)]
    assert steps[:3] == [
        ("0", "Linear.reset_parameters()"),
        ("1.out_proj", "NonDynamicallyQuantizableLinear.reset_parameters()"),
        ("1", "MultiheadAttention._reset_parameters()"),
    ]
    assert [p for p, _ in steps[3:]] == ["0", "1.out_proj", "1", ""]  # nn.Module.apply order


def test_bitwise_equal_to_eager_construction_on_four_ranks(pools):
    _check_all_kinds(pools, 4)


def test_bitwise_equal_on_2x2_meshes(pools):
    gpt_tp = pools.run(4, W.init_matches_eager, "gpt", {"dp": 2, "tp": 2}, tp=True)
    llama_hsdp = pools.run(4, W.init_matches_eager, "llama_tied", {"replicate": 2, "shard": 2})
    for rank, (a, b) in enumerate(zip(gpt_tp, llama_hsdp)):
        _assert_matches_eager(a, f"GPT FSDP+TP on dp=2 x tp=2, rank {rank}: {a}")
        _assert_matches_eager(b, f"Llama HSDP on 2x2, rank {rank}: {b}")


def test_shard_on_a_meta_module_initialises_unit_by_unit():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    with ff.simulated_mesh({"dp": 2}) as mesh:
        got = ff.gather(ff.fsdp(meta, mesh).shard())
        for name, p in eager.named_parameters():
            assert torch.equal(ff.rank_values(got[name])[0], p.detach())
        meta.register_buffer("table", torch.empty(3, device="meta"))
        with pytest.raises(ValueError, match=r"buffers included \(\['table'\]\).*ff\.init_sharded"):
            ff.fsdp(meta, mesh).shard()
