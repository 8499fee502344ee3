"""Optimizers: equivalence with torch.optim, schedules, masks, purity, mesh-aware norms."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch

import functional_fsdp as ff
import functional_fsdp.optim.schedules as fs
import functional_fsdp.optim.transforms as fo
from functional_fsdp._tree import tree_leaves, tree_map
from functional_fsdp.optim.clipping import clip_by_global_norm, global_norm

STEPS = 20


def no_decay(path: str, p: Any) -> bool:
    """Decay matrices only: skip biases and norm weights."""
    return not path.endswith("bias") and p.ndim >= 2


def _model_params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "embed": {"weight": torch.randn(7, 5, generator=g)},
        "blocks": [
            {
                "attn": {
                    "weight": torch.randn(5, 5, generator=g),
                    "bias": torch.randn(5, generator=g),
                },
                "norm": {"weight": 1 + 0.1 * torch.randn(5, generator=g)},
            }
        ],
        "head": {
            "weight": torch.randn(3, 5, generator=g, dtype=torch.float64),
            "bias": torch.randn(3, generator=g),
        },
    }


def _grads(params: Any, steps: int = STEPS, seed: int = 2) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)
        for _ in range(steps)
    ]


def _run(opt: fo.GradientTransformation, params: Any, grads: list[Any]) -> tuple[Any, Any]:
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = fo.apply_updates(params, updates)
    return params, state


def _run_torch(
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    params: Any,
    grads: list[Any],
    decay_mask: Callable[[str, Any], bool] | None = None,
    lr_lambda: Callable[[int], float] | None = None,
) -> list[torch.Tensor]:
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    tensors = [p.clone().requires_grad_() for p in leaves]
    if decay_mask is None:
        groups = [{"params": tensors}]
    else:
        flags = [decay_mask(".".join(map(str, path)), p) for path, p in zip(paths, leaves)]
        groups = [
            {"params": [t for t, f in zip(tensors, flags) if f]},
            {"params": [t for t, f in zip(tensors, flags) if not f], "weight_decay": 0.0},
        ]
    opt = make(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for g in grads:
        for t, gi in zip(tensors, optree.tree_leaves(g)):
            t.grad = gi.clone()
        opt.step()
        if sched is not None:
            sched.step()
    return [t.detach() for t in tensors]


def _assert_rel(ours: Any, ref: list[torch.Tensor], start: Any, tol: float = 1e-6) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(ours)
    for path, a, b, p0 in zip(paths, leaves, ref, optree.tree_leaves(start)):
        assert a.dtype == b.dtype, path
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= tol, f"{path}: relative error {err:.2e} > {tol:.0e}"
        assert not torch.equal(b, p0), f"{path}: the reference did not move"


# --------------------------------------------------------------------------- vs torch.optim

CASES = {
    "sgd": (lambda: fo.sgd(0.1), lambda g: torch.optim.SGD(g, lr=0.1)),
    "sgd_momentum": (
        lambda: fo.sgd(0.05, momentum=0.9),
        lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9),
    ),
    "sgd_nesterov": (
        lambda: fo.sgd(0.05, momentum=0.8, nesterov=True),
        lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.8, nesterov=True),
    ),
    "sgd_weight_decay": (
        lambda: fo.sgd(0.05, momentum=0.9, weight_decay=0.1),
        lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=0.1),
    ),
    "adam": (lambda: fo.adam(1e-2), lambda g: torch.optim.Adam(g, lr=1e-2)),
    "adam_hyper": (
        lambda: fo.adam(3e-2, b1=0.8, b2=0.95, eps=1e-3),
        lambda g: torch.optim.Adam(g, lr=3e-2, betas=(0.8, 0.95), eps=1e-3),
    ),
    "adam_weight_decay": (
        lambda: fo.adam(1e-2, weight_decay=0.5),
        lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.5),
    ),
    "adamw": (
        lambda: fo.adamw(1e-2, weight_decay=0.5),
        lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.5),
    ),
    "adamw_hyper": (
        lambda: fo.adamw(3e-2, b1=0.8, b2=0.95, eps=1e-3, weight_decay=2.0),
        lambda g: torch.optim.AdamW(g, lr=3e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=2.0),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_optim(name: str) -> None:
    ours, theirs = CASES[name]
    params = _model_params()
    grads = _grads(params)
    out, _ = _run(ours(), params, grads)
    _assert_rel(out, _run_torch(theirs, params, grads), params)


def test_masked_adamw_matches_torch_param_groups() -> None:
    params = _model_params()
    grads = _grads(params)
    out, _ = _run(fo.adamw(1e-2, weight_decay=1.0, mask=no_decay), params, grads)
    ref = _run_torch(
        lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=1.0), params, grads, no_decay
    )
    _assert_rel(out, ref, params)
    unmasked, _ = _run(fo.adamw(1e-2, weight_decay=1.0), params, grads)
    assert not torch.allclose(unmasked["head"]["bias"], out["head"]["bias"])


@pytest.mark.parametrize("mask", ["predicate", "tree"])
def test_masked_weight_decay_skips_biases_and_norms(mask: str) -> None:
    params = _model_params()
    tree_mask = {
        "embed": True,
        "blocks": [{"attn": {"weight": True, "bias": False}, "norm": False}],
        "head": {"weight": True, "bias": False},
    }
    opt = fo.adamw(0.1, weight_decay=0.5, mask=no_decay if mask == "predicate" else tree_mask)
    zeros = tree_map(torch.zeros_like, params)  # Adam's step is 0: only the decay acts
    updates, _ = opt.update(zeros, opt.init(params), params)
    new = fo.apply_updates(params, updates)
    decayed = {"embed.weight", "blocks.0.attn.weight", "head.weight"}
    for path, p, p0 in zip(*optree.tree_flatten_with_path(new)[:2], optree.tree_leaves(params)):
        name = ".".join(map(str, path))
        if name in decayed:
            torch.testing.assert_close(p, p0 * (1 - 0.1 * 0.5), rtol=1e-6, atol=0)
        else:
            assert torch.equal(p, p0), f"{name} was decayed"


def test_masked_state_covers_only_masked_leaves() -> None:
    params = _model_params()
    opt = fo.masked(fo.scale_by_adam(), no_decay)
    state = opt.init(params)
    mu = state.inner_state.mu
    assert mu["blocks"][0]["attn"]["bias"] is None and mu["head"]["bias"] is None
    assert len(tree_leaves(mu)) == 3  # embed, attn and head weights
    updates, _ = opt.update(_grads(params, steps=1)[0], state, params)
    assert torch.equal(updates["head"]["bias"], _grads(params, steps=1)[0]["head"]["bias"])


# --------------------------------------------------------------------------- schedules


def test_schedule_values() -> None:
    assert fs.constant_schedule(0.3)(12345) == 0.3
    lin = fs.linear_schedule(0.5, 0.1, transition_steps=10, transition_begin=5)
    for t, want in [(0, 0.5), (5, 0.5), (10, 0.3), (15, 0.1), (100, 0.1)]:
        assert lin(t) == pytest.approx(want, rel=1e-12), t
    cos = fs.cosine_decay_schedule(2.0, decay_steps=100, alpha=0.1)
    for t in [0, 25, 50, 99, 100, 150]:
        want = 2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 100) / 100)) + 0.1)
        assert cos(t) == pytest.approx(want, rel=1e-12), t
    assert cos(100) == pytest.approx(0.2)


def test_warmup_cosine_decay_schedule() -> None:
    s = fs.warmup_cosine_decay_schedule(0.1, 1.0, warmup_steps=10, decay_steps=110, end_value=0.05)
    expected = {0: 0.1, 5: 0.55, 10: 1.0, 60: 0.05 + 0.95 * 0.5, 110: 0.05, 500: 0.05}
    for t, want in expected.items():
        assert s(t) == pytest.approx(want, rel=1e-12), t
    t = 35
    want = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (t - 10) / 100))
    assert s(t) == pytest.approx(want, rel=1e-12)
    no_warmup = fs.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=0, decay_steps=4)
    assert [no_warmup(i) for i in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0])


def test_join_schedules() -> None:
    s = fs.join_schedules([fs.constant_schedule(1.0), fs.linear_schedule(1.0, 0.0, 4)], [3])
    assert [s(i) for i in range(8)] == [1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize("kind", ["adamw_warmup_cosine", "sgd_linear"])
def test_scheduled_lr_through_chain_matches_lambda_lr(kind: str) -> None:
    params = _model_params()
    grads = _grads(params)
    if kind == "adamw_warmup_cosine":
        peak = 3e-2
        sched = fs.warmup_cosine_decay_schedule(0.0, peak, warmup_steps=5, decay_steps=15)
        ours = fo.chain(clip_by_global_norm(1e9, eps=1e-6), fo.adamw(sched, weight_decay=0.5))
        make = lambda g: torch.optim.AdamW(g, lr=peak, weight_decay=0.5)  # noqa: E731
    else:
        peak = 0.1
        sched = fs.linear_schedule(peak, 0.01, transition_steps=12, transition_begin=3)
        ours = fo.sgd(sched, momentum=0.9)
        make = lambda g: torch.optim.SGD(g, lr=peak, momentum=0.9)  # noqa: E731
    out, state = _run(ours, params, grads)
    ref = _run_torch(make, params, grads, lr_lambda=lambda t: sched(t) / peak)
    _assert_rel(out, ref, params)
    # The scheduled rate's state: its count, and the rate of the last update (recorded).
    is_count = lambda x: isinstance(x, fo.ScaleByLearningRateState)  # noqa: E731
    counts = [x for x in optree.tree_leaves(state, is_leaf=is_count) if is_count(x)]
    assert counts == [fo.ScaleByLearningRateState(STEPS, sched(STEPS - 1))]


# --------------------------------------------------------------------------- purity


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: fo.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
        lambda: fo.chain(
            clip_by_global_norm(0.5, eps=1e-6), fo.adamw(1e-2, mask=no_decay, weight_decay=0.01)
        ),
        lambda: fo.adam(1e-2, weight_decay=0.1),
    ],
    ids=["sgd", "clip_adamw_masked", "adam"],
)
def test_update_is_pure(make: Callable[[], fo.GradientTransformation]) -> None:
    opt = make()
    params = _model_params()
    grads = _grads(params, steps=2)
    state = opt.init(params)
    _, state = opt.update(grads[0], state, params)  # a state with non-zero moments
    inputs = [params, grads[1], state]
    before = [[(t.clone(), t._version, t.data_ptr()) for t in _tensors(x)] for x in inputs]
    updates, new_state = opt.update(grads[1], state, params)
    new_params = fo.apply_updates(params, updates)
    for x, saved in zip(inputs, before):
        for t, (value, version, ptr) in zip(_tensors(x), saved):
            assert t._version == version and t.data_ptr() == ptr
            assert torch.equal(t, value)
    old = {t.data_ptr() for x in inputs for t in _tensors(x)}
    assert not old & {t.data_ptr() for t in _tensors(new_params)}
    assert not old & {t.data_ptr() for t in _tensors(new_state)}


@pytest.mark.parametrize(
    "make",
    [
        lambda: fo.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda: fo.chain(clip_by_global_norm(0.5, eps=1e-6), fo.adamw(1e-2, weight_decay=0.5)),
    ],
    ids=["sgd", "clip_adamw"],
)
def test_donation_is_an_update_argument_bitwise_as_out_of_place(
    make: Callable[[], fo.GradientTransformation],
) -> None:
    """``update(..., donate=True)`` writes the updates and the state in place (their tensors
    are reused: a donated step allocates no optimizer-sized buffer) and gives the numbers of
    the pure update; without it nothing is written."""
    opt = make()
    assert isinstance(opt, fo.GradientTransformationExtraArgs)
    params = _model_params()
    grads = _grads(params, steps=3)
    pure = donated = opt.init(params)
    for g in grads:
        want, pure = opt.update(g, pure, params)
        mine = tree_map(torch.clone, g)
        ptrs = {t.data_ptr() for t in _tensors(mine)} | {t.data_ptr() for t in _tensors(donated)}
        got, donated = opt.update(mine, donated, params, donate=True)
        assert all(torch.equal(a, b) for a, b in zip(_tensors(want), _tensors(got)))
        assert all(torch.equal(a, b) for a, b in zip(_tensors(pure), _tensors(donated)))
        assert {t.data_ptr() for t in _tensors(donated)} <= ptrs  # written in place
        assert {t.data_ptr() for t in _tensors(got)} <= ptrs  # the updates too: no new buffers


def test_grad_norm_goes_to_the_first_member_of_a_chain_only() -> None:
    """``grad_norm`` describes the updates a chain receives: its first member may use it,
    later ones (which see transformed updates) and a mask's inner one compute their own."""
    g = {"w": torch.tensor([3.0, 4.0])}
    told = torch.tensor(50.0)  # not the norm (5.0): shows who used it
    first = fo.chain(clip_by_global_norm(1.0, eps=1e-6), fo.identity())
    u, _ = first.update(g, first.init(g), grad_norm=told)
    assert torch.allclose(u["w"], g["w"] / 50.0)
    later = fo.chain(fo.scale(2.0), clip_by_global_norm(1.0, eps=1e-6))
    u, _ = later.update(g, later.init(g), grad_norm=told)
    assert torch.allclose(u["w"], torch.tensor([0.6, 0.8]), atol=1e-6)
    inside = fo.masked(clip_by_global_norm(1.0, eps=1e-6), {"w": True})
    u, _ = inside.update(g, inside.init(g), grad_norm=told)
    assert torch.allclose(u["w"], torch.tensor([0.6, 0.8]), atol=1e-6)


