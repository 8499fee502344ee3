"""4-bit frozen bases (bitsandbytes NF4/FP4): sharded, gathered and trained packed.

The reference is the same peft + bitsandbytes model in one process on the global batch
(same quantized bytes: both are loaded from one fp32 directory by ``from_pretrained``).
"""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff

from . import _qlora_workers as W

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return W.save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def _loss_and_grads(sm, params, b):
    tr, fr = ff.partition(params, sm.trainable)
    loss_fn = lambda t: sm.apply(ff.combine(t, fr), input_ids=b, labels=b).loss  # noqa: E731
    return torch.func.grad_and_value(loss_fn)(tr)


def test_simulated_shard_and_grad_of_a_4bit_peft_model(tiny_dir):
    """The issue's failure 1: shard() under the simulation mode and a step under torch.func."""
    model = W.qlora(tiny_dir)
    b = W.batches(1)[0]
    ref = model(input_ids=b, labels=b).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    for dp in (2, 3):  # 3 does not divide the blocks: padded rows, never seen
        with ff.simulated_mesh({"dp": dp}) as mesh:
            sm = ff.fsdp(model, mesh)
            params = sm.shard()
            grads, loss = _loss_and_grads(sm, params, b)
            assert ff.rank_values(loss)[0].item() == ref.item()
            full = ff.gather(grads)
            for k, g in ref_grads.items():
                torch.testing.assert_close(ff.rank_values(full[k])[0], g, rtol=0, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert all(
        type(m.weight).__name__ == "Params4bit"
        for n, m in model.named_modules()
        if n.endswith("base_layer")
    )


@pytest.mark.parametrize(
    "quant_type, double", [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]
)
def test_gloo_qlora_step_matches_peft_bitsandbytes(pools, tiny_dir, quant_type, double):
    """The seed's BitsAndBytesConfig exactly (compute dtype bf16): the first step's loss and
    adapter gradients, and the second step's loss."""
    r = pools.run(2, W.train_vs_peft, tiny_dir, quant_type, double, 2)[0]
    assert r["base_dtypes"] == ["torch.uint8"] and not r["base_trainable"] and not r["mu_base"]
    assert r["base_bitwise"] and r["user_module_untouched"]
    print(f"step1 loss={r['step1_loss_diff']:.2e} grad={r['grad_diff']:.2e} loss={r['loss']}")
    # Same quantized bytes and the same bitsandbytes kernel on every row, so the base's bf16
    # outputs agree per row; what differs is the order of fp32 sums (each rank's half of the
    # batch, then the mean over ranks), a few fp32 ulps of the loss (~4.6) and of gradients
    # up to ~1. Measured: loss 0 to 1e-6, gradients 2e-8 to 2e-6.
    assert r["step1_loss_diff"] <= 1e-5, r
    assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r
    # After one AdamW step (lr 1e-2, the first step moves every adapter value by about lr
    # whatever its gradient's size) a last-bit difference in an adapter can flip a bf16
    # rounding of the base's output (2**-8 relative): the second loss agrees to 1e-4.
    assert abs(r["loss"][1] - r["ref_loss"][1]) <= 1e-4, r


def test_gloo_qlora_20_adamw_steps_follow_peft_bitsandbytes(pools, tiny_dir):
    """20 AdamW steps (lr 1e-2) with the base computing in fp32 (bnb_4bit_compute_dtype).

    In bf16 the trajectory tests bf16 rounding, not the library: one flipped bf16 rounding in
    the base's output becomes an AdamW step of ~lr on a near-zero gradient. Measured in one
    process, the peft reference against itself with the batch summed in two halves drifts by
    1.6e-3 (loss) and 1.1e-2 (adapters) in bf16, by 2.4e-5 and 1.0e-4 in fp32.
    """
    r = pools.run(2, W.train_vs_peft, tiny_dir, "nf4", True, 20, torch.float32)[0]
    assert r["base_bitwise"] and r["user_module_untouched"]
    diffs = [abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])]
    print(f"fp32: loss_diff={max(diffs):.2e} param_diff={r['param_diff']:.2e}")
    # Both sides sum in another order (each rank's half of the batch, then the mean over
    # ranks) and round AdamW differently (ff.adamw vs torch.optim.AdamW: alone, 1.1e-5 and
    # 4.5e-5 in one process). Up to step 12 the losses agree to a few fp32 ulps (~1e-6 of
    # 4.6); from step 13 on this trajectory amplifies any rounding (the references above drift
    # from there too). Measured: losses within 1.2e-4, adapter values within 5.0e-4 (lr/20).
    assert max(diffs[:10]) <= 1e-5, (r["loss"], r["ref_loss"])
    assert max(diffs) <= 5e-4, (r["loss"], r["ref_loss"])
    assert r["param_diff"] <= 2e-3, r
    # All-gather bytes of the 4-bit base vs the same base in bf16, both measured by
    # count_comms on the first step: (33 bytes per 64 values: 32 packed, 1 absmax code, and
    # the nested state) / 128 bytes in bf16.
    ratio = r["base_gather_bytes"] / r["bf16_base_gather_bytes"]
    print(f"all-gather bytes: 4-bit {r['base_gather_bytes']} bf16 {r['bf16_base_gather_bytes']}")
    assert 0.25 < ratio <= 0.3, ratio
    # Both gather the base twice (forward, and again for backward), ring bytes (n-1)/n = 1/2.
    assert r["bf16_base_gather_bytes"] == 2 * r["bf16_base_bytes"] / 2, r


