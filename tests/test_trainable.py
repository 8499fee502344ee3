"""Trainable and frozen parameters: partition/combine, TrainState, train_step, checkpoints.

Real gloo runs compare against torch.optim.AdamW (and clip_grad_norm_) on the trainable
parameters of the single-process model, on the same global batch.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import functional_fsdp as ff

from . import _trainable_workers as W

# --------------------------------------------------------------------------- partition


def test_partition_forms_and_combine_round_trip():
    params = {"w": torch.ones(2), "lora_a": torch.zeros(2), "b": torch.ones(1)}
    forms = [
        {"lora_a"},
        ["lora_a"],
        lambda path, p: path.startswith("lora"),
        {"w": False, "lora_a": True, "b": False},
        type("Described", (), {"trainable": frozenset({"lora_a"})})(),
    ]
    for form in forms:
        train, frozen = ff.partition(params, form)
        assert list(train) == ["lora_a"] and list(frozen) == ["w", "b"], form
        merged = ff.combine(train, frozen)
        assert set(merged) == set(params) and all(merged[k] is params[k] for k in params)


def test_partition_module_requires_grad_and_nested_containers():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    params = dict(model.named_parameters())
    train, frozen = ff.partition(params, model)
    assert sorted(train) == ["1.bias", "1.weight"] and sorted(frozen) == ["0.bias", "0.weight"]
    assert all(p.requires_grad for p in model[1].parameters())  # the module is not touched

    NT = collections.namedtuple("NT", "a b")
    tree = {"x": [torch.ones(1), torch.zeros(1)], "y": NT(torch.ones(2), {"q": torch.ones(3)})}
    train, frozen = ff.partition(tree, lambda path, p: path in ("x.0", "y.1.q"))
    assert train["x"][1] is None and train["y"].a is None and "q" in train["y"].b
    assert frozen["x"][0] is None and frozen["y"].b is None
    back = ff.combine(train, frozen)
    assert back["x"][0] is tree["x"][0] and back["y"].b["q"] is tree["y"].b["q"]
    # The trainable tree goes straight into torch.func (no None among dict values).
    grads = torch.func.grad(lambda t: sum(v.sum() for v in ff.tree_leaves(t)))(
        ff.partition({"a": torch.ones(2), "b": torch.ones(2)}, {"a"})[0]
    )
    assert list(grads) == ["a"]


def test_partition_and_combine_errors():
    params = {"layers.0.weight": torch.ones(2), "layers.0.bias": torch.ones(1)}
    with pytest.raises(
        ValueError,
        match=r"partition: trainable names \['layers.0.wieght'\] are not leaves of the params "
        r"tree \(2 leaves, e\.g\. .*\)\. Use the dotted names of module.named_parameters\(\)",
    ):
        ff.partition(params, {"layers.0.wieght"})
    with pytest.raises(ValueError, match=r"the mask does not match the params tree: it has no "):
        ff.partition(params, {"layers.0.weight": True})
    with pytest.raises(TypeError, match=r"the mask gives 1 \(int\) for layers.0.bias"):
        ff.partition(params, lambda path, p: 1)
    with pytest.raises(ValueError, match=r"combine: w is given by more than one tree"):
        ff.combine({"w": torch.ones(1)}, {"w": torch.ones(1)})
    with pytest.raises(ValueError, match=r"combine: the trees have different containers at x"):
        ff.combine({"x": [1, None]}, {"x": [None, 2, 3]})
    with pytest.raises(ValueError, match=r"selects none of the 2 parameters"):
        ff.TrainState.create(params, ff.sgd(0.1), trainable=lambda path, p: False)


def test_masks_written_for_all_params_apply_to_the_trainable_part():
    params = {"w": torch.ones(2), "bias": torch.ones(2), "frozen": torch.ones(2)}
    decay = {"w": True, "bias": False, "frozen": True}
    opt = ff.adamw(0.1, weight_decay=0.5, mask=decay)
    state = ff.TrainState.create(params, opt, trainable={"w", "bias"})
    assert sorted(state.opt_state[0].mu) == ["bias", "w"]
    step = ff.train_step(
        lambda p, b: (p["w"] + p["bias"] + p["frozen"]).sum() * b, opt, batch="local"
    )
    new, _ = step(state, torch.tensor(1.0))
    assert new.params["frozen"] is params["frozen"]
    # w decays (0.1 * 0.5), bias does not: both take the same Adam step of -0.1.
    torch.testing.assert_close(new.params["w"], torch.full((2,), 0.85))
    torch.testing.assert_close(new.params["bias"], torch.full((2,), 0.9))


# --------------------------------------------------------------------------- one process


def test_single_process_step_matches_torch_adamw_on_trainable_only():
    model = W.frozen_mlp()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ff.chain(ff.clip_by_global_norm(W.MAX_NORM, eps=1e-6), ff.adamw(W.LR, weight_decay=0.1))
    state = ff.TrainState.create(params, opt, trainable=model)
    assert state.trainable == {"0.weight", "0.bias", "4.weight", "4.bias"}

    def loss_fn(p, b):
        return (torch.func.functional_call(model, p, (b[0],)) - b[1]).pow(2).mean()

    step = ff.train_step(loss_fn, opt, batch="local")
    ref = W.mlp_reference("clip")
    for i, b in enumerate(W.mlp_batches()):
        state, metrics = step(state, b)
        assert abs(metrics["loss"].item() - ref["losses"][i]) < 1e-6
        assert abs(metrics["grad_norm"].item() - ref["norms"][i]) < 1e-5 * ref["norms"][i]
    for k, v in state.params.items():
        torch.testing.assert_close(v, ref["params"][k].detach(), atol=1e-6, rtol=1e-5)
    assert state.params["2.weight"] is params["2.weight"]
    assert torch.equal(params["2.weight"], model[2].weight)
    assert sorted(state.opt_state[1][0].mu) == sorted(state.trainable)
    # The pytree keeps the split: a tree_map over the state is still a partitioned state.
    assert ff.tree_map(lambda t: t, state).trainable == state.trainable


def test_default_path_refuses_a_module_with_frozen_parameters_simulated():
    model = W.frozen_mlp()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(model, mesh)
        opt = ff.adamw(W.LR, weight_decay=0.01)
        step = ff.train_step(lambda p, b: (sm.apply(p, b[0]) - b[1]).pow(2).mean(), opt, model=sm)
        # At the point of the mistake: the state's creation, from the shards sm.shard() made.
        with pytest.raises(
            ValueError,
            match=r"TrainState\.create: params\['2\.bias'\] and 1 more are the shards of frozen "
            r"parameters.*ff\.TrainState\.create\(params, optimizer, trainable=sharded_model\)",
        ):
            ff.TrainState.create(sm.shard(), opt)
        # Shards of the user's own tensors carry no mark: the step still refuses them.
        own = sm.shard({n: p.detach() for n, p in model.named_parameters()})
        with pytest.raises(
            ValueError,
            match=r"the module has frozen parameters \(requires_grad=False\), e\.g\. '2\.weight' "
            r"and 1 more, but the TrainState was created without trainable=.*"
            r"ff\.TrainState\.create\(params, optimizer, trainable=sharded_model\)",
        ):
            step(ff.TrainState.create(own, opt), W.mlp_batches(1)[0])
        everything = ff.TrainState.create(sm.shard(), opt, trainable=lambda path, p: True)
        new, _ = step(everything, W.mlp_batches(1)[0])  # training all on purpose is allowed
        assert new.step == 1


def test_global_norm_ignores_padding_simulated():
    full = {"w": torch.randn(5, 3), "b": torch.randn(7)}
    with ff.simulated_mesh({"a": 2, "b": 2}) as mesh:
        tree = ff.shard(full, mesh, {"w": ff.P(("a", "b")), "b": ff.P("b")})
        shifted = ff.tree_map(lambda t: t + 1.0, tree)
        norms = ff.rank_values(ff.global_norm(shifted))
    expected = torch.sqrt(sum(((t + 1.0) ** 2).sum() for t in full.values()))
    for n in norms:
        torch.testing.assert_close(n, expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_keys_carry_parameter_and_field_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    params = {"layers.0.q.lora_A": torch.ones(2), "layers.0.q.base": torch.ones(2)}
    opt = ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(0.1, weight_decay=0.01))
    state = ff.TrainState.create(params, opt, trainable={"layers.0.q.lora_A"})
    ff.checkpoint.save(tmp_path / "ckpt", state)
    keys = sorted(dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    assert keys == [
        "opt_state.1.0.count",
        "opt_state.1.0.mu.layers.0.q.lora_A",
        "opt_state.1.0.nu.layers.0.q.lora_A",
        "opt_state.1.2.learning_rate",  # recorded for metrics["lr"]
        "params.layers.0.q.base",
        "params.layers.0.q.lora_A",
        "rng",  # the random key (train_step's dropout)
        "step",
    ]
    loaded = ff.checkpoint.load(tmp_path / "ckpt", state)
    assert loaded.trainable == state.trainable and loaded.step == 0


# --------------------------------------------------------------------------- real processes


@pytest.mark.multiprocess
def test_gloo_lora_llama_trains_only_adapters(pools):
    r = pools.run(2, W.run_lora_llama)[0]
    assert "frozen parameters (requires_grad=False)" in r["default_error"]
    assert "trainable=sharded_model" in r["default_error"]
    assert r["trainable"] == r["module_trainable"] and len(r["trainable"]) == 8
    assert all("lora_" in n for n in r["trainable"]) and r["module_untouched"]
    assert r["frozen_bitwise"] and r["frozen_same_objects"]
    assert r["mu_keys"] == r["trainable"]
    assert r["opt_state_leaves"] == 2 * len(r["trainable"]) + 2  # mu, nu, count, lr
    assert r["rs_bytes"] == [r["expected_rs_bytes"]] * W.STEPS, r
    assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r


@pytest.mark.multiprocess
def test_gloo_frozen_layer_every_variant(pools):
    results = {v: pools.run(2, W.run_mlp, v)[0] for v in W.VARIANTS}
    for name, r in results.items():
        assert r["frozen_bitwise"] and r["frozen_same_objects"], name
        assert r["mu_keys"] == r["trainable"], name
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, (name, r)
        assert r["norm_diff"] < 1e-5, (name, r)
        expected = {"accumulate_each": 2}.get(name, 1) * r["expected_rs_bytes"]
        if name == "zero2":  # reduce-scattered onto the optimizer's shards (half of P())
            expected = r["opt_rs_bytes"]
        assert r["rs_bytes"] == [expected] * W.STEPS, (name, r)
    # ZeRO-2: replicated params, trainable grads reduce-scattered (no all-reduce), optimizer
    # state sharded.
    assert results["zero2"]["ar_bytes"] == [0] * W.STEPS
    assert results["zero2"]["mu_specs"] == ["P('dp')"]
    fsdp2 = pools.run(2, W.mlp_vs_fsdp2)[0]
    assert fsdp2["frozen_equal"] and fsdp2["param_diff"] < 1e-5, fsdp2


@pytest.mark.multiprocess
def test_gloo_global_norm_ignores_non_zero_padding(pools):
    for r in pools.run(2, W.padded_global_norm):
        assert r["padding_nonzero"]
        assert abs(r["norm"] - r["expected"]) < 1e-5 * r["expected"], r


@pytest.mark.multiprocess
def test_gloo_partitioned_checkpoint_reshards_2_to_4_and_1(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools.run(2, W.save_partitioned, path)[0]
    opt_keys = [k for k in saved["keys"] if k.startswith("opt_state")]
    assert "opt_state.0.mu.0.weight" in opt_keys and "params.2.weight" in saved["keys"]
    assert not any(k.endswith("2.weight") or k.endswith("2.bias") for k in opt_keys)
    for world, axes in [(4, {"dp": 4}), (1, {"dp": 1})]:
        loaded = pools.run(world, W.load_partitioned, axes, path)[0]
        assert loaded["step"] == saved["step"] == 2
        assert loaded["trainable"] == ["0.bias", "0.weight", "4.bias", "4.weight"]
        for k in saved["params"]:
            assert torch.equal(loaded["params"][k], saved["params"][k]), (world, k)
        for part in ("mu", "nu"):
            for k in saved["opt"][part]:
                assert torch.equal(loaded["opt"][part][k], saved["opt"][part][k]), (world, k)
        assert loaded["opt"]["count"] == saved["opt"]["count"]
        assert abs(loaded["next_loss"] - saved["next_loss"]) < 1e-6, (world, loaded, saved)