def test_an_extra_args_update_gets_only_the_keywords_it_names() -> None:
    """A GradientTransformationExtraArgs written for ``finite=`` alone (no ``**kwargs``)
    still works under train_step, which also passes ``donate=`` and ``grad_norm=``."""
    seen = {}

    def update(updates, state, params=None, *, finite=None):
        seen["finite"] = finite
        return updates, state

    mine = fo.GradientTransformationExtraArgs(lambda params: fo.EmptyState(), update)
    opt = fo.chain(mine, fo.sgd(0.5))
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local", donate=True)
    state, _ = step(ff.TrainState.create({"w": torch.ones(2)}, opt), torch.ones(2))
    assert torch.equal(state.params["w"], torch.full((2,), 0.5)) and bool(seen["finite"])


def test_apply_updates_keeps_param_dtype() -> None:
    params = {"w": torch.ones(3, dtype=torch.bfloat16), "v": torch.ones(2, dtype=torch.float64)}
    updates = {"w": torch.full((3,), -0.5), "v": torch.full((2,), -0.25, dtype=torch.float64)}
    new = fo.apply_updates(params, updates)
    assert new["w"].dtype == torch.bfloat16 and new["w"].tolist() == [0.5] * 3
    assert new["v"].dtype == torch.float64 and new["v"].tolist() == [0.75] * 2


