"""The zoo of ``transformers`` causal LMs (tests/_zoo.py): FSDP, LoRA training and FSDP + TP
from the model's own plan against one process, on real gloo ranks; and the errors that keep a
split tensor from meeting code that expects the whole one silently.

Tolerances (float32): losses within 1e-5; gradients within 1e-5 of the largest gradient of
each tensor (or absolutely, below 1); LoRA parameters after ``STEPS`` AdamW steps within
1e-4 (AdamW divides by the root of the second moment, so a rounding-level gradient
difference moves a parameter by up to a few lr * 1e-4 where gradients are near zero).
"""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import llama_plan

from . import _tp_hf_workers as W
from . import _zoo_workers as Z
from ._zoo import ZOO

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TOL, LORA_PARAM_TOL = 1e-5, 1e-4
RUNS = [n for n, a in ZOO.items() if a.torch_func]
BROKEN = [n for n, a in ZOO.items() if not a.torch_func]
FEW = ["gemma", "qwen2_moe", "gpt2"]  # tied and scaled, MoE, uneven vocabulary
SEQUENCE_PARALLEL = [
    n for n in RUNS if ZOO[n].tp_plan and ZOO[n].sequence_parallel and not ZOO[n].moe
]


def _close(result: dict, norm: float = 0.05) -> None:
    assert "error" not in result, result
    assert result["loss_diff"] < TOL, result
    assert result["grad_err"] < TOL, result
    assert result["grad_norm"] > norm, result  # the comparison is not vacuous


@pytest.fixture(scope="module")
def two_ranks(pools):
    """Every model once per rank: FSDP and LoRA (full training for MoE) on dp=2, FSDP + TP on
    dp=1 x tp=2 (with and without sequence parallelism; all-reduces counted on two; on plain
    autograd for the models torch.func cannot differentiate)."""
    modes = ("fsdp", "lora", "train", "tp", "tp_sp", "tp_comms", "autograd", "tp_default_experts")
    return pools.run(2, Z.zoo_checks, list(ZOO), modes)


@pytest.fixture(scope="module")
def four_ranks(pools):
    """A few models on dp=2 x tp=2: logits split and gathered, and with LoRA adapters."""
    return pools.run(4, Z.zoo_checks, FEW, ("tp", "tp_gathered", "lora_tp"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RUNS)
def test_fsdp_matches_one_process(two_ranks, name):
    for rank in two_ranks:
        _close(rank[name]["fsdp"])
        assert rank[name]["fsdp"]["grads"] == rank[name]["fsdp"]["parameters"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RUNS)
def test_lora_training_matches_torch_adamw(two_ranks, name):
    for rank in two_ranks:
        _trained(rank[name]["lora"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n, a in ZOO.items() if a.moe])
def test_moe_full_training_matches_torch_adamw(two_ranks, name):
    # Every parameter, expert weights (3-D, sharded over dp on the expert dim) and router too.
    for rank in two_ranks:
        _trained(rank[name]["train"])
        assert rank[name]["train"]["trainable"] == rank[name]["fsdp"]["parameters"]


def _trained(result: dict) -> None:
    assert "error" not in result, result
    assert result["loss_diff"] < TOL, result
    assert result["param_diff"] < LORA_PARAM_TOL, result
    assert result["moved"] > 100 * LORA_PARAM_TOL, result  # the parameters trained
    assert result["trainable"] >= 8, result


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RUNS)
def test_fsdp_tp_from_the_models_plan_matches_one_process(two_ranks, name):
    for rank in two_ranks:
        _close(rank[name]["tp"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SEQUENCE_PARALLEL)
def test_sequence_parallel_from_the_models_plan_matches_one_process(two_ranks, name):
    for rank in two_ranks:
        _close(rank[name]["tp_sp"])


@pytest.mark.multiprocess
def test_sequence_parallel_refuses_what_it_cannot_place(two_ranks):
    for rank in two_ranks:
        for name in (n for n, a in ZOO.items() if a.moe):
            assert "ExpertParallel), which need every token" in rank[name]["tp_sp"]["error"]
        for name in (n for n in RUNS if not ZOO[n].tp_plan):  # only the vocabulary is split
            assert "does not name one list of decoder layers" in rank[name]["tp_sp"]["error"]
        for name in (n for n in RUNS if ZOO[n].tp_plan and not ZOO[n].sequence_parallel):
            assert "Use sequence_parallel=False" in rank[name]["tp_sp"]["error"]


@pytest.mark.multiprocess
def test_one_backward_all_reduce_per_block(two_ranks):
    # Backward all-reduces over tp in one step: one for each attention's input (q, k and v
    # share it), one for each MLP's, one for the head's; per linear, one for each of q, k, v
    # (and gate, up: Llama's MLP has two colwise linears, Phi's one).
    colwise = {"llama": (3, 2), "phi": (3, 1)}
    for rank in two_ranks:
        for name in Z.COMMS:
            result = rank[name]["tp_comms"]
            assert "error" not in result, result
            layers, (attention, mlp) = result["layers"], colwise[name]
            assert len(result["blocks"]) == 2 * layers, result
            assert result["shared"] == 2 * layers + 1, result
            assert result["per_linear"] == (attention + mlp) * layers + 1, result


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", BROKEN)
def test_models_torch_func_cannot_differentiate_raise_under_it_and_train_on_autograd(
    two_ranks, name
):
    for rank in two_ranks:
        for mode in ("fsdp", "tp"):  # torch.func.grad called directly: never a number
            assert "error" in rank[name][mode], rank[name][mode]
        _trained(rank[name]["lora"])  # train_step: engine="auto" falls back to autograd


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", BROKEN)
def test_models_torch_func_cannot_differentiate_match_one_process_on_autograd(two_ranks, name):
    # Gradients from plain autograd on both sides: FSDP (dp=2), FSDP + TP from the derived
    # plan (dp=1 x tp=2) and LoRA + TP. Bloom: ALiBi biases cut to each rank's heads.
    for rank in two_ranks:
        for mode in ("fsdp", "tp"):
            _close(rank[name]["autograd"][mode])
        _close(rank[name]["autograd"]["lora_tp"], norm=0.02)  # adapters: 0.029 on Bloom


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FEW)
def test_fsdp_tp_on_2x2_matches_one_process(four_ranks, name):
    for rank in four_ranks:
        _close(rank[name]["tp"])
        _close(rank[name]["tp_gathered"])
        _close(rank[name]["lora_tp"])  # peft LoRA layers split like their base layers


