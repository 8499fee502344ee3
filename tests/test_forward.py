"""Functional FSDP forward/backward: against the single-process reference and torch FSDP2."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import rank_map

import functional_fsdp as ff
from functional_fsdp.models import GPT, MLPModel, lm_loss

from . import _fsdp_workers as W

POLICIES = {
    "zero3": ff.Policy(),
    "zero2": ff.Policy(reshard_after_forward=False),
    "checkpoint": ff.Policy(checkpoint=True),
    "prefetch2": ff.Policy(prefetch=2),
}
MESHES = [{"dp": 2}, {"dp": 4}, {"replicate": 2, "shard": 2}]


def _simulated_step(axes, policy, model, idx, tgt, specs=None):
    n = 1
    for s in axes.values():
        n *= s
    with ff.simulated_mesh(axes) as mesh:
        f = ff.fsdp(model, mesh, policy=policy, specs=specs)
        params = f.shard()
        per = idx.shape[0] // n
        x = rank_map(lambda r: idx[r * per : (r + 1) * per])
        y = rank_map(lambda r: tgt[r * per : (r + 1) * per])
        with ff.count_comms() as comms:
            grads, loss = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(params)
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
        losses = ff.rank_values(loss)
        return sum(losses) / len(losses), full, comms, len(f.units) + 1


@pytest.mark.parametrize("axes", MESHES, ids=str)
@pytest.mark.parametrize("name", list(POLICIES))
def test_gpt_matches_single_process(name, axes):
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    loss, grads, comms, units = _simulated_step(axes, POLICIES[name], model, idx, tgt)
    assert abs(loss - ref_loss) < 1e-5
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-5, msg=k)
    shard_axis = "shard" if "shard" in axes else "dp"
    gathers = 2 if POLICIES[name].reshard_after_forward else 1
    assert comms.count("all_gather", shard_axis) == gathers * units
    assert comms.count("reduce_scatter", shard_axis) == units
    assert comms.count("all_reduce", "replicate") == (units if "replicate" in axes else 0)


def test_full_shard_bytes_are_two_psi_and_one_psi():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    _, _, comms, _ = _simulated_step({"dp": 4}, ff.Policy(), model, idx, tgt)
    psi = sum(p.numel() * 4 for p in model.parameters())
    # Exact up to the padding of uneven dims (at most one row per tensor per rank).
    pad = sum(
        (p.shape[0] % 4 and 4 - p.shape[0] % 4) * p[0].numel() * 4 for p in model.parameters()
    )
    assert 2 * psi * 3 // 4 <= comms.bytes("all_gather") <= 2 * (psi + pad) * 3 // 4
    assert psi * 3 // 4 <= comms.bytes("reduce_scatter") <= (psi + pad) * 3 // 4


def test_ddp_specs_all_reduce_once_per_unit():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    loss, grads, comms, units = _simulated_step(
        {"dp": 2}, ff.Policy(), model, idx, tgt, specs=ff.P()
    )
    assert abs(loss - ref_loss) < 1e-5
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-5)
    assert comms.count("all_gather") == 0 and comms.count("all_reduce", "dp") == units


def test_mlp_uneven_frozen_and_module_untouched():
    torch.manual_seed(0)
    model = MLPModel((7, 13, 5, 3))
    model.layers[0].weight.requires_grad_(False)  # frozen: no gradient, no reduce-scatter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward_before = model.forward
    x = torch.randn(6, 7)
    with ff.simulated_mesh({"dp": 3}) as mesh:
        f = ff.fsdp(model, mesh, units=["layers.*"])
        params = f.shard()
        xs = rank_map(lambda r: x[2 * r : 2 * r + 2])
        with ff.count_comms() as comms:
            grads = torch.func.grad(lambda p: f.apply(p, xs).pow(2).mean())(params)
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
    ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean())(
        {k: v.detach() for k, v in model.named_parameters()}
    )
    for k in ref:
        if k == "layers.0.weight":
            assert torch.count_nonzero(full[k]) == 0
        else:
            torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5)
    assert comms.count("reduce_scatter") == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.forward == forward_before and "forward" not in model.layers[0].__dict__


def test_bf16_param_dtype_halves_gather_bytes():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    _, _, fp32, _ = _simulated_step({"dp": 2}, ff.Policy(), model, idx, tgt)
    mp = ff.Policy(
        mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    loss, grads, bf16, _ = _simulated_step({"dp": 2}, mp, model, idx, tgt)
    assert bf16.bytes("all_gather") * 2 == fp32.bytes("all_gather")
    assert bf16.bytes("reduce_scatter") == fp32.bytes("reduce_scatter")  # fp32 reduction
    ref_loss, _ref_grads = W.reference(model, idx, tgt)
    assert abs(loss - ref_loss) < 5e-2
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_bad_units_and_params_raise():
    model = MLPModel()
    with pytest.raises(
        ValueError, match=r"unit pattern 'blocks\.\*' matches no submodule of MLPModel"
    ):
        ff.find_units(model, ["blocks.*"])
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        params = f.shard()
        params.pop("layers.0.bias")
        with pytest.raises(ValueError, match=r"missing \['layers\.0\.bias'\]"):
            f.apply(params, torch.randn(2, 7))


# --------------------------------------------------------------------------- real gloo


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gloo_matches_reference_and_fsdp2(pools, world):
    for kwargs in ({}, {"reshard_after_forward": False}):
        for use_func in (True, False):
            out = pools.run(world, W.fsdp_vs_reference, {"dp": world}, kwargs, use_func)[0]
            assert abs(out["loss"] - out["ref_loss"]) < 1e-5, out
            assert out["grad_err"] < 1e-5, out
    for r in pools.run(world, W.fsdp2_reference):
        assert r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-5, r


@pytest.mark.multiprocess
def test_gloo_hsdp_2x2(pools):
    out = pools.run(4, W.fsdp_vs_reference, {"replicate": 2, "shard": 2}, {}, True)[0]
    assert abs(out["loss"] - out["ref_loss"]) < 1e-5 and out["grad_err"] < 1e-5, out
    assert ("all_reduce", "replicate") in out["comms"]