# --------------------------------------------------------------------------- global norm

SPECS_2D = {
    "a": ff.P(),
    "b": ff.P("dp"),
    "c": ff.P(("tp", "dp")),
    "d": ff.P(None, "tp"),
    "e": ff.P("dp", "tp"),
}
SPECS_1D = {"a": ff.P(), "b": ff.P("dp"), "c": ff.P("dp"), "d": ff.P(None, "dp"), "e": ff.P()}
# A sharded 1-D "bias": masks must see its path as "bias".
SPECS_2D["bias"] = ff.P(("dp", "tp"))
SPECS_1D["bias"] = ff.P("dp")


def _mixed_full(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (4, 3), "b": (5, 3), "c": (9, 2), "d": (3, 5), "e": (5, 7), "bias": (7,)}
    full = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    full["e"] = full["e"].double()
    return full


def _full_norm(tree: dict[str, torch.Tensor]) -> float:
    return torch.linalg.vector_norm(
        torch.cat([t.double().reshape(-1) for t in tree.values()])
    ).item()


def test_global_norm_plain_tensors_matches_torch() -> None:
    grads = _grads(_model_params(), steps=1)[0]
    norm = global_norm(grads)
    assert norm.dtype == torch.float64  # one leaf is float64, so every leaf counts in float64
    exact = torch.linalg.vector_norm(
        torch.cat([t.double().reshape(-1) for t in tree_leaves(grads)])
    )
    torch.testing.assert_close(norm, exact, rtol=1e-12, atol=0)
    # torch takes each tensor's norm in its own dtype, so it agrees to float32 precision.
    torch_norm = torch.nn.utils.get_total_norm(optree.tree_leaves(grads))
    torch.testing.assert_close(norm, torch_norm, rtol=1e-6, atol=0)
    bf16 = global_norm({"x": torch.full((4,), 3.0, dtype=torch.bfloat16)})
    assert bf16.dtype == torch.float32 and bf16.item() == 6.0
    assert global_norm({}).item() == 0.0


