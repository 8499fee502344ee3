"""The FSDP engine's second pass: plans as data, no module patching, frozen units, any call
convention, deferred reductions that always finish, fp16 reductions, comm accounting.

Real gloo processes for everything that communicates; a few pure tests of the plan.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import functional_fsdp as ff
from functional_fsdp.fsdp.units import divide_factors

from . import _engine_workers as W


@pytest.mark.multiprocess
def test_gloo_frozen_units_cost_nothing_and_free_their_storage(pools):
    for r in pools.run(2, W.frozen_units):
        assert r["grad_keys"] == ["0.bias", "0.weight", "4.bias", "4.weight"]
        assert r["err"] < 1e-6
        assert r["rs_bytes"] == r["expected_rs_bytes"] > 0
        # The frozen unit 2 is gathered again for backward (its input needs a gradient for
        # unit 0) and freed after it; nothing is left alive.
        assert r["backward_frees"] == ["0", "2", "4"] and r["live_after"] == 0


@pytest.mark.multiprocess
def test_gloo_requires_grad_change_and_replace_use_a_fresh_plan(pools):
    r = pools.run(2, W.requires_grad_changes_and_replace)[0]
    assert r["before"] == ["0.bias", "0.weight", "4.bias", "4.weight"]
    assert r["after"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert r["w0_grad_norm"] > 0 and r["same_as_fresh"]
    assert r["y16_dtype"] == "torch.bfloat16" and r["y16_equal"] and r["plans_differ"]


@pytest.mark.multiprocess
def test_gloo_module_is_never_patched_threads_and_nested_apply(pools):
    r = pools.run(1, W.module_never_patched)[0]
    assert r == {
        "y_ok": True,
        "seen_inside": [(False, True)],  # the user's module kept its forward and Parameters
        "raised": True,
        "untouched": True,
        "threads_ok": True,
        "nested_ok": True,
    }


@pytest.mark.multiprocess
def test_gloo_collectives_do_not_depend_on_the_previous_call(pools):
    assert pools.run(2, W.prefetch_independent_of_previous_call)[0] == {"same": True}


@pytest.mark.multiprocess
def test_gloo_autograd_grad_subset_and_backward_counted_after_the_block(pools):
    for r in pools.run(2, W.autograd_grad_subset_and_counters):
        assert r["subset_ok"] and r["after"] == 2.0
        assert r["forward_rs"] == 0 and r["backward_rs"] == 3


@pytest.mark.multiprocess
def test_gloo_fp16_reduce_is_divided_before_the_sum(pools):
    for r in pools.run(2, W.fp16_reduce_does_not_overflow):
        assert r["finite"] and r["max_err"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gloo_transformers_model_output_and_keyword_inputs(pools, kind):
    for r in pools.run(2, W.hf_outputs, kind):
        assert r["output_type"].startswith("CausalLMOutputWith")
        assert r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-5, r


def test_divide_factors_follow_fsdp2():
    assert divide_factors(8, torch.float32) == (1, 8.0)
    assert divide_factors(8, torch.bfloat16) == (1, 8.0)
    assert divide_factors(8, torch.float16) == (4, 2.0)
    assert divide_factors(2, torch.float16) == (2, 1.0)
    assert divide_factors(1, torch.float16) == (1, 1.0)


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    aux: tuple[torch.Tensor, None]
    name: str = "out"


class MultiIO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, z, *, scale=1.0, mask=None):
        h = self.a(x) * scale + z
        if mask is not None:
            h = h * mask
        return {"out": Out(self.b(h), (h.sum(), None)), "none": None}


def test_any_call_convention_on_a_simulated_mesh():
    torch.manual_seed(0)
    model = MultiIO()
    x, z, mask = torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(model, mesh, units=["a", "b"])
        params = sm.shard()

        def loss(p):
            out = sm.apply(p, x, z, scale=2.0, mask=mask)
            assert out["none"] is None and out["out"].name == "out"
            return out["out"].y.pow(2).sum() + out["out"].aux[0]

        grads = torch.func.grad(loss)(params)
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
    ref = torch.func.grad(
        lambda p: (lambda o: o["out"].y.pow(2).sum() + o["out"].aux[0])(
            torch.func.functional_call(model, p, (x, z), {"scale": 2.0, "mask": mask})
        )
    )({k: v.detach() for k, v in model.named_parameters()})
    for k in ref:  # every rank saw the same inputs: the mean of equal gradients
        torch.testing.assert_close(full[k], ref[k])


def test_each_apply_call_has_one_state_of_its_own_dropped_with_its_graph(monkeypatch):
    """The interpreter creates one CallState per apply call (units, calls, prefetches,
    reductions in flight) and keeps nothing between calls: each is freed, without the cycle
    collector, once the caller drops the call's outputs and gradients."""
    import gc
    import weakref

    from functional_fsdp.fsdp import runtime, units

    made: list[weakref.ref] = []

    class Recorded(units.CallState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(runtime, "CallState", Recorded)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    gc.disable()
    try:
        with ff.simulated_mesh({"dp": 2}) as mesh:
            sm = ff.fsdp(model, mesh, units=["0", "2"])
            params = sm.shard()
            x = torch.randn(4, 4)
            for _ in range(2):
                grads = torch.func.grad(lambda p: sm.apply(p, x).square().sum())(params)
                assert set(grads) == set(params)
                state = made[-1]()
                assert state is None, "a call's state outlived its gradients"
                del grads
            assert len(made) == 2
            out, pullback = torch.func.vjp(lambda p: sm.apply(p, x), params)
            assert made[-1]() is not None  # alive with the call's graph
            assert [c.unit.layout.name for c in made[-1]().calls] == ["0", "2"]
            del out, pullback
            assert made[-1]() is None
    finally:
        gc.enable()


def test_the_gradient_rule_has_one_owner_that_the_plan_follows():
    """fsdp.gradients decides the reduction: reduce-scatter over the data axes a spec shards,
    all-reduce over those it replicates, nothing over model axes; the plan's gather rounds
    and replicated axes are read off it."""
    from functional_fsdp.fsdp.gradients import Reduction, mean_divisor, reduction
    from functional_fsdp.fsdp.layout import model_layout

    data = ("replicate", "shard")
    assert reduction(ff.P("shard"), data) == Reduction(("shard",), ("replicate",))
    assert reduction(ff.P(("tp", "shard"), None), data) == Reduction(("shard",), ("replicate",))
    assert reduction(ff.P(None, "tp"), data) == Reduction((), data)
    sizes = {"replicate": 2, "shard": 3, "tp": 2}
    assert mean_divisor(sizes, data, ff.Policy()) == 6
    assert mean_divisor(sizes, data, ff.Policy(grad_reduce="sum")) == 1
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    specs = {"0.weight": ff.P("shard"), "0.bias": ff.P(), "1.weight": ff.P(None, "tp"),
             "1.bias": ff.P()}  # fmt: skip
    plan = model_layout(model, sizes, specs, ["0", "1"], data, None)
    for up in plan.units.values():
        for name, replicated in zip(up.names, up.replicated):
            assert replicated == reduction(specs[name], data).replicated
        gathered = {(up.names[p.index], rnd.axis) for rnd in up.rounds for p in rnd.pieces}
        assert gathered == {(n, a) for n in up.names for a in reduction(specs[n], data).scattered}


def test_apply_rejects_parameters_of_another_shape():
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 4))
    big = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with ff.simulated_mesh({"dp": 2}) as mesh:
        params = ff.fsdp(small, mesh).shard()
        with pytest.raises(
            ValueError, match=r"params\['0.weight'\] is torch.float32 \(12, 8\).*\(16, 8\)"
        ):
            ff.fsdp(big, mesh).apply(params, torch.ones(1, 8))


