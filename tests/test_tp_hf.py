"""Tensor-parallel plans on real Hugging Face layers: the Llama plan, keyword inputs, per-rank
attributes and peft LoRA, against the single-process reference and torch FSDP2 + TP."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import functional_fsdp as ff
from functional_fsdp.models import llama_plan
from functional_fsdp.tp.plan import StyleWrapper, tensor_parallel
from functional_fsdp.tp.styles import (
    ColwiseParallel,
    LocalAttributes,
    PrepareInput,
    RowwiseParallel,
    divide_by_tp,
)

from . import _tp_hf_workers as W

pytest.importorskip("transformers")
TOL = 1e-5


def _check(result: dict, grads: int | None = None) -> None:
    assert result["loss_diff"] < TOL, result
    assert result["grad_err"] < TOL, result
    assert result["grad_norm"] > 0.1, result  # the comparison is not vacuous
    if grads is not None:
        assert result["grads"] == grads, result


def _print_largest(what: str, results: list[dict]) -> None:
    """The largest differences over ranks and cases (README.md quotes them; ``pytest -s``)."""
    loss = max(r["loss_diff"] for r in results)
    grads = max(r["grad_err"] for r in results)
    print(f"{what}: loss {loss:.2g}, gradients {grads:.2g}")


# --------------------------------------------------------------------------- real gloo, 2x2


@pytest.mark.multiprocess
def test_gloo_llama_plan_matches_single_process(pools):
    # GQA Llama on (dp=2, tp=2): loss-parallel and gathered logits, sequence parallel, and
    # biases + tied embedding + padding_idx.
    results = pools.run(4, W.gloo_llama_vs_reference)
    for rank_results in results:
        assert len(rank_results) == len(W.LLAMA_CASES)
        for result in rank_results:
            _check(result)
    _print_largest("llama_plan on 2x2 vs one process", [r for rs in results for r in rs])


@pytest.mark.multiprocess
def test_gloo_llama_plan_matches_torch_fsdp2_and_parallelize_module(pools):
    results = pools.run(4, W.gloo_llama_vs_torch)
    for result in results:
        _check(result, grads=len(list(W.new_llama().parameters())))
    _print_largest("llama_plan on 2x2 vs FSDP2 + parallelize_module", results)


@pytest.mark.multiprocess
def test_gloo_lora_llama_matches_single_process(pools):
    pytest.importorskip("peft")
    # 2 layers x (q, v, o, up, down) x (lora_A, lora_B): only LoRA weights get gradients.
    for result in pools.run(4, W.gloo_lora_vs_reference):
        _check(result, grads=2 * 5 * 2)


@pytest.mark.multiprocess
def test_gloo_fixed_head_count_needs_per_rank_attribute(pools):
    for result in pools.run(4, W.gloo_fixed_heads):
        assert "the plan gives FixedHeadsAttention 'attn' a wrong result" in result["check"]
        assert (
            "give 'attn' (FixedHeadsAttention) PrepareInput(per_rank=('n_heads',), ...)"
            in (result["check"])
        )
        assert "set the attribute per rank" in result["hint"]
        assert "PrepareInput(per_rank=('n_heads',), ...)" in result["hint"]
        assert result["n_heads_after"] == 4  # the user's module is unchanged
        _check(result)


# --------------------------------------------------------------------------- simulated


def test_llama_plan_specs_and_simulated_numerics():
    model = W.new_llama()
    idx, tgt = W.batch()
    want = W.reference(model, idx, tgt)
    before = copy.deepcopy(model.state_dict())
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        plan = llama_plan(model.config)
        tp = tensor_parallel(model, mesh, plan)
        got = W.ours(model, mesh, plan, idx, tgt)
    specs = {k.replace("model.layers.0.", ""): v for k, v in tp.tp_specs.items()}
    assert specs["self_attn.k_proj.weight"] == ff.P("tp", None)
    assert specs["self_attn.o_proj.weight"] == ff.P(None, "tp")
    assert specs["mlp.down_proj.weight"] == ff.P(None, "tp")
    assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == ff.P("tp", None)
    assert specs["input_layernorm.weight"] == ff.P(None)
    _check(W.errors(got, want))
    # Purity: the module's tensors and forwards are as before.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_wrappers_take_the_module_they_run_on():
    # The engine may call a wrapper with a per-call clone: parameters come from that module.
    full = nn.Linear(4, 6)
    x = torch.randn(3, 4)
    with ff.simulated_mesh({"tp": 2}) as mesh:
        tp = tensor_parallel(nn.Sequential(full), mesh, {"0": RowwiseParallel()})
        (path, wrapper), *_ = tp.wrappers
        assert path == "0" and isinstance(wrapper, StyleWrapper)
        clone = copy.copy(full)
        clone._parameters = {
            "weight": ff.shard(full.weight.detach(), mesh, ff.P(None, "tp")).local,
            "bias": full.bias.detach(),
        }
        y = wrapper(clone, clone.forward)(input=ff.shard(x, mesh, ff.P(None, "tp")).local)
    for value in ff.rank_values(y):
        torch.testing.assert_close(value, full(x).detach())
    assert full.weight.shape == (6, 4)


def test_fixed_head_count_hint_names_module_shapes_tp_and_attribute():
    model = W.new_fixed_heads()
    idx, tgt = W.batch()
    want = W.reference(model, idx, tgt)
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        with pytest.raises(
            ValueError,
            match=(
                r"tensor_parallel: FixedHeadsAttention 'attn' failed to reshape on tp=2: shape "
                r"'\[4, 8, 4, 8\]' is invalid for input of size 512\. Its colwise linears give "
                r"each rank a block of their output features: 'wq' \(16 of 32\), 'wk' \(16 of "
                r"32\), 'wv' \(16 of 32\), .*Read the local size from the shape \(q\.view\(b, t, "
                r"-1, head_dim\)\), or set the attribute per rank for the call: give 'attn' "
                r"PrepareInput\(per_rank=\('n_heads',\), \.\.\.\) in the plan"
            ),
        ):
            W.ours(
                model, mesh, W.fixed_heads_plan(False), idx, tgt, loss_parallel=False, verify=False
            )
        with pytest.raises(
            ValueError,
            match=(
                r"tensor_parallel: the plan gives FixedHeadsAttention 'attn' a wrong result on "
                r"Mesh\(dp=1, tp=2\): checked once against the unsharded module on the first "
                r"call's input, it raises RuntimeError: shape '\[4, 8, 4, 8\]' is invalid for "
                r"input of size 512\. .*The fix that makes it match \(tried on the same input\): "
                r"give 'attn' \(FixedHeadsAttention\) PrepareInput\(per_rank=\('n_heads',\), "
                r"\.\.\.\) in the plan"
            ),
        ):
            W.ours(model, mesh, W.fixed_heads_plan(False), idx, tgt, loss_parallel=False)
        got = W.ours(model, mesh, W.fixed_heads_plan(True), idx, tgt, loss_parallel=False)
        # LocalAttributes does the same for a module without PrepareInput.
        plan = {
            "attn": LocalAttributes({"n_heads": divide_by_tp}),
            "attn.w[qkv]": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
        }
        got2 = W.ours(model, mesh, plan, idx, tgt, loss_parallel=False)
    _check(W.errors(got, want))
    _check(W.errors(got2, want))
    assert model.attn.n_heads == 4 and "n_heads" in model.attn.__dict__


def _plan_error(model, plan, match, axes=None, exc=ValueError):
    with ff.simulated_mesh(axes or {"dp": 1, "tp": 2}) as mesh, pytest.raises(exc, match=match):
        tensor_parallel(model, mesh, plan)


def test_plan_pattern_on_a_module_of_the_wrong_type_raises():
    model = W.new_llama()
    # The class and submodule names are the model's (read off it, not pinned to a release).
    mlp = model.model.layers[0].mlp
    cls = type(mlp).__name__
    linears = [n for n, m in mlp.named_children() if isinstance(m, torch.nn.Linear)]
    _plan_error(
        model,
        {"model.layers.*.mlp": ColwiseParallel()},
        rf"plan entry 'model\.layers\.\*\.mlp' gives module 'model\.layers\.0\.mlp' \({cls}\) "
        r"ColwiseParallel\(.*\) on Mesh\(dp=1, tp=2\), but ColwiseParallel needs an nn\.Linear, "
        rf"not a {cls} \(or a peft LoRA layer around an nn\.Linear\); its nn\.Linear "
        rf"submodules are {re.escape(repr(linears))}: point the pattern at them "
        rf"\(append '\.{linears[0]}'\)",
    )
    _plan_error(
        model,
        {"model.embed_tokens": RowwiseParallel()},
        r"RowwiseParallel needs an nn\.Linear, not a Embedding",
    )


def test_llama_plan_errors():
    model = W.new_llama()
    _plan_error(
        model,
        llama_plan(model.config),
        r"'model\.layers\.0\.self_attn\.k_proj' \(Linear, weight \(16, 32\)\) .* tp=4 does not "
        r"divide its 2 attention heads \(16 output features, head_dim 8\)\. Use a tp that "
        r"divides the head count \(one of \[1, 2\]\)",
        axes={"tp": 4},
    )
    with pytest.raises(TypeError, match=r"llama_plan: the config has no integer \['hidden_size'"):
        llama_plan({"hidden_size": 32})


def test_per_rank_attribute_mistakes_raise():
    model = W.new_fixed_heads()
    plan = W.fixed_heads_plan(True)
    _plan_error(
        model,
        {**plan, "attn": PrepareInput(per_rank=("n_head",))},
        r"gives module 'attn' \(FixedHeadsAttention\) PrepareInput\(.*\) on Mesh\(dp=1, tp=2\), "
        r"but FixedHeadsAttention has no attribute 'n_head' to set per rank",
    )
    _plan_error(
        model,
        {**plan, "attn": PrepareInput(per_rank=("n_heads",))},
        r"per-rank attribute 'n_heads': tp=8 does not divide its value 4",
        axes={"tp": 8},
    )
    with pytest.raises(TypeError, match=r"LocalAttributes\(per_rank=\.\.\.\): entries are"):
        LocalAttributes({"n_heads": 2})


def test_a_missing_keyword_input_raises():
    model = W.new_llama()
    idx, _ = W.batch()
    plan = {
        **llama_plan(model.config),
        "model.layers.*.self_attn": PrepareInput(input_kwarg="x"),
    }
    # The message names the module's class and the keywords the call passed; which keywords a
    # transformers release passes is its business, so only their form is pinned here.
    attention = type(model.model.layers[0].self_attn).__name__
    with (
        ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh,
        pytest.raises(
            TypeError,
            match=rf"PrepareInput\(.*\) on {attention}: the call passed no positional argument "
            r"and no keyword argument 'x' to take as the module's input \(it got keywords "
            r"\[[^\]]*\]\)\. Name the input's keyword",
        ),
    ):
        tp = tensor_parallel(model, mesh, plan)
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        f.apply(f.shard(), idx)


def test_unsupported_lora_layers_raise():
    pytest.importorskip("peft")
    base = W.new_llama()
    dora = W.with_lora(base, use_dora=True, target_modules=["q_proj"])
    _plan_error(
        dora,
        llama_plan(base.config, prefix="base_model.model."),
        r"ColwiseParallel supports plain LoRA only; adapters \['default'\] use a LoRA variant",
    )
    biased = W.with_lora(
        W.new_llama(attention_bias=True), lora_bias=True, target_modules=["o_proj"]
    )
    _plan_error(
        biased,
        llama_plan(base.config, prefix="base_model.model."),
        r"adapter 'default' has a lora_B bias \(lora_bias=True\), which a rowwise layer would "
        r"add once per rank",
    )


def test_vocab_parallel_embedding_keeps_the_padding_row_frozen():
    model = W.new_llama(pad_token_id=W.PAD)  # untied: the padding row has no gradient at all
    idx, tgt = W.batch()
    want = W.reference(model, idx, tgt)
    assert want[1]["model.embed_tokens.weight"][W.PAD].abs().max() == 0
    with ff.simulated_mesh({"dp": 1, "tp": 2}) as mesh:
        got = W.ours(model, mesh, llama_plan(model.config), idx, tgt)
    _check(W.errors(got, want))
    for value in ff.rank_values(got[1]["model.embed_tokens.weight"]):
        assert value[W.PAD].abs().max() == 0