@pytest.mark.parametrize("quant_type, double", [("nf4", True), ("fp4", False)])
def test_the_storage_copys_backward_is_bitwise_bitsandbytes_in_bf16(quant_type, double):
    """Quantized from fp32, computing in bf16: the storage copy dequantizes straight to bf16
    in backward (one bf16 weight), bitsandbytes to fp32 then casts; the gradients are equal."""
    import bitsandbytes as bnb

    from functional_fsdp.formats import storage_view

    torch.manual_seed(5)
    layer = bnb.nn.Linear4bit(
        128, 96, compute_dtype=torch.bfloat16, compress_statistics=double, quant_type=quant_type
    )
    layer.weight = bnb.nn.Params4bit(
        torch.randn(96, 128), False, compress_statistics=double, quant_type=quant_type, module=layer
    )
    model = torch.nn.Sequential(layer.to("cpu").train())
    stored = storage_view(model)
    assert stored is not model and stored[0].weight.dtype == torch.uint8
    x = torch.randn(4, 7, 128, requires_grad=True)
    grads = []
    for m in (model, stored):
        y = m(x)
        (gx,) = torch.autograd.grad(
            y, x, torch.randn_like(y, generator=torch.Generator().manual_seed(6))
        )
        grads.append((y, gx))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float32])