def test_clip_by_global_norm_matches_clip_grad_norm() -> None:
    grads = _grads(_model_params(), steps=1)[0]
    tensors = [t.clone().requires_grad_() for t in optree.tree_leaves(grads)]
    for t, g in zip(tensors, optree.tree_leaves(grads)):
        t.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(tensors, max_norm=1.5)
    clipped, _ = clip_by_global_norm(1.5, eps=1e-6).update(grads, fo.EmptyState())
    for ours, t in zip(optree.tree_leaves(clipped), tensors):
        torch.testing.assert_close(ours, t.grad, rtol=1e-6, atol=0)
    same, _ = clip_by_global_norm(1e3, eps=1e-6).update(grads, fo.EmptyState())
    assert all(
        torch.equal(a, b) for a, b in zip(optree.tree_leaves(same), optree.tree_leaves(grads))
    )


def test_global_norm_and_clip_on_simulated_2d_mesh() -> None:
    full = _mixed_full()
    plain = torch.randn(6)
    ref = _full_norm({**full, "plain": plain})
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        grads = {**ff.shard(full, mesh, SPECS_2D), "plain": plain}
        with ff.count_comms() as comms:
            norm = global_norm(grads)
        norms = [n.item() for n in ff.rank_values(norm)]
        clipped, _ = clip_by_global_norm(ref / 2, eps=1e-6).update(grads, fo.EmptyState())
        gathered = {k: ff.rank_values(v) for k, v in ff.gather(clipped).items()}
    assert norm.dtype == torch.float64
    assert norms == pytest.approx([ref] * 4, rel=1e-12)
    assert comms.count("all_reduce") == 2  # one per mesh axis, for all groups together
    scale = (ref / 2) / (ref + 1e-6)
    for k, per_rank in gathered.items():
        want = (full | {"plain": plain})[k] * scale
        for value in per_rank:
            torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- sharded updates


