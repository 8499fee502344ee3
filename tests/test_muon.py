"""Muon (``ff.contrib.muon``) against optax.contrib.muon itself: 20 steps, float32 and
float64, on one process and on 2 and 4 gloo ranks (FSDP, ZeRO's optimizer shards, columns,
DDP, HSDP, dp x tp, uneven shapes); each matrix orthogonalized once per step, the work
balanced by flops."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.optim import muon as M

from . import _muon_workers as W

STEPS = 20
OMDN = optax.contrib.MuonDimensionNumbers


def _optax_dims(tree: Any) -> Any:
    return {k: None if v is None else OMDN(*v) for k, v in tree.items()}


def _optax_by_name(p: Any) -> Any:
    """W.by_name for optax (which calls it on masked trees too: ranks come from W.SHAPES)."""
    ndim = {k: len(s) for k, s in W.SHAPES.items()}
    return {
        k: None if ("embed" in k or ndim[k] == 1) else (OMDN(1, 2) if ndim[k] == 3 else OMDN())
        for k in p
    }


def _optax_decay(p: Any) -> Any:
    return {k: len(W.SHAPES[k]) == 2 for k in p}


OPTAX = {
    "defaults": lambda: optax.contrib.muon(1e-2, muon_weight_dimension_numbers=_optax_by_name),
    "options": lambda: optax.contrib.muon(
        2e-2,
        "dion",
        5,
        0.9,
        1e-7,
        0.1,
        _optax_decay,
        nesterov=False,
        adaptive=True,
        preconditioning="aol",
        adam_b1=0.8,
        adam_weight_decay=0.01,
        adam_learning_rate=5e-3,
        muon_weight_dimension_numbers=_optax_dims(W.DIMS_TREE),
        consistent_rms=0.2,
    ),
    "schatten": lambda: optax.contrib.muon(
        1e-2, ns_steps=4, preconditioning="schatten", muon_weight_dimension_numbers=_optax_by_name
    ),
    "spectral": lambda: optax.contrib.muon(
        1e-2, preconditioning="spectral", muon_weight_dimension_numbers=_optax_by_name
    ),
    "clip_chain": lambda: optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.contrib.muon(1e-2, muon_weight_dimension_numbers=_optax_by_name),
    ),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.contrib.muon)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 2e-2, 3, 20), weight_decay=0.05
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(
        optax.contrib.muon(1e-2, muon_weight_dimension_numbers=_optax_by_name), 2
    ),
    "multi_steps": lambda: optax.MultiSteps(
        optax.contrib.muon(1e-2, muon_weight_dimension_numbers=_optax_by_name), 2
    ),
}
OPTAX.update(
    split=OPTAX["defaults"],
    split_options=OPTAX["options"],
    split_spectral=OPTAX["spectral"],
    split_schatten=OPTAX["schatten"],
)
assert set(OPTAX) == set(W.CASES)
TOL = {"float32": dict(rtol=1e-4, atol=2e-5), "float64": dict(rtol=1e-10, atol=1e-12)}


@functools.cache
def _optax_run(name: str, dtype: str) -> dict[str, torch.Tensor]:
    with jax.enable_x64(dtype == "float64"):
        opt = OPTAX[name]()
        tdtype = getattr(torch, dtype)
        p = {k: jnp.asarray(v.numpy()) for k, v in W.params(tdtype).items()}
        state = opt.init(p)
        update = jax.jit(opt.update)
        for g in W.grads(STEPS, tdtype):
            updates, state = update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, state, p)
            p = optax.apply_updates(p, updates)
        return {k: torch.from_numpy(np.asarray(v).copy()) for k, v in p.items()}


def _assert_close(
    ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str, dtype: str
) -> None:
    start = W.params(getattr(torch, dtype))
    for k in ref:
        assert ours[k].dtype == ref[k].dtype, (what, k)
        torch.testing.assert_close(ours[k], ref[k], **TOL[dtype], msg=f"{what}: {k}")
        assert not torch.equal(ref[k], start[k]), (what, k)


ONE_PROCESS = [(n, d) for n in ("defaults", "options", "schatten", "spectral") for d in TOL]
ONE_PROCESS += [
    (n, "float32") for n in ("clip_chain", "inject_schedule", "apply_if_finite", "multi_steps")
]


@pytest.mark.parametrize(("name", "dtype"), ONE_PROCESS)
def test_matches_optax_on_one_process(name: str, dtype: str) -> None:
    tdtype = getattr(torch, dtype)
    ours = W.run(name, W.params(tdtype), W.grads(STEPS, tdtype))
    _assert_close(ours, _optax_run(name, dtype), name, dtype)


def test_signature_positional_order_and_defaults_are_optax() -> None:
    import inspect

    for ours, theirs in (
        (ff.contrib.muon, optax.contrib.muon),
        (ff.contrib.scale_by_muon, optax.contrib.scale_by_muon),
    ):
        a, b = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
        # optax's parameters, in its order, then this library's one extension.
        assert list(a) == [*b, "matrix_budget_bytes"]
        extra = a["matrix_budget_bytes"]
        assert (extra.kind, extra.default) == (inspect.Parameter.KEYWORD_ONLY, None)
        for k in b:
            assert a[k].kind == b[k].kind, k
            if k not in ("ns_coeffs", "mu_dtype", "muon_weight_dimension_numbers"):
                assert a[k].default == b[k].default, k
    assert tuple(float(c) for c in optax.contrib._muon._DEFAULT_NS_COEFFS) == M.DEFAULT_NS_COEFFS


def test_default_rule_takes_every_matrix_like_optax() -> None:
    """No rule: every rank-2 leaf is Muon's (the embedding too), as in optax."""
    p = W.params()
    p.pop("t")
    steps = [{k: v for k, v in g.items() if k != "t"} for g in W.grads(3)]
    opt = ff.contrib.muon(1e-2)
    state = opt.init(p)
    ours = p
    for g in steps:
        u, state = opt.update(g, state, ours)
        ours = ff.apply_updates(ours, u)
    ref_opt = optax.contrib.muon(1e-2)
    jp = {k: jnp.asarray(v.numpy()) for k, v in p.items()}
    rs = ref_opt.init(jp)
    for g in steps:
        u, rs = ref_opt.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, rs, jp)
        jp = optax.apply_updates(jp, u)
    for k in jp:
        torch.testing.assert_close(
            ours[k], torch.from_numpy(np.asarray(jp[k]).copy()), **TOL["float32"]
        )