def test_a_4bit_layer_with_another_quant_storage_is_sharded_as_its_bytes(storage):
    """bnb_4bit_quant_storage (the FSDP-QLoRA recipe's) only changes the packed bytes' dtype."""
    import bitsandbytes as bnb

    torch.manual_seed(4)
    layer = bnb.nn.Linear4bit(128, 64, compute_dtype=torch.float32, quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(
        torch.randn(64, 128), requires_grad=False, quant_storage=storage, module=layer
    )
    layer = layer.to("cpu").train()
    x = torch.randn(3, 128)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(torch.nn.Sequential(layer), mesh)
        params = sm.shard()
        y = ff.rank_values(sm.apply(params, x))[0]
    assert params["0.weight"].dtype == torch.uint8 and layer.weight.dtype == storage
    assert torch.equal(y, layer(x))


def test_gloo_the_seed_recipe_unmodified_matches_peft_bitsandbytes(pools, tiny_dir):
    """The seed's lines as written (BitsAndBytesConfig nf4 + double quantization + bf16
    compute, gradient_checkpointing_enable(), prepare_model_for_kbit_training, LoRA r=8,
    alpha=16 on all seven projections, lora_dropout=0.05), then ff.fsdp and train_step on 2
    gloo ranks, against the same model run by peft + bitsandbytes in one process.

    Dropout: train_step(randomness="global_batch") draws, on each rank, its rows of the masks
    one process draws from the same key for the global batch (docs/randomness.md); the
    reference draws from that key, so both see the same masks and can be compared exactly,
    dropout on. HF's checkpointing replays the masks in backward on both sides."""
    r = pools.run(2, W.seed_recipe, tiny_dir, 5, 0.05)[0]
    assert r["dropout"] == [0.05] and r["checkpointing"] and r["base_dtypes"] == ["torch.uint8"]
    assert len(r["trainable"]) == 2 * 7 * 2  # lora_A and lora_B of 7 projections, 2 layers
    # engine "auto": torch.func cannot transform HF's checkpointing; one notice, then autograd
    assert len(r["notices"]) == 1 and "plain autograd" in r["notices"][0], r["notices"]
    other = abs(r["other_masks_loss"] - r["ref_loss"][1])
    print(f"seed: grad={r['grad_diff']:.1e} other masks={other:.1e} {r['loss']} {r['ref_loss']}")
    # Same masks, same bytes, same kernels: the first step differs only in the order of fp32
    # sums (each rank's half of the batch). Measured: loss 4.8e-7 of 4.58, gradients 7.5e-9
    # (of up to 0.06). On the second step (lora_B is zero before the first), other masks
    # change the loss by 1.5e-3; ours is the reference's to a few ulps (measured: equal).
    assert abs(r["loss"][0] - r["ref_loss"][0]) <= 1e-5
    assert abs(r["loss"][1] - r["ref_loss"][1]) <= 1e-5 and other > 5e-4, r
    assert r["grad_diff"] <= 1e-6
    # Then bf16 compute amplifies last-bit differences through AdamW (lr 1e-2; see the
    # 20-step test): measured over 5 steps, losses within 1.6e-5 and adapters within 2.7e-4.
    assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) <= 2e-4
    assert r["param_diff"] <= 3e-3
    assert r["loss"][-1] < r["loss"][0] - 0.1  # it trains: 4.58 to 4.37 on the batch


# --------------------------------------------------------------------------- repacked for CPU