def _adam_states(state: Any) -> list[fo.ScaleByAdamState]:
    return optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, fo.ScaleByAdamState))


def _reference(steps: int) -> dict[str, Any]:
    """Full tensors, per-step grads and the unsharded optimizer run.

    Build these outside ``simulated_mesh``: inside it, ``torch.randn(generator=g)`` draws a
    different value on each simulated rank.
    """
    full = _mixed_full()
    grads = [_mixed_full(seed=10 + i) for i in range(steps)]
    ref, ref_state = _run(_sharded_opt(), full, grads)
    return {"full": full, "grads": grads, "ref": ref, "mu": _adam_states(ref_state)[0].mu}


def _sharded_opt() -> fo.GradientTransformation:
    # A mask on the path alone: a Sharded leaf's path is "bias", not "bias.local".
    no_bias = lambda path, p: not path.endswith("bias")  # noqa: E731
    return fo.chain(
        clip_by_global_norm(2.0, eps=1e-6), fo.adamw(3e-2, weight_decay=0.5, mask=no_bias)
    )


def _sharded_errors(mesh: Any, specs: dict[str, ff.P], data: dict[str, Any]) -> list[float]:
    """Relative error of a sharded run against the full run, per value and rank, padding
    included (sharding the reference pads with zeros)."""
    grads = [ff.shard(g, mesh, specs) for g in data["grads"]]
    params, state = _run(_sharded_opt(), ff.shard(data["full"], mesh, specs), grads)
    pairs = [
        (params, ff.shard(data["ref"], mesh, specs)),
        (_adam_states(state)[0].mu, ff.shard(data["mu"], mesh, specs)),
    ]
    errors = []
    for ours, want in pairs:
        for k in specs:
            assert ours[k].spec == want[k].spec and ours[k].dtype == want[k].dtype
            for a, b in zip(ff.rank_values(ours[k].local), ff.rank_values(want[k].local)):
                errors.append(((a - b).abs().max() / b.abs().max()).item())
    return errors


