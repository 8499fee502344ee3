"""A tensor-parallel plan is checked against the unsharded blocks at the first call: a wrong
plan raises naming the block and a fix that was tried, instead of training on a wrong loss."""

from __future__ import annotations

import re

import pytest

import functional_fsdp as ff

from . import _tp_verify_workers as W

HEADS_FIX = (
    r"give 'layers\.0\.attn' \(TinyAttention\) LocalAttributes\(per_rank=\('n_heads',\)\) "
    r"in the plan: its code reads the global n_heads=4, but each of the 2 ranks holds 1/2 of "
    r"the heads"
)
WRONG = (
    r"tensor_parallel: the plan gives {cls} '{path}' a wrong result on Mesh\({mesh}\): "
    r"checked once against the unsharded module on the first call's input, {how}\. Its "
    r"styles: .*The fix that makes it match \(tried on the same input\): {fix}"
)


def _heads(mesh: str, how: str) -> str:
    return WRONG.format(
        cls="TinyAttention", path=r"layers\.0\.attn", mesh=mesh, how=how, fix=HEADS_FIX
    )


# -1 for the head size: no error without the check, a wrong loss. d_head: a failed view.
SPLIT = r"its output differs by \S+ \(relative; tolerance 1e-06\)"
VIEW = r"it raises RuntimeError: shape '\[\d+, 8, 4, 8\]' is invalid for input of size \d+"
STYLE_FIX = (
    r"give 'layers\.0\.mlp\.up' ColwiseParallel\(\) instead of RowwiseParallel, "
    r"'layers\.0\.mlp\.down' RowwiseParallel\(\) instead of ColwiseParallel"
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4], ids=["dp=1,tp=2", "dp=2,tp=2"])
def test_gloo_wrong_plans_raise_and_the_fix_trains_the_reference_loss(pools, world):
    mesh = f"dp={world // 2}, tp=2"
    results = pools.run(world, W.gloo_plan_checks)
    for result in results:
        assert result["heads_False"] is not None, "a global head count trained silently"
        assert pytest.approx(result["unchecked_loss"], abs=1e-4) != result["reference"]
        assert re.search(_heads(mesh, SPLIT), result["heads_False"]), result["heads_False"]
        assert re.search(_heads(mesh, VIEW), result["heads_True"]), result["heads_True"]
        style = WRONG.format(
            cls="TinyMLP",
            path=r"layers\.0\.mlp",
            mesh=mesh,
            how=r"it raises RuntimeError: mat1 and mat2 shapes cannot be multiplied .*",
            fix=STYLE_FIX,
        )
        assert re.search(style, result["style"]), result["style"]
        assert abs(result["loss"] - result["reference"]) < 1e-5, result
    print(f"first call on {mesh}, checked: {results[0]['seconds']:.3f} s")


def test_simulated_head_count_hint_through_a_module_dict():
    data = W.batch()  # outside the simulated mesh: random numbers there differ per rank
    model = W.tiny_lm()
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        tp = ff.tensor_parallel(model, mesh, W.tiny_plan())
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        params = f.shard()
        for _ in range(2):  # a failed check is not forgotten: the next call raises too
            with pytest.raises(ValueError, match=_heads(r"dp=2, tp=2", SPLIT)):
                f.apply(params, data[0])
        # Turned off, the same plan trains on a wrong loss without a word.
        _, loss = W.loss_of(model, mesh, W.tiny_plan(), data, verify=False)
        _, fixed = W.loss_of(model, mesh, W.tiny_plan(per_rank=True), data)
    reference = W.reference_loss(model, data)
    assert abs(ff.rank_values(loss)[0].item() - reference) > 1e-4
    assert abs(ff.rank_values(fixed)[0].item() - reference) < 1e-5
    assert model.layers[0].attn.n_heads == W.HEADS  # the user's module is unchanged


def test_reshape_hint_without_the_check_names_the_module_holding_the_head_count():
    data = W.batch()
    model = W.tiny_lm(explicit_head_dim=True)
    with (
        ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=(
                r"tensor_parallel: TinyAttention 'layers\.0\.attn' failed to reshape on tp=2: .*"
                r"give 'layers\.0\.attn' LocalAttributes\(per_rank=\('n_heads',\)\) in the plan"
            ),
        ),
    ):
        W.loss_of(model, mesh, W.tiny_plan(), data, verify=False)


def test_each_distinct_block_is_checked_once_per_plan():
    data = W.batch()
    model = W.tiny_lm(layers=3)
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        tp = ff.tensor_parallel(model, mesh, W.tiny_plan(per_rank=True))
        assert tp.blocks == tuple(f"layers.{i}.{m}" for i in range(3) for m in ("attn", "mlp"))
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        params = f.shard()
        f.apply(params, data[0])
        f.apply(params, data[0])
        # The attention and the MLP of layer 0 stand for all three layers, checked once.
        assert tp.checks.checked == ["layers.0.attn", "layers.0.mlp"]
        assert tp.checks.seconds > 0
        assert ff.tensor_parallel(model, mesh, W.tiny_plan(), verify=False).blocks == ()


def test_llama_with_a_wrong_style_raises_naming_the_mlp_and_the_fix():
    pytest.importorskip("transformers")
    from functional_fsdp.models import llama_plan

    from . import _tp_hf_workers as H

    model = H.new_llama()
    idx, tgt = H.batch()
    plan = {**llama_plan(model.config), "model.layers.*.mlp.gate_proj": ff.RowwiseParallel()}
    with (
        ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=(
                r"the plan gives LlamaMLP 'model\.layers\.0\.mlp' a wrong result on "
                r"Mesh\(dp=1, tp=2\).*give 'model\.layers\.0\.mlp\.gate_proj' "
                r"ColwiseParallel\(\) instead of RowwiseParallel"
            ),
        ),
    ):
        H.ours(model, mesh, plan, idx, tgt)


def test_gpt_plan_checks_its_embedding_attention_and_mlp():
    from functional_fsdp.models import GPT, GPTConfig, gpt_plan

    cfg = GPTConfig()
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        tp = ff.tensor_parallel(GPT(cfg), mesh, gpt_plan(cfg))
    assert tp.blocks[:3] == ("blocks.0.attn", "blocks.0.mlp", "blocks.1.attn")
    assert "tok_emb" in tp.blocks
    assert "" not in tp.blocks  # the head's vocab-sharded logits go to the loss


def test_a_block_whose_input_differs_between_tp_ranks_is_skipped_not_judged():
    model = W.tiny_lm()
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        data = W.batch()  # drawn on the simulated mesh: each rank's differs
        tp = ff.tensor_parallel(model, mesh, W.tiny_plan())
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        f.apply(f.shard(), data[0])
    assert tp.checks.checked == []
    assert ("layers.0.attn", "its input differs between tp ranks") in tp.checks.skipped