def test_errors_name_the_leaf_and_the_fix() -> None:
    p = {"v": torch.ones(3)}
    t = ff.contrib.scale_by_muon()
    with pytest.raises(ValueError, match=r"scale_by_muon: v: shape \(3,\) is not a matrix.*Adam"):
        t.update(p, t.init(p))
    with pytest.raises(ValueError, match=r"unknown ns_coeffs preset 'fast'"):
        ff.contrib.muon(1e-2, "fast")
    with pytest.raises(ValueError, match=r"6 rows of ns_coeffs for ns_steps=5"):
        ff.contrib.scale_by_muon(((1.0, 2.0, 3.0),) * 6)
    with pytest.raises(TypeError, match=r"the rule gives 3 for w"):
        ff.contrib.muon(1e-2, muon_weight_dimension_numbers=lambda path, p: 3).init(
            {"w": torch.ones(2, 2)}
        )
    with pytest.raises(ValueError, match=r"overlap for shape \(2, 2\)"):
        ff.contrib.muon(1e-2, muon_weight_dimension_numbers={"w": W.MDN(0, 0)}).update(
            {"w": torch.ones(2, 2)},
            ff.contrib.muon(1e-2).init({"w": torch.ones(2, 2)}),
            {"w": torch.ones(2, 2)},
        )


def test_a_matrix_over_the_budget_is_split_or_refused_by_name() -> None:
    """matrix_budget_bytes: a matrix over it, sharded over several ranks, is orthogonalized
    by all of them together (the gloo tests below check the numbers); one that is not (a
    plain tensor) is refused at init by name, with the fixes. At the budget, nothing
    changes; ff.plan prices the split."""
    rule = W.by_name  # w (7, 3), c (3, 7), q (5, 5), t (2, 3, 4) to Muon
    over = ff.contrib.muon(1e-2, muon_weight_dimension_numbers=rule, matrix_budget_bytes=99)
    with pytest.raises(
        ValueError,
        match=r"muon.*: q of shape \(5, 5\) \(torch.float32\) takes 100 B whole, over "
        r"matrix_budget_bytes=99, and is not sharded over several ranks.*ff.shard.*"
        r"at least 100.*Adam",
    ):
        over.init(W.params())
    full = W.params()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        over.init(ff.shard(full, mesh, W.LAYOUTS["fsdp"][1]))  # split, not refused
    grads = W.grads(3)
    at = W.run("defaults", W.params(), grads)
    budget = ff.contrib.muon(1e-2, muon_weight_dimension_numbers=rule, matrix_budget_bytes=100)
    state, ours = budget.init(W.params()), W.params()
    for g in grads:
        u, state = budget.update(g, state, ours)
        ours = ff.apply_updates(ours, u)
    assert all(torch.equal(ours[k], at[k]) for k in at)
    # The planner: 1.weight (512 B) is split over both ranks: each holds half of it (the
    # owners' exchange holds 0.weight whole on one rank), and the split adds all-reduces.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    whole = ff.plan(model, {"dp": 2}, optimizer=ff.contrib.muon(1e-2))
    split = ff.plan(model, {"dp": 2}, optimizer=ff.contrib.muon(1e-2, matrix_budget_bytes=300))
    assert split.owner_peak_bytes < whole.owner_peak_bytes

    def reduced(report: Any) -> int:
        return sum(c.bytes for c in report.comms if c.kind == "all_reduce")

    # Per Newton-Schulz step one 8 x 8 float32 X Xᵀ, and one norm: 5 * 256 + 4 bytes.
    assert reduced(split) - reduced(whole) == 5 * 8 * 8 * 4 + 4
    with pytest.raises(TypeError, match="matrix_budget_bytes must be a positive int"):
        ff.contrib.muon(1e-2, matrix_budget_bytes=0).init(W.params())