def test_sharded_adamw_on_simulated_mesh_equals_full() -> None:
    data = _reference(steps=5)
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        errors = _sharded_errors(mesh, SPECS_2D, data)
    assert len(errors) == 2 * len(SPECS_2D) * 4
    assert max(errors) < 1e-5, errors


# --------------------------------------------------------------------------- real processes


def _mp_norm_and_sharded_adamw(axes: dict[str, int], specs: dict[str, ff.P]) -> dict[str, Any]:
    mesh = ff.make_mesh(axes)
    full = _mixed_full()
    grads = ff.shard(full, mesh, specs)
    norm = global_norm(grads).item()
    clipped, _ = clip_by_global_norm(1.0, eps=1e-6).update(grads, fo.EmptyState())
    clip_norm = global_norm(clipped).item()
    return {
        "norm": norm,
        "ref": _full_norm(full),
        "clip_norm": clip_norm,
        "errors": _sharded_errors(mesh, specs, _reference(steps=3)),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world", "axes", "specs"),
    [(4, {"dp": 2, "tp": 2}, SPECS_2D), (2, {"dp": 2}, SPECS_1D)],
    ids=["dp2xtp2", "dp2"],
)
def test_global_norm_and_sharded_adamw_on_real_processes(
    pools: Any, world: int, axes: dict[str, int], specs: dict[str, ff.P]
) -> None:
    results = pools.run(world, _mp_norm_and_sharded_adamw, axes, specs)
    for r in results:
        assert r["norm"] == pytest.approx(r["ref"], rel=1e-12)
        assert r["clip_norm"] == pytest.approx(1.0, rel=1e-5)
        assert max(r["errors"]) < 1e-5, r["errors"]


# --------------------------------------------------------------------------- errors


def test_state_from_another_tree_names_the_mismatch() -> None:
    params = _model_params()
    opt = fo.adamw(1e-2, weight_decay=0.01)
    state = opt.init(params)
    other = {**params, "extra": torch.zeros(2)}
    with pytest.raises(
        ValueError,
        match=r"(?s)state.mu does not match.*only in the updates: \['extra'\].*opt.init\(params\)",
    ):
        opt.update(tree_map(torch.zeros_like, other), state, other)
    reshaped = {**params, "head": {**params["head"], "bias": torch.zeros(4)}}
    with pytest.raises(
        ValueError, match=r"head.bias: shape \(3,\) in state.mu, shape \(4,\) in the updates"
    ):
        opt.update(tree_map(torch.zeros_like, reshaped), state, reshaped)
    with pytest.raises(ValueError, match=r"chain of 3 transformations got a state with 2 entries"):
        opt.update(params, state[:2], params)


def test_state_for_another_sharding_names_the_specs() -> None:
    full = _mixed_full()
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        opt = fo.sgd(0.1, momentum=0.9)
        state = opt.init(ff.shard(full, mesh, SPECS_2D))
        grads = ff.shard(full, mesh, ff.P())
        with pytest.raises(
            ValueError,
            match=r"b: Sharded \(5, 3\) P\('dp'\) in state.trace, Sharded \(5, 3\) P\(\) in the updates",
        ):
            opt.update(grads, state, grads)