def _repacked_pair(double: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two 4-bit layers (128 -> 64) from one weight, ``(standard, repacked)``: the second put
    into bitsandbytes' CPU inference layout the way ``Linear4bit.forward`` does in eval mode
    on a CPU with avx512_bf16, here called directly so that it happens on any CPU."""
    import copy

    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    repack = getattr(F, "_convert_weight_packed_for_cpu", None)
    if repack is None or not hasattr(F, "_convert_weight_packed_for_cpu_inverse"):
        pytest.skip("this bitsandbytes has no CPU inference repacking")
    torch.manual_seed(3)
    layer = bnb.nn.Linear4bit(
        128, 64, bias=True, compute_dtype=torch.float32, compress_statistics=double
    )
    layer.weight = bnb.nn.Params4bit(
        torch.randn(64, 128), requires_grad=False, compress_statistics=double, module=layer
    )
    layer = layer.to("cpu")  # quantized here
    repacked = copy.deepcopy(layer)
    w = repacked.weight
    w.data, w.quant_state = repack(w.data, w.quant_state)
    repacked.quant_state = w.quant_state
    return layer, repacked


@pytest.mark.parametrize("double", [False, True])
def test_a_layer_repacked_for_cpu_inference_is_sharded_in_the_standard_layout(double):
    """bitsandbytes repacked the layer in place (tiled codes, bf16 absmax); ff.fsdp reads it
    back without changing it: the codes exactly; the absmax as the repacked layer holds it
    (bf16 values), or, double-quantized, re-quantized as bitsandbytes restores it."""
    import copy

    import bitsandbytes.functional as F

    standard, repacked = _repacked_pair(double)
    w, qs = repacked.weight, repacked.weight.quant_state
    assert qs.packing_format_for_cpu and qs.absmax.dtype == torch.bfloat16
    before = (w.data.clone(), qs.absmax.clone(), copy.copy(qs.__dict__))
    if double:  # bitsandbytes' own inverse, on a copy: the bytes it restores on save
        packed, expected = F._convert_weight_packed_for_cpu_inverse(w.data, copy.deepcopy(qs))
        assert not torch.equal(expected.absmax, standard.weight.quant_state.absmax)  # lossy
    else:  # the original codes with the absmax rounded to bf16, as the repacked layer has it
        sq = standard.weight.quant_state
        packed, expected = standard.weight.data, copy.copy(sq)
        expected.absmax = sq.absmax.to(torch.bfloat16).float()
        assert not torch.equal(expected.absmax, sq.absmax)  # lossy: the repacking rounded it
    ref = copy.deepcopy(standard).train()  # bitsandbytes' forward on the expected state
    ref.weight.data, ref.weight.quant_state = packed, expected
    ref.quant_state = expected
    x = torch.randn(5, 128)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(torch.nn.Sequential(repacked), mesh)
        y = ff.rank_values(sm.apply(sm.shard(), x))[0]
    assert torch.equal(y, ref(x))
    assert w.data is not None and torch.equal(w.data, before[0])  # the user's layer, as it was
    assert repacked.weight.quant_state is qs and torch.equal(qs.absmax, before[1])
    assert qs.__dict__.keys() == before[2].keys()
    assert all(qs.__dict__[k] is v for k, v in before[2].items())


def test_a_repacked_layer_without_the_inverse_is_refused_naming_it(monkeypatch):
    import bitsandbytes.functional as F

    _, repacked = _repacked_pair(True)
    monkeypatch.delattr(F, "_convert_weight_packed_for_cpu_inverse")
    with (
        ff.simulated_mesh({"dp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"^0 \(Linear4bit, \(64, 128\)\) was repacked by bitsandbytes for CPU "
            r"inference .* Put the model in training mode \(model\.train\(\)\) before any "
            r"forward, or load it again\.$",
        ),
    ):
        ff.fsdp(torch.nn.Sequential(repacked), mesh)


def test_only_the_formats_package_knows_a_formats_internals():
    """The rest of the library asks formats/ (Format, Stored): a second format is one file."""
    import pathlib

    root = pathlib.Path(ff.__file__).parent
    internals = ("_ff_state", "_nested", "absmax", "quant_state", "_ff_format")
    found = {
        str(f.relative_to(root)): [w for w in internals if w in f.read_text()]
        for f in root.rglob("*.py")
        if "formats" not in f.parts
    }
    assert {f: ws for f, ws in found.items() if ws} == {}


# --------------------------------------------------------------------------- bad input


def test_an_8bit_base_is_refused_saying_4bit_is_supported():
    import bitsandbytes as bnb

    model = torch.nn.Sequential(bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False))
    with (
        ff.simulated_mesh({"dp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=r"^0 \(Linear8bitLt, weight \(32, 64\) torch.float32\) is an 8-bit bitsandbytes "
            r"layer, which functional_fsdp cannot shard: 4-bit bases are supported "
            r"\(BitsAndBytesConfig\(load_in_4bit=True, \.\.\.\), NF4 or FP4",
        ),
    ):
        ff.fsdp(model, mesh)


def test_tensor_parallel_style_on_a_4bit_layer_is_refused_naming_it(tiny_dir):
    model = W.quantized(tiny_dir)
    layer = "model.layers.0.self_attn.q_proj"
    with (
        ff.simulated_mesh({"dp": 2}) as mesh,
        pytest.raises(
            ValueError,
            match=rf"^tensor parallelism over a 4-bit layer is not supported: '{layer}' is "
            rf"quantized \(Linear4bit\) and a tensor-parallel style targets '{layer}'\. Leave "
            r"the quantized layers out of the tensor-parallel plan",
        ),
    ):
        ff.fsdp(model, mesh, wrappers=[(layer, lambda module, forward: forward)])


# --------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def load_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return W.save_tiny_llama(str(tmp_path_factory.mktemp("load_llama")), **W.LOAD_CONFIG)


@pytest.mark.parametrize("quant_type, double", [("nf4", True), ("fp4", False)])
def test_gloo_shardwise_quantized_load_is_bitwise_bitsandbytes(
    pools, load_dir, tmp_path, quant_type, double
):
    """Each rank reads its blocks' rows of the fp32 file and quantizes them; with double
    quantization the absmax is all-gathered for the offset (the mean over all blocks). A
    checkpoint saved already quantized is read block-wise too."""
    saved = str(tmp_path / "saved_4bit")
    W.quantized(load_dir, quant_type, double).save_pretrained(saved)
    r = pools.run(2, W.load_shardwise, load_dir, saved, quant_type, double)
    for out in r:
        assert out["from_quantized"] == [] and out["from_meta"] == [], out
        assert out["from_saved_4bit"] == [], out
        # No rank holds the model: the shards plus about one fp32 tensor's half, well under
        # the whole model in its stored (4-bit) precision, let alone fp32.
        print({k: out[k] for k in ("peak", "shards", "whole_stored", "largest_fp32", "whole_fp32")})
        assert out["peak"] <= out["shards"] + out["largest_fp32"] / 2 + 2**16, out
        assert out["peak"] < out["whole_stored"], out


def test_plan_prices_a_4bit_base_as_stored_with_its_code_tables(load_dir):
    """ff.plan's bytes at rest: the packed blocks with their scales that ff.fsdp shards, and
    the code tables every rank holds whole (counted once where layers share one)."""
    model = W.qlora(load_dir)
    model.config.use_cache = False  # the planner's shapes-only step keeps no KV cache
    report = ff.plan(model, {"dp": 2})
    tables = {
        id(t): t.numel() * t.element_size()
        for m in model.modules()
        if type(m).__name__ == "Linear4bit"
        for t in (m.weight.quant_state.code, m.weight.quant_state.state2.code)
    }
    assert sum(tables.values()) >= 64 + 1024  # a 4-bit table and an 8-bit one at least
    with ff.simulated_mesh({"dp": 2}) as mesh:
        params = ff.fsdp(model, mesh).shard()
        shards = sum(v.layout.local_numel * v.dtype.itemsize for v in params.values())
    assert report.param_bytes == shards + sum(tables.values())


# --------------------------------------------------------------------------- export


def test_gloo_export_adapter_and_merged_model_of_a_4bit_run(pools, tiny_dir, tmp_path):
    """The adapter loads with PeftModel.from_pretrained over the bitsandbytes base and gives
    the trained logits; the merged model (written dequantized) is what peft's
    merge_and_unload() computes: quantized again by bitsandbytes it is bitwise peft's merged
    4-bit weights."""
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    r = pools.run(2, W.export_4bit, tiny_dir, adapter, merged)[0]
    assert r["adapter_logits_diff"] <= 1e-5, r
    assert r["keys"] and all(r["merged_requantized_bitwise"]) and all(r["merged_plain_bitwise"])
    assert len(r["merged_requantized_bitwise"]) == 14, r


def test_data_without_the_text_field_is_refused_naming_the_fields(tmp_path, monkeypatch):
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(W.EXAMPLES))
    example = importlib.import_module("finetune_lora")
    data = tmp_path / "d.jsonl"
    data.write_text('{"body": "hello", "id": 1}\n')
    with pytest.raises(
        SystemExit,
        match=rf"^--data {data}: the records have no field 'text'; their fields are "
        r"\['body', 'id'\]\. Pass --text-field with the one that holds the text\.$",
    ):
        example.load_texts(str(data), "text")
    assert example.load_texts(str(data), "body") == ["hello"]
    sys.modules.pop("finetune_lora", None)


# --------------------------------------------------------------------------- the user's module state


@pytest.fixture(scope="module")
def dropout_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return W.save_tiny_llama(str(tmp_path_factory.mktemp("dropout_llama")), attention_dropout=0.5)


def _check_user_state(out: dict) -> None:
    assert out["adapters_matter"] > 1e-3 and out["other_matters"] > 1e-3, out
    assert out["train"] > 1e-3 and out["train_again"] > 1e-3, out  # attention dropout on
    for k in ("eval", "disabled", "enabled_again", "set_adapter", "default_again"):
        assert out[k] <= 1e-5, (k, out)
    assert out["view_eval"] <= 1e-5 and out["view_disabled"] <= 1e-5, out


def test_the_users_train_eval_and_adapter_state_reach_a_4bit_models_apply(dropout_dir):
    """``model.eval()``/``.train()``, ``with model.disable_adapter():`` and ``set_adapter`` on
    the user's peft model are what ``sm.apply`` runs with, though the LoRA layers over 4-bit
    ones run from copies (the storage view); on a simulated mesh of 2 ranks."""
    _check_user_state(W.user_state(dropout_dir, simulated=True))


def test_gloo_the_users_train_eval_and_adapter_state_reach_a_4bit_models_apply(pools, dropout_dir):
    """The same on 2 gloo ranks, each rank its half of the batch."""
    for out in pools.run(2, W.user_state, dropout_dir):
        _check_user_state(out)