def test_owners_balance_flops_on_a_llama_of_8_layers_over_4_ranks() -> None:
    from transformers import LlamaForCausalLM

    from ._hf import tiny_llama_config

    assert M.assign_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    with torch.device("meta"):
        model = LlamaForCausalLM(
            tiny_llama_config(num_hidden_layers=8, hidden_size=64, intermediate_size=172)
        )
    matrices = [
        (tuple(p.shape), dims)
        for name, p in model.named_parameters()
        if (dims := W.llama_rule(name, p)) is not None
    ]
    assert len(matrices) == 8 * 7  # q, k, v, o, gate, up, down
    flops = [M.ns_flops(s, d, 5) for s, d in matrices]
    owners = M.assign_owners(flops, 4)
    load = [sum(f for f, o in zip(flops, owners) if o == r) for r in range(4)]
    assert max(load) / (sum(load) / 4) <= 1.25, load
    assert M.assign_owners([8] + [1] * 8, 2) == [0] + [1] * 8  # by flops, not by count


def test_simulated_mesh_gives_the_same_numbers() -> None:
    """A simulated mesh (every rank orthogonalizes every matrix there) gives optax's numbers."""
    params, grads = W.params(), W.grads(5)
    ref_p = W.run("defaults", params, grads)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        specs = W.LAYOUTS["fsdp"][1]
        p = ff.shard(params, mesh, specs)
        steps = [ff.shard(g, mesh, specs) for g in grads]
        got = ff.gather(W.run("defaults", p, steps))
        for k, v in ref_p.items():
            for value in ff.rank_values(got[k]):
                torch.testing.assert_close(value, v, **TOL["float32"])


RANK_CASES_2 = [
    ("fsdp", "split", "float32"),
    ("columns", "split_spectral", "float64"),
    ("ddp", "split_schatten", "float32"),
    ("fsdp", "defaults", "float32"),
    ("fsdp", "options", "float64"),
    ("columns", "defaults", "float64"),
    ("ddp", "schatten", "float32"),
    ("columns", "clip_chain", "float32"),
    ("fsdp", "inject_schedule", "float32"),
    ("fsdp", "apply_if_finite", "float32"),
    ("fsdp", "multi_steps", "float32"),
]
RANK_CASES_4 = [
    ("fsdp4", "defaults", "float32"),
    ("fsdp4", "options", "float64"),
    ("hsdp", "defaults", "float64"),
    ("dp_tp", "defaults", "float32"),
    ("dp_tp", "options", "float64"),
    ("fsdp4", "split_options", "float64"),
    ("hsdp", "split", "float32"),
    ("dp_tp", "split_options", "float32"),
    ("dp_tp", "split", "float64"),
]


BY_NAME = {"w": W.MDN(), "c": W.MDN(), "q": W.MDN(), "t": W.MDN(1, 2)}
MUON_LEAVES = {
    "options": {k: v for k, v in W.DIMS_TREE.items() if v is not None},
    "inject_schedule": {"w": W.MDN(), "c": W.MDN(), "q": W.MDN(), "embed": W.MDN()},
}


def _muon_leaves(name: str, dtype: str) -> tuple[dict[str, Any], set[str]]:
    """The case's Muon leaves (name: dimension numbers), and those over its budget."""
    leaves = MUON_LEAVES.get(name.removeprefix("split_"), BY_NAME)
    size = getattr(torch, dtype).itemsize
    budget = W.BUDGET.get(name, math.inf)
    return leaves, {k for k in leaves if math.prod(W.SHAPES[k]) * size > budget}