# --------------------------------------------------------------------------- simulated


def _tp_errors(model, plan, loss_parallel=True, axes=None):
    idx, tgt = Z.batch(ZOO["llama"])
    want = W.reference(model, idx, tgt)
    with ff.simulated_mesh(axes or {"dp": 1, "tp": 2}) as mesh:
        got = W.ours(model, mesh, plan, idx, tgt, loss_parallel=loss_parallel)
    return W.errors(got, want)


def test_gemma_with_the_llama_plan_matches_one_process():
    # The user path: Llama's module names, a tied head and an embedding scaled by
    # sqrt(hidden) in its own forward, which the vocab-parallel embedding used to skip.
    model = ZOO["gemma"].build()
    _close(_tp_errors(model, llama_plan(model.config)))


@pytest.mark.parametrize("name", ["olmo2", "qwen3"])
def test_a_norm_beside_split_outputs_without_a_style_raises(name):
    # OLMo-2 normalises q over the whole projection (shapes would not fit); Qwen3 per head
    # (the norm's gradient would be partial on each rank). Both raise at plan time.
    model = ZOO[name].build()
    with (
        ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"tensor_parallel: module 'model\.layers\.0\.self_attn\.q_norm' \(\w+RMSNorm, "
            r"parameters \[\('weight', \((8|32),\)\)\]\) has no plan entry, but sits beside "
            r"colwise linears \['q_proj', 'k_proj', 'v_proj'\] of 'model\.layers\.0\.self_attn' "
            r"whose outputs are split over tp=2 on Mesh\(dp=1, tp=2\)\. .*ReplicatedParallel\(\) "
            r"if it works per head",
        ),
    ):
        ff.tensor_parallel(model, mesh, llama_plan(model.config))


def test_hf_tp_plan_lora_model():
    # A peft model: the plan's paths get peft's prefix; LoRA layers split like their base.
    model = W.with_lora(ZOO["qwen3"].build(), target_modules=["q_proj", "o_proj", "down_proj"])
    plan = ff.hf_tp_plan(model)
    assert isinstance(
        plan["base_model.model.model.layers.0.self_attn.q_norm"], ff.ReplicatedParallel
    )
    _close(_tp_errors(model, plan))