def test_fsdp_rejects_a_non_module():
    with (
        ff.simulated_mesh({"dp": 2}) as mesh,
        pytest.raises(TypeError, match=r"takes an nn\.Module"),
    ):
        ff.fsdp("not a module", mesh)  # type: ignore[arg-type]


def test_no_sync_stores_nothing_on_the_object():
    model = nn.Linear(2, 1)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(model, mesh, specs=ff.P())
        state = dict(vars(sm))
        with sm.no_sync():
            assert dict(vars(sm)) == state
        with pytest.raises(ValueError, match=r"grad_reduce=.none.*sharded over data axis .dp."):
            sharded = ff.fsdp(model, mesh, policy=ff.Policy(grad_reduce="none"))
            torch.func.grad(lambda p: sharded.apply(p, torch.ones(1, 2)).sum())(sharded.shard())


@pytest.mark.multiprocess
def test_gloo_cpu_offload_is_bitwise_the_same_training(pools):
    policies = [
        {},
        {"offload": True},
        {"offload": True, "mixed_precision": ff.MixedPrecision(param_dtype=torch.bfloat16)},
    ]
    for r in pools.run(2, W.offload_matches_on_device, policies):
        assert r[1] == {"same_losses": True, "same_params": True, "devices": ["cpu"]}
        assert r[2]["devices"] == ["cpu"]  # bf16 compute: another trajectory, still on the host