def _predicted_bytes(layout: str, name: str, dtype: str) -> list[int]:
    axes, specs = W.LAYOUTS[layout]
    leaves, split = _muon_leaves(name, dtype)
    matrices = [  # in the tree's order
        (W.SHAPES[k], specs[k], leaves[k], getattr(torch, dtype), k in split)
        for k in sorted(leaves)
    ]
    return M.exchange_bytes(matrices, axes, getattr(torch, dtype).itemsize)


def _check_ranks(results: list[dict[str, Any]], cases: list[tuple[str, str, str]]) -> None:
    world = len(results)
    for layout, name, dtype in cases:
        key = f"{layout}/{name}/{dtype}"
        if name != "multi_steps":  # priced from shapes = what the step sends, per rank
            assert [r[key]["all_to_all"] for r in results] == _predicted_bytes(layout, name, dtype)
        ref = _optax_run(name, dtype)
        for r in results:
            _assert_close(r[key]["params"], ref, key, dtype)
        # Each whole matrix orthogonalized exactly once per step, over all ranks together;
        # each split one by every rank, on its block. by_name: w, c, q, t (embed and b go
        # to Adam); options: w, c, t, embed; inject_schedule (optax's default rule): w, c,
        # q, embed. MultiSteps: none on step 1.
        leaves, split = _muon_leaves(name, dtype)
        whole = 0 if name == "multi_steps" else len(leaves) - len(split)
        calls = [c for r in results for c in r[key]["calls"]]
        assert len(calls) == whole, (key, calls)
        assert all(len(r[key]["calls"]) <= -(-whole // world) + 1 for r in results), key
        expected = sorted(W.SHAPES[k] for k in split)
        assert all(sorted(r[key]["split_calls"]) == expected for r in results), key


@pytest.mark.multiprocess
def test_matches_optax_on_two_ranks(pools: Any) -> None:
    _check_ranks(pools.run(2, W.on_ranks, RANK_CASES_2, STEPS), RANK_CASES_2)


@pytest.mark.multiprocess
def test_matches_optax_on_four_ranks(pools: Any) -> None:
    _check_ranks(pools.run(4, W.on_ranks, RANK_CASES_4, STEPS), RANK_CASES_4)


@pytest.mark.multiprocess
def test_llama_train_step_on_layouts_equals_one_process(pools: Any) -> None:
    """A transformers Llama (embeddings, head and norms through Adam) trained 3 steps by
    train_step: FSDP with donation, FSDP under ff.jit and ZeRO-2 with master weights on 2
    ranks, FSDP + TP on 2 x 2, each equal to one process; ff.plan prices the all-to-alls rank
    0 sends."""
    ref = W.llama_reference(3)
    on_two = ["fsdp_donate", "fsdp_jit", "zero2_masters", "fsdp_split"]
    on_four = ["dp_tp", "dp_tp_split"]
    two = pools.run(2, W.llama_on_ranks, on_two, 3)
    four = pools.run(4, W.llama_on_ranks, on_four, 3)
    for results, layouts in ((two, on_two), (four, on_four)):
        for layout in layouts:
            for r in results:
                for k, v in ref.items():
                    torch.testing.assert_close(
                        # TP's partial sums round differently; Adam's first steps
                        # magnify that on small gradients (lm_head: 1.1e-5 measured).
                        r[layout]["params"][k],
                        v,
                        rtol=1e-4,
                        atol=5e-5,
                        msg=f"{layout}: {k}",
                    )
                assert r[layout]["all_to_all"] > 0, layout
    # The planner prices the same all-to-alls, from shapes, for rank 0.
    model = W.llama()
    muon = ff.contrib.muon(2e-2, muon_weight_dimension_numbers=W.llama_rule)
    from functional_fsdp.models import llama_plan

    split = ff.contrib.muon(
        2e-2, muon_weight_dimension_numbers=W.llama_rule, matrix_budget_bytes=W.LLAMA_BUDGET
    )
    tp_plan = llama_plan(model.config, loss_parallel=False)
    plans = {
        "fsdp_donate": ff.plan(model, {"dp": 2}, optimizer=muon),
        "fsdp_split": ff.plan(model, {"dp": 2}, optimizer=split),
        "dp_tp_split": ff.plan(model, {"dp": 2, "tp": 2}, optimizer=split, tp_plan=tp_plan),
        "zero2_masters": ff.plan(
            model, {"dp": 2}, specs=ff.P(), opt_specs=ff.P("dp"), optimizer=muon
        ),
        "dp_tp": ff.plan(model, {"dp": 2, "tp": 2}, optimizer=muon, tp_plan=tp_plan),
    }
    measured = {**two[0], **four[0]}
    for layout, report in plans.items():
        priced = sum(c.bytes for c in report.comms if c.kind == "all_to_all")
        assert priced == measured[layout]["all_to_all"], layout
    # ... and the owners' memory, rank by rank: the peak of tensor memory the exchange of
    # the step's own momentum adds, measured by torch's profiler on each gloo rank.
    for results, layouts in (
        (two, ["fsdp_donate", "zero2_masters", "fsdp_split"]),
        (four, ["dp_tp", "dp_tp_split"]),
    ):
        for layout in layouts:
            held = [r[layout]["exchange_peak"] for r in results]
            assert list(plans[layout].owner_bytes) == held, (layout, held)
            assert plans[layout].owner_peak_bytes == max(held) > 0, layout
    # A split matrix adds one all-reduce per Newton-Schulz step and one for its norm: the
    # plan's extra all-reduce bytes are the step's.
    for whole, split_layout in (("fsdp_donate", "fsdp_split"), ("dp_tp", "dp_tp_split")):

        def reduced(report: Any) -> int:
            return sum(c.bytes for c in report.comms if c.kind == "all_reduce")

        extra = reduced(plans[split_layout]) - reduced(plans[whole])
        assert extra == measured[split_layout]["all_reduce"] - measured[whole]["all_reduce"] > 0
    report = plans["fsdp_donate"]
    without = ff.plan(model, {"dp": 2}, optimizer="adamw")
    assert report.peak_bytes - report.owner_peak_bytes < without.peak_bytes  # one moment
    assert report.owner_bytes[report.owner_peak_rank] == report.owner_peak_bytes


@pytest.mark.multiprocess
def test_checkpoint_saved_on_four_ranks_resumes_on_two_and_four(pools: Any, tmp_path: Any) -> None:
    """Muon's state (momentum shards, count, coefficients) saved on 4 ranks: resumed on 4 it
    is bitwise the uninterrupted run; resharded onto 2 it is optax's numbers."""
    path = str(tmp_path / "ckpt")
    uninterrupted = pools.run(4, W.checkpoint_save, path, 8, 4)
    on_four = pools.run(4, W.checkpoint_resume, path, 8, 4)
    on_two = pools.run(2, W.checkpoint_resume, path, 8, 4)
    ref = W.run("defaults", W.params(), W.grads(8))
    for a, b in zip(uninterrupted, on_four):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for r in on_two:
        for k, v in ref.items():
            torch.testing.assert_close(r[k], v, **TOL["float32"])


def test_compare_strategies_prices_adamw_and_muon_side_by_side() -> None:
    """One call, two optimizers: each strategy's AdamW and Muon reports next to each other,
    each the plan of that optimizer alone; Muon's owners' memory in the peak."""
    from functional_fsdp.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))

    def matrices(path: str, p: Any) -> Any:
        return None if p.ndim != 2 or "emb" in path or "head" in path else W.MDN(1, 0)

    muon = ff.contrib.muon(2e-2, muon_weight_dimension_numbers=matrices)
    cmp = ff.compare_strategies(
        model, 4, strategies=("zero3", "zero2"), optimizer={"adamw": "adamw", "muon": muon}
    )
    names = ["zero3/adamw", "zero3/muon", "zero2/adamw", "zero2/muon"]
    assert [r.name for r in cmp.reports] == names
    alone = {
        "zero3/muon": ff.plan(model, {"dp": 4}, optimizer=muon),
        "zero2/adamw": ff.plan(model, {"dp": 4}, specs=ff.P(), opt_specs=ff.P("dp")),
    }
    for name, report in alone.items():
        got = cmp[name]
        assert (got.opt_state_bytes, got.owner_bytes, got.comms, got.peak_bytes) == (
            report.opt_state_bytes,
            report.owner_bytes,
            report.comms,
            report.peak_bytes,
        ), name
    for s in ("zero3", "zero2"):
        adamw, mu = cmp[f"{s}/adamw"], cmp[f"{s}/muon"]
        assert mu.opt_state_bytes < adamw.opt_state_bytes  # one moment for the matrices
        assert adamw.owner_bytes == () and len(mu.owner_bytes) == 4 and mu.owner_peak_bytes > 0
        assert mu.comm_bytes("all_to_all") > 0 == adamw.comm_bytes("all_to_all")
    assert "owners' exchange (rank" in cmp["zero3/muon"].summary()
    with pytest.raises(ValueError, match="at least one optimizer"):
        ff.compare_strategies(model, 4, optimizer={})