def test_hf_tp_plan_errors():
    # No plan shipped, and Falcon's grouped [q.. k v] layout (new_decoder_architecture)
    # tells none.
    falcon = transformers.FalconForCausalLM(
        transformers.FalconConfig(**{**ZOO["falcon"].options, "new_decoder_architecture": True})
    )
    with pytest.raises(
        ValueError,
        match=r"hf_tp_plan: FalconForCausalLM's config \(FalconConfig\) has no "
        r"base_model_tp_plan: .*pass require_layer_plan=False to split only the vocabulary",
    ):
        ff.hf_tp_plan(falcon)
    vocab_only = ff.hf_tp_plan(falcon, require_layer_plan=False)
    assert set(vocab_only) == {"transformer.word_embeddings", "lm_head", ""}

    model = ZOO["llama"].build()
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.mlp.gate_proj": "local_colwise",
    }
    with pytest.raises(
        ValueError,
        match=r"hf_tp_plan: LlamaForCausalLM's plan gives 'layers\.\*\.mlp\.gate_proj' the "
        r"transformers style 'local_colwise' \('model\.layers\.0\.mlp\.gate_proj', Linear\), which "
        r"this library cannot express yet; .*overrides=\{'layers\.\*\.mlp\.gate_proj': \.\.\.\}",
    ):
        ff.hf_tp_plan(model)
    plan = ff.hf_tp_plan(model, overrides={"layers.*.mlp.gate_proj": ff.ColwiseParallel()})
    _close(_tp_errors(model, plan))
    with pytest.raises(ValueError, match=r"overrides \['mlp\.gate'\] are not entries of"):
        ff.hf_tp_plan(model, overrides={"mlp.gate": None})


def test_a_tied_head_needs_a_vocab_parallel_embedding():
    model = ZOO["qwen3"].build()
    with (
        ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"the parameter 'model\.embed_tokens\.weight' is shared with 'lm_head\.weight' "
            r"\(shape \(64, 32\)\), but gets P\(None, None\) from no plan entry",
        ),
    ):
        ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model, vocab_parallel=False))


def test_uneven_splits_pad_only_where_padding_is_invisible():
    # Logits: padded with -inf (ignored by the loss) or trimmed when gathered; elsewhere a
    # split that tp does not divide is refused.
    gpt2 = ZOO["gpt2"].build()  # vocabulary 50257 on tp=2
    plan = ff.hf_tp_plan(gpt2, require_layer_plan=False)
    _close(_tp_errors(gpt2, plan))
    with ff.simulated_mesh({"tp": 2}) as mesh:
        logits = ff.fsdp(
            gpt2,
            mesh,
            specs=ff.tensor_parallel(gpt2, mesh, plan).specs,
            wrappers=ff.tensor_parallel(gpt2, mesh, plan).wrappers,
        )
        out = logits.apply(logits.shard(), torch.zeros(1, 2, dtype=torch.long)).logits
        last = ff.rank_values(out)[1]
        assert last.shape[-1] == 25129 and torch.isinf(last[..., -1]).all()
        assert torch.isfinite(last[..., :-1]).all()
    model = torch.nn.Sequential(torch.nn.Linear(4, 5))
    with (
        ff.simulated_mesh({"tp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"tp=2 does not divide its 5 output features\. .*"
            r"ColwiseParallel\(padded=True\) for logits",
        ),
    ):
        ff.tensor_parallel(model, mesh, {"0": ff.ColwiseParallel()})


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n, a in ZOO.items() if a.moe])
def test_expert_parallel_in_the_default_experts_implementation_matches_one_process(two_ranks, name):
    # transformers' default experts (stacked weights run by grouped_mm, not the eager loop):
    # each rank runs its own experts, the others' tokens skipped as expert parallelism does.
    for rank in two_ranks:
        result = rank[name]["tp_default_experts"]
        _close(result)
        assert result["implementation"] not in (None, "eager"), result


def test_expert_parallel_refuses_another_experts_implementation():
    model = ZOO["mixtral"].build()
    model.config._experts_implementation = "deepgemm"
    with (
        ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"'model\.layers\.0\.mlp\.experts' \(MixtralExperts\) ExpertParallel\(\) on "
            r"Mesh\(dp=1, tp=2\), but its experts implementation is 'deepgemm'; "
            r"ExpertParallel runs the eager one and 'grouped_mm', 'batched_mm'",
        ),
    ):
        ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model))