def test_bad_arguments_say_how_to_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"add_decayed_weights needs the params: call opt.update\(grads, state, params\)",
    ):
        fo.adamw(1e-2, weight_decay=0.01).update(
            {"w": torch.ones(1)}, fo.adamw(1e-2, weight_decay=0.01).init({"w": torch.ones(1)})
        )
    with pytest.raises(TypeError, match=r"call factory functions \(adam\(1e-3\), not adam\)"):
        fo.chain(fo.adam)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scale_by_adam: b1 must be in \[0, 1\), got 1.0"):
        fo.adam(1e-3, b1=1.0)
    with pytest.raises(ValueError, match=r"nesterov=True needs a momentum > 0"):
        fo.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"max_norm must be positive"):
        clip_by_global_norm(0.0, eps=1e-6)
    with pytest.raises(ValueError, match=r"weight_decay must be finite and >= 0.0, got -0.1"):
        fo.adamw(1e-3, weight_decay=-0.1)
    with pytest.raises(
        ValueError, match=r"(?s)the mask does not match the params tree.*mask=lambda path, p"
    ):
        fo.masked(fo.scale(2.0), {"nope": True}).init({"w": torch.ones(1)})
    with pytest.raises(
        TypeError, match=r"the mask gives 1 \(int\) for w; a mask is a tree of bools"
    ):
        fo.masked(fo.scale(2.0), {"w": 1}).init({"w": torch.ones(1)})
    with pytest.raises(TypeError, match=r"n is 7 \(int\); optimizers work on trees of tensors"):
        fo.adam(1e-3).init({"w": torch.ones(1), "n": 7})


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: fs.linear_schedule(1.0, 0.0, -5),
            ValueError,
            r"transition_steps must be positive, got -5",
        ),
        (
            lambda: fs.linear_schedule(1.0, 0.0, 0),
            ValueError,
            r"got 0. For a value that never changes use constant_schedule\(1.0\)",
        ),
        (lambda: fs.linear_schedule(1.0, 0.0, 2.5), TypeError, r"transition_steps must be an int"),
        (
            lambda: fs.cosine_decay_schedule(1.0, 0),
            ValueError,
            r"decay_steps must be positive, got 0",
        ),
        (
            lambda: fs.cosine_decay_schedule(float("nan"), 10),
            ValueError,
            r"init_value must be finite, got nan",
        ),
        (
            lambda: fs.constant_schedule("0.1"),
            TypeError,
            r"value must be a real number, got '0.1' \(str\)",
        ),
        (
            lambda: fs.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=100, decay_steps=100),
            ValueError,
            r"decay_steps=100 must be greater than warmup_steps=100. decay_steps counts the warmup too: .* pass decay_steps=100 \+ N",
        ),
        (
            lambda: fs.warmup_cosine_decay_schedule(0.0, 1.0, -1, 10),
            ValueError,
            r"warmup_steps must be non-negative, got -1",
        ),
        (
            lambda: fs.warmup_cosine_decay_schedule(0.0, float("inf"), 1, 10),
            ValueError,
            r"peak_value must be finite",
        ),
        (
            lambda: fs.join_schedules([fs.constant_schedule(1.0)], [3]),
            ValueError,
            r"got 1 schedules and 1 boundaries",
        ),
        (
            lambda: fo.scale_by_schedule(0.1),
            TypeError,
            r"step_size_fn must be a schedule, a function fn\(step: int\) -> float",
        ),
        (
            lambda: fo.adamw("fast", weight_decay=0.01),
            TypeError,
            r"learning_rate must be a float or a schedule fn\(step\) -> float, got 'fast' \(str\)",
        ),
        (
            lambda: fo.sgd(torch.tensor([0.1])),
            TypeError,
            r"For a tensor pass a 0-dim floating one, or float\(lr\)",
        ),
        (
            lambda: fo.sgd(-0.1),
            ValueError,
            r"learning_rate must be finite and >= 0, got -0.1. .*negated for you",
        ),
    ],
)
def test_invalid_schedules_and_rates(build: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        (
            lambda t: float("nan") if t == 1 else 0.1,
            ValueError,
            r"returned nan at step 1; it must be finite and >= 0.0",
        ),
        (lambda t: -0.1, ValueError, r"returned -0.1 at step 0"),
        (
            lambda t: torch.tensor(0.1),
            TypeError,
            r"schedules must return a Python float \(a tensor would force a device sync",
        ),
    ],
)
def test_bad_schedule_values_fail_at_the_step(schedule: Any, error: type, match: str) -> None:
    opt = fo.sgd(schedule)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    with pytest.raises(error, match=match):
        for _ in range(3):
            _, state = opt.update(params, state, params)
