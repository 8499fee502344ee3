"""TP plans read off a transformers model's layers where it ships none (OPT, StableLM, GPT-2,
GPTBigCode, Falcon, Bloom).

The numbers are checked against one process in tests/test_zoo.py (the zoo's TP column);
here, what the derived plan holds and what gets no derived plan.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functional_fsdp as ff
from functional_fsdp.tp.hf_derive import AlibiHeads, PerHeadNorms, derive_plan

from ._zoo import ZOO

transformers = pytest.importorskip("transformers")


def _styles(plan, layer):
    return {k[len(layer) + 1 :]: v for k, v in plan.items() if k.startswith(layer + ".")}


def test_opt_plan_is_read_off_its_layers():
    plan = ff.hf_tp_plan(ZOO["opt"].build())
    layer = _styles(plan, "model.decoder.layers.1")
    assert layer["self_attn.q_proj"] == ff.ColwiseParallel(input="prepared", head_dim=8)
    assert layer["self_attn.out_proj"] == ff.RowwiseParallel()
    assert layer["fc1"] == ff.ColwiseParallel() and layer["fc2"] == ff.RowwiseParallel()
    # OPT reshapes with its global head count (q.view(bsz, -1, self.num_heads, head_dim)):
    # the attention's num_heads is per rank for the call.
    assert layer["self_attn"] == ff.PrepareInput(per_rank=("num_heads",))
    # The norms beside fc1/fc2 read the residual stream (replicated), and say so.
    assert layer["final_layer_norm"] == ff.LocalAttributes()
    assert plan["model.decoder.embed_tokens"] == ff.VocabParallelEmbedding()


def test_stablelm_per_head_norms_run_on_this_ranks_heads():
    plan = ff.hf_tp_plan(ZOO["stablelm"].build())
    layer = _styles(plan, "model.layers.0")
    assert layer["self_attn"] == ff.PrepareInput(per_rank=("num_heads", "num_key_value_heads"))
    assert layer["self_attn.q_layernorm"] == layer["self_attn.k_layernorm"] == PerHeadNorms()
    assert layer["mlp"] == ff.PrepareInput()


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)  # a fused projection: no role in its name
        self.o_proj = nn.Linear(8, 8)


def test_layers_whose_linears_do_not_tell_their_role_get_no_derived_plan():
    model = nn.Module()
    model.config = type("Config", (), {"num_hidden_layers": 2})()
    model.layers = nn.ModuleList([_Fused(), _Fused()])
    assert derive_plan(model, "") is None
    falcon = transformers.FalconForCausalLM(  # grouped [q.. k v] per key/value group
        transformers.FalconConfig(**{**ZOO["falcon"].options, "new_decoder_architecture": True})
    )
    with pytest.raises(ValueError, match=r"has no base_model_tp_plan: .*none can be read off"):
        ff.hf_tp_plan(falcon)
    falcon = transformers.FalconForCausalLM(  # ALiBi folded into a per-head attention mask
        transformers.FalconConfig(**{**ZOO["falcon"].options, "alibi": True})
    )
    with pytest.raises(ValueError, match=r"has no base_model_tp_plan: .*none can be read off"):
        ff.hf_tp_plan(falcon)


def test_gpt2_and_gpt_bigcode_fused_qkv_keep_this_ranks_heads():
    from functional_fsdp.tp.hf_derive import Conv1DColwise, Conv1DRowwise, FusedColwise

    gpt2 = _styles(ff.hf_tp_plan(ZOO["gpt2"].build()), "transformer.h.0")
    # GPT-2's c_attn is [q | k | v] (Conv1D): each rank keeps its heads of each part.
    assert gpt2["attn.c_attn"] == FusedColwise(parts=(32, 32, 32), split=(True, True, True))
    assert gpt2["mlp.c_fc"] == Conv1DColwise() and gpt2["mlp.c_proj"] == Conv1DRowwise()
    assert [n for n, _ in gpt2["attn"].per_rank] == ["split_size", "embed_dim", "num_heads"]
    bigcode = _styles(ff.hf_tp_plan(ZOO["gpt_bigcode"].build()), "transformer.h.0")
    # Multi-query: the single key/value head is read by every rank (its gradient summed).
    assert bigcode["attn.c_attn"] == FusedColwise(parts=(32, 8, 8), split=(True, False, False))
    assert bigcode["mlp.c_fc"] == ff.ColwiseParallel()


def test_falcon_multi_query_keeps_this_ranks_query_heads():
    from functional_fsdp.tp.hf_derive import FusedColwise

    falcon = _styles(ff.hf_tp_plan(ZOO["falcon"].build()), "transformer.h.0")
    assert falcon["self_attention.query_key_value"] == FusedColwise(
        parts=(32, 8, 8), split=(True, False, False)
    )
    assert falcon["self_attention"] == ff.LocalAttributes(("num_heads",))
    assert falcon["mlp.dense_4h_to_h"] == ff.RowwiseParallel()


def test_bloom_keeps_whole_heads_and_their_alibi_biases():
    model = ZOO["bloom"].build()
    bloom = _styles(ff.hf_tp_plan(model), "transformer.h.1")
    # query_key_value is [q, k, v] interleaved per head: whole heads (3 x 8 features) per rank.
    assert bloom["self_attention.query_key_value"] == ff.ColwiseParallel(head_dim=24)
    assert bloom["self_attention.dense"] == ff.RowwiseParallel()
    assert bloom["mlp.dense_h_to_4h"] == ff.ColwiseParallel()
    assert bloom["mlp.dense_4h_to_h"] == ff.RowwiseParallel()
    # The model builds ALiBi biases for its 4 heads; each rank's attention keeps its own.
    assert bloom["self_attention"] == AlibiHeads(heads=4)
    with ff.simulated_mesh({"tp": 2}) as mesh:
        wrap = AlibiHeads(heads=4).wrap(model.transformer.h[0].self_attention, mesh, "tp")
        alibi = torch.arange(2 * 4 * 3.0).reshape(2 * 4, 1, 3)  # [batch * heads, 1, keys]
        got = ff.rank_values(wrap(lambda *a, alibi: alibi)(None, alibi=alibi))
    by_head = alibi.reshape(2, 4, 1, 3)
    for rank, value in enumerate(got):
        torch.testing.assert_close(value, by_head[:, 2 * rank : 2 * rank + 2].reshape(4, 1, 3))


def test_bloom_without_its_alibi_biases_per_rank_is_refused_at_the_first_call():
    model = ZOO["bloom"].build()
    plan = ff.hf_tp_plan(model)
    attention = "transformer.h.0.self_attention"
    without = {**plan, attention: ff.LocalAttributes(("num_heads",))}
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        tp = ff.tensor_parallel(model, mesh, without)
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        with pytest.raises(
            ValueError,
            match=r"tensor_parallel: the plan gives BloomAttention "
            r"'transformer\.h\.0\.self_attention' a wrong result on Mesh\(dp=1, tp=2\)",
        ):
            f.apply(f.shard(), idx)
    with (
        ff.simulated_mesh({"tp": 3}) as mesh,
        pytest.raises(ValueError, match=r"tp=3 does not divide its 4 attention heads"),
    ):
        ff.tensor_parallel(model, mesh, plan)