def test_the_models_own_loss_needs_gathered_logits():
    # labels= makes transformers compute the loss over the whole vocabulary: refused when the
    # logits are split, right when they are gathered.
    model = ZOO["llama"].build()
    idx, _ = Z.batch(ZOO["llama"])
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        for lp in (True, False):
            tp = ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model, loss_parallel=lp))
            f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
            if lp:
                with pytest.raises(
                    ValueError,
                    match=r"LlamaForCausalLM was called with labels=, but hf_tp_plan\("
                    r"loss_parallel=True\) leaves its logits split over the vocabulary on 'tp'.*"
                    r"hf_tp_plan\(model, loss_parallel=False\)",
                ):
                    f.apply(f.shard(), input_ids=idx, labels=idx)
            else:
                loss = f.apply(f.shard(), input_ids=idx, labels=idx).loss
    want = model(input_ids=idx, labels=idx).loss.detach()
    for value in ff.rank_values(loss):
        torch.testing.assert_close(value, want)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_plan_and_the_models_own_plan_give_one_plan(sequence_parallel):
    # llama_plan (from the config) and hf_tp_plan (from the model) are built by one function:
    # on a Llama every module gets the same style, PrepareInput on attention and MLP included.
    model = ZOO["llama"].build()
    options = dict(sequence_parallel=sequence_parallel)
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ours = ff.tensor_parallel(model, mesh, llama_plan(model.config, **options))
        theirs = ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model, **options))
    assert ours.specs == theirs.specs
    assert ours.styles == {k: s for k, s in theirs.styles.items() if k}  # "": no labels=
    assert isinstance(ours.styles["model.layers.1.self_attn"], ff.PrepareInput)


def _residual_attention(model: torch.nn.Module, layer: int) -> None:
    """Give ``model`` (built here) at ``layer`` Llama's attention plus a residual inside it: the
    attention's input then reaches more than q, k and v."""
    cls = type(model.model.layers[layer].self_attn)

    class ResidualAttention(cls):
        def forward(self, hidden_states, *args, **kwargs):
            out, weights = super().forward(hidden_states, *args, **kwargs)
            return out + hidden_states, weights

    old = model.model.layers[layer].self_attn
    new = ResidualAttention(model.config, layer_idx=layer)
    new.load_state_dict(old.state_dict())
    model.model.layers[layer].self_attn = new


def test_a_block_whose_input_reaches_more_than_its_linears_keeps_one_all_reduce_per_linear():
    # q, k and v may share their input's all-reduce only if nothing else reads that input (a
    # residual inside the attention would be summed over tp too). hf_tp_plan reads forward's
    # source: here layer 0's attention input also reaches a residual, so its linears keep
    # their own all-reduce and the numbers are right; sequence parallelism is refused.
    model = ZOO["llama"].build()
    _residual_attention(model, 0)
    plan = ff.hf_tp_plan(model)
    assert "model.layers.0.self_attn" not in plan  # not a block: one all-reduce per linear
    assert plan["model.layers.0.self_attn.q_proj"].input == "replicated"
    assert plan["model.layers.1.self_attn.q_proj"].input == "prepared"
    _close(_tp_errors(model, plan))
    forced = {  # what a shared all-reduce would give: the residual's gradient summed over tp
        **plan,
        "model.layers.0.self_attn": ff.PrepareInput(),
        **{
            f"model.layers.0.self_attn.{n}_proj": plan[f"model.layers.1.self_attn.{n}_proj"]
            for n in "qkv"
        },
    }
    assert _tp_errors(model, forced)["grad_err"] > 1e-3
    with pytest.raises(
        ValueError,
        match=r"hf_tp_plan\(sequence_parallel=True\): 'model\.layers\.0\.self_attn' "
        r"\(ResidualAttention\) holds split modules, but its forward cannot be shown to pass "
        r"its input to its colwise linears only",
    ):
        ff.hf_tp_plan(model, sequence_parallel=True)


def test_hf_tp_plan_checks_head_counts():
    model = ZOO["llama"].build()  # 2 key/value heads of 8 features
    with (
        ff.simulated_mesh({"tp": 4}) as mesh,
        pytest.raises(
            ValueError,
            match=r"'model\.layers\.0\.self_attn\.k_proj' \(Linear, weight \(16, 32\)\) .* "
            r"tp=4 does not divide its 2 attention heads \(16 output features, head_dim 8\)",
        ),
    ):
        ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model))
