"""optax's names mean optax's numbers: each optax-named function against optax itself (JAX on
CPU), on one process and on 2 gloo ranks with sharded leaves, with the same gradients."""

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
from functional_fsdp.optim import schedules as fs
from functional_fsdp.optim.clipping import global_norm_and_finite

from . import _optax_workers as W

SCHEDULE = optax.warmup_cosine_decay_schedule(**W.SCHEDULE)


def _decay(p: Any) -> dict[str, bool]:
    return {k: v.ndim > 1 for k, v in p.items()}


def _labels(p: Any) -> dict[str, str]:
    return {k: "adam" if v.ndim > 1 else "sgd" for k, v in p.items()}


OPTAX = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_nesterov": lambda: optax.sgd(0.05, 0.9, True),
    "adam": lambda: optax.adam(1e-2),
    "adam_eps_root_nesterov": lambda: optax.adam(1e-2, 0.8, 0.95, 1e-6, 1e-8, nesterov=True),
    "adam_mu_bf16": lambda: optax.adam(1e-2, mu_dtype=jnp.bfloat16),
    "adamw_defaults": lambda: optax.adamw(1e-2),
    "adamw_mask_fn": lambda: optax.adamw(1e-2, weight_decay=0.3, mask=_decay),
    "adamw_schedule": lambda: optax.adamw(SCHEDULE),
    "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
    "clip_elementwise": lambda: optax.chain(optax.clip(0.2), optax.sgd(0.1)),
    "zero_nans": lambda: optax.chain(optax.zero_nans(), optax.sgd(0.1)),
    "ema": lambda: optax.chain(optax.ema(0.9), optax.sgd(0.1)),
    "lion": lambda: optax.lion(1e-2),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=0.01),
    "lamb_mask_fn": lambda: optax.lamb(1e-2, weight_decay=0.5, mask=_decay),
    "lion_mask_fn": lambda: optax.lion(1e-2, weight_decay=0.5, mask=_decay),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, 0.9)}, _labels
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=SCHEDULE, weight_decay=0.01
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.1), 2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "adafactor_momentum_decay": lambda: optax.adafactor(
        1e-2, 3, momentum=0.9, weight_decay_rate=0.1, weight_decay_mask=_decay
    ),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), 3),
    "multi_steps_sum_schedule": lambda: optax.MultiSteps(
        optax.sgd(0.1, 0.9), lambda step: jnp.where(step < 2, 2, 3), use_grad_mean=False
    ),
    "multi_steps_apply_if_finite": lambda: optax.MultiSteps(
        optax.apply_if_finite(optax.sgd(0.1), 3), 2
    ),
    "chain_clip_apply_if_finite": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.apply_if_finite(optax.adam(1e-2), 2)
    ),
    "masked_apply_if_finite": lambda: optax.chain(
        optax.masked(optax.apply_if_finite(optax.sgd(0.1), 2), _decay), optax.zero_nans()
    ),
    "multi_transform_apply_if_finite": lambda: optax.multi_transform(
        {
            "adam": optax.apply_if_finite(optax.adam(1e-2), 2),
            "sgd": optax.chain(optax.zero_nans(), optax.sgd(0.1)),
        },
        _labels,
    ),
    "apply_if_finite_inject_hyperparams": lambda: optax.apply_if_finite(
        optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.01), 2
    ),
    "inject_hyperparams_apply_if_finite": lambda: optax.inject_hyperparams(
        lambda learning_rate: optax.apply_if_finite(optax.sgd(learning_rate), 2)
    )(learning_rate=SCHEDULE),
}
assert set(OPTAX) == set(W.CASES)


def _jax(tree: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v.numpy()) for k, v in tree.items()}


EAGER = {"adam_mu_bf16"}  # jit would fuse away the bfloat16 rounding optax's eager ops do


@functools.cache
def _optax_run(name: str) -> dict[str, torch.Tensor]:
    """optax's result for a case (computed once per session: both tests compare with it)."""
    opt = OPTAX[name]()
    update = opt.update if name in EAGER else jax.jit(opt.update)
    p = _jax(W.params())
    state = opt.init(p)
    for g in W.case_grads(name):
        updates, state = update(_jax(g), state, p)
        p = optax.apply_updates(p, updates)
    return {k: torch.from_numpy(np.asarray(v).copy()) for k, v in p.items()}


def _assert_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], name: str) -> None:
    start = W.params()
    for k in ref:
        assert ours[k].dtype == ref[k].dtype, (name, k)
        torch.testing.assert_close(ours[k], ref[k], rtol=2e-5, atol=2e-6, msg=f"{name}: {k}")
        assert not torch.equal(ref[k], start[k]), (name, k)  # the reference moved


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "train_step_kwargs"])
@pytest.mark.parametrize("name", list(W.CASES))
def test_matches_optax_on_one_process(name: str, extras: bool) -> None:
    """Each case as optax runs it, and with the keyword arguments train_step passes
    (``grad_norm=``, ``finite=`` of the step's gradients): the numbers are optax's either way,
    whatever wrapper stands between the step and an ``apply_if_finite``."""
    ours = W.run(name, W.params(), W.case_grads(name), extras=extras)
    _assert_close(ours, _optax_run(name), name)


@pytest.mark.multiprocess
def test_matches_optax_on_two_ranks_with_sharded_leaves(pools: Any) -> None:
    """Every case on 2 gloo ranks, leaves split unevenly by rows and by columns: the global
    norm (clipping) spans both ranks' blocks; masks and labels see the global shapes. Each
    with and without train_step's keyword arguments."""
    names = list(W.CASES)
    results = pools.run(2, W.on_two_ranks, names)
    for name in names:
        ref = _optax_run(name)
        for r in results:
            for extras in (False, True):
                _assert_close(r[name, extras], ref, f"{name} extras={extras}")
    for r in results:
        # 1e20 overflows the float32 norm but is finite: optax applies such a step.
        assert r["huge_finite"] == [math.inf, True]
        # A NaN on rank 1's block only: both ranks say not finite.
        assert r["nan_on_rank_1"][1] is False
        assert r["empty_block"] == [math.inf, True]


def test_optax_signatures_positional_order_and_defaults() -> None:
    """A ported positional call means what it means in optax."""
    p = W.params()
    g = W.grads(3)
    # adam's 5th positional argument is eps_root (not a weight decay).
    _assert_close(
        W.run_opt(ff.adam(1e-2, 0.9, 0.99, 1e-8, 1e-3), p, g),
        _optax_apply(optax.adam(1e-2, 0.9, 0.99, 1e-8, 1e-3), p, g),
        "adam positional",
    )
    # sgd's 4th is accumulator_dtype.
    _assert_close(
        W.run_opt(ff.sgd(0.1, 0.9, False, torch.bfloat16), p, g),
        _optax_apply(optax.sgd(0.1, 0.9, False, jnp.bfloat16), p, g),
        "sgd accumulator_dtype",
    )
    # adamw's default weight decay is optax's 1e-4 (torch's 0.01 is explicit).
    _assert_close(
        W.run_opt(ff.adamw(0.1), p, g), _optax_apply(optax.adamw(0.1), p, g), "adamw default"
    )
    assert not torch.allclose(
        W.run_opt(ff.adamw(0.1), p, g)["w"], W.run_opt(ff.adamw(0.1, weight_decay=0.01), p, g)["w"]
    )


def _optax_apply(opt: Any, p: dict[str, torch.Tensor], steps: list[Any]) -> dict[str, torch.Tensor]:
    jp = _jax(p)
    state = opt.init(jp)
    for g in steps:
        updates, state = opt.update(_jax(g), state, jp)
        jp = optax.apply_updates(jp, updates)
    return {k: torch.from_numpy(np.asarray(v).copy()) for k, v in jp.items()}


def test_clip_by_global_norm_is_optax_rule_and_torch_rule_is_explicit() -> None:
    under = {"w": torch.tensor([0.6, 0.7999997])}  # norm just under 1: optax leaves it alone
    over = {"w": torch.tensor([3.0, 4.0])}
    for g in (under, over):
        ours = ff.clip_by_global_norm(1.0).update(g, ff.EmptyState())[0]["w"]
        ref = optax.clip_by_global_norm(1.0).update(_jax(g), optax.EmptyState())[0]["w"]
        torch.testing.assert_close(
            ours, torch.from_numpy(np.asarray(ref).copy()), rtol=1e-7, atol=0
        )
    assert torch.equal(
        ff.clip_by_global_norm(1.0).update(under, ff.EmptyState())[0]["w"], under["w"]
    )
    torch_rule = ff.clip_by_global_norm(1.0, eps=1e-6).update(under, ff.EmptyState())[0]["w"]
    t = under["w"].clone().requires_grad_()
    t.grad = under["w"].clone()
    torch.nn.utils.clip_grad_norm_([t], 1.0)
    assert torch.equal(torch_rule, t.grad) and not torch.equal(torch_rule, under["w"])


def test_apply_if_finite_decides_per_element() -> None:
    """A finite 1e20 gradient is applied (its float32 norm is inf); a NaN step is skipped."""
    p = {"w": torch.ones(3)}
    opt = ff.apply_if_finite(ff.sgd(1e-20), 2)
    state = opt.init(p)
    updates, state = opt.update({"w": torch.tensor([1e20, 1.0, 1.0])}, state, p)
    assert not bool(state.last_skipped) and int(state.total_notfinite) == 0
    torch.testing.assert_close(ff.apply_updates(p, updates)["w"], torch.tensor([0.0, 1.0, 1.0]))
    ref = optax.apply_if_finite(optax.sgd(1e-20), 2)
    _, rs = ref.update({"w": jnp.asarray([1e20, 1.0, 1.0])}, ref.init(_jax(p)), _jax(p))
    assert bool(rs.last_finite) and bool(state.last_finite)
    _, state = opt.update({"w": torch.tensor([float("nan"), 1.0, 1.0])}, state, p)
    assert bool(state.last_skipped)
    norm, finite = global_norm_and_finite({"w": torch.tensor([1e20]), "b": torch.ones(2)})
    assert math.isinf(norm.item()) and bool(finite)


def test_train_step_applies_a_huge_finite_gradient() -> None:
    """train_step's ``finite`` metric and apply_if_finite's decision are per element too."""
    opt = ff.apply_if_finite(ff.sgd(1e-20), 2)
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local")
    state = ff.TrainState.create({"w": torch.ones(2)}, opt)
    state, metrics = step(state, torch.tensor([1e20, 1.0]))
    assert bool(metrics["finite"]) and not bool(metrics["skipped"])
    assert state.params["w"].tolist() == [0.0, 1.0]


def test_apply_updates_rounds_once_like_optax() -> None:
    g = torch.Generator().manual_seed(3)
    p = (256 * torch.rand(20_000, generator=g) + 1).to(torch.bfloat16)
    u = 4 * torch.randn(20_000, generator=g)
    ours = ff.apply_updates({"p": p}, {"p": u})["p"]
    ref = optax.apply_updates(
        {"p": jnp.asarray(p.float().numpy()).astype(jnp.bfloat16)}, {"p": jnp.asarray(u.numpy())}
    )["p"]
    assert torch.equal(ours.float(), torch.from_numpy(np.asarray(ref.astype(jnp.float32)).copy()))
    assert (
        ff.apply_updates(
            {"p": torch.tensor([256.0], dtype=torch.bfloat16)}, {"p": torch.tensor([1.0039])}
        )["p"].item()
        == 258.0
    )


SCHEDULES = {
    "exponential_decay": (
        lambda m: m.exponential_decay(0.5, 3, 0.7, transition_begin=2, end_value=0.05),
    ),
    "exponential_staircase": (
        lambda m: m.exponential_decay(0.5, 4, 1.3, staircase=True, end_value=1.0),
    ),
    "piecewise_constant": (lambda m: m.piecewise_constant_schedule(0.3, {5: 0.5, 9: 0.1}),),
    "polynomial": (lambda m: m.polynomial_schedule(1.0, 0.1, 2.5, 12, transition_begin=3),),
    "cosine_exponent": (lambda m: m.cosine_decay_schedule(2.0, 15, alpha=0.1, exponent=2.0),),
    "warmup_cosine": (lambda m: m.warmup_cosine_decay_schedule(0.0, 1.0, 4, 20, 0.05, 1.5),),
    "join": (
        lambda m: m.join_schedules(
            [m.linear_schedule(0.0, 1.0, 5), m.cosine_decay_schedule(1.0, 10)], [5]
        ),
    ),
    "cosine_onecycle": (lambda m: m.cosine_onecycle_schedule(20, 0.4),),
    "linear_onecycle": (lambda m: m.linear_onecycle_schedule(20, 0.4),),
    "sgdr": (
        lambda m: m.sgdr_schedule(
            [
                dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=8),
                dict(init_value=0.1, peak_value=0.5, warmup_steps=1, decay_steps=6, end_value=0.01),
            ]
        ),
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_match_optax(name: str) -> None:
    (build,) = SCHEDULES[name]
    ours, ref = build(fs), build(optax)
    counts = list(range(30))
    want = [float(x) for x in jax.vmap(ref)(jnp.asarray(counts))]  # eager: as optax gives it
    got = [ours(c) for c in counts]
    assert all(isinstance(x, float) for x in got)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    # The same values from a count held as a tensor (apply_if_finite's states), no host read.
    on_device = [ours(torch.tensor(c)).item() for c in counts]
    np.testing.assert_allclose(on_device, got, rtol=1e-12, atol=1e-15)


def test_bad_arguments_say_how_to_fix() -> None:
    from functional_fsdp.optim import wrappers

    p = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"mu_dtype must be a floating torch.dtype .* got 'bf16'"):
        ff.adam(1e-3, mu_dtype="bf16")
    with pytest.raises(ValueError, match=r"labels \['x'\] have no transformation.*Add them"):
        ff.multi_transform({"a": ff.sgd(0.1)}, {"w": "x"}).init(p)
    with pytest.raises(TypeError, match=r"should_skip_update_fn is not supported.*apply_if_finite"):
        wrappers.MultiSteps(ff.sgd(0.1), 2, should_skip_update_fn=lambda *a: None)
    with pytest.raises(ValueError, match=r"every_k_schedule must be an int >= 1"):
        ff.MultiSteps(ff.sgd(0.1), 0)
    guarded = ff.apply_if_finite(ff.MultiSteps(ff.sgd(0.1), 2).gradient_transformation(), 1)
    with pytest.raises(
        TypeError, match=r"apply_if_finite around MultiSteps \(put it inside.*ff.jit, which traces"
    ):
        guarded.update(p, guarded.init(p), p)
    with pytest.raises(ValueError, match=r"scale_by_trust_ratio needs the params"):
        ff.scale_by_trust_ratio().update(p, ff.EmptyState())
    with pytest.raises(ValueError, match=r"scale_by_factored_rms needs the params"):
        t = ff.scale_by_factored_rms()
        t.update(p, t.init(p))


def _optax_on_gpt_gradients() -> dict[str, torch.Tensor]:
    """optax's ``MultiSteps(apply_if_finite(sgd), 2)`` on one process's full-batch GPT
    gradients over the batches of :func:`T.nan_batches` (a NaN on a first micro-step)."""
    from functional_fsdp.models import GPT

    from . import _train_workers as T

    torch.manual_seed(0)
    model = GPT(T.CFG)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = optax.MultiSteps(optax.apply_if_finite(optax.sgd(0.5), 3), 2)
    jp = _jax(params)
    state = opt.init(jp)
    for b in T.nan_batches():
        grads = torch.func.grad(
            lambda p: T.weighted_lm_loss(torch.func.functional_call(model, p, (b[0][:, :-1],)), b)
        )(params)
        updates, state = opt.update(_jax(grads), state, jp)
        jp = optax.apply_updates(jp, updates)
        params = {k: torch.from_numpy(np.asarray(v).copy()) for k, v in jp.items()}
    return params


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [2, 4])
def test_train_step_skips_a_nan_micro_step_of_multi_steps_as_optax(pools: Any, ranks: int) -> None:
    """``MultiSteps(apply_if_finite(sgd), 2)`` under train_step, a NaN gradient on the first
    micro-step of a round: the round's update is skipped, as optax skips it, on every
    strategy and in both accumulation modes (2 ranks), and HSDP 2×2 (4 ranks)."""
    from . import _train_workers as T

    names = T.NAN_STRATEGIES if ranks == 2 else ["hsdp"]
    got = pools.run(ranks, T.nan_micro_step, names)[0]
    ref = _optax_on_gpt_gradients()
    start = T.reference_trajectory(0)[1]
    for name, r in got.items():
        # The step's own flag says step 2 was not finite; the round it ends (step 3) skips.
        assert r["flags"] == [(True, False), (True, False), (False, False), (True, True)], name
        for k in ref:
            torch.testing.assert_close(r["params"][k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
        assert any(not torch.equal(ref[k], start[k]) for k in ref)  # round 1 was applied


def test_master_weights_pass_finite_on_only_through_an_exact_cast() -> None:
    """fp32 gradients cast to fp16 masters: a finite 1e5 becomes inf, so the step's
    ``finite=True`` no longer describes what the inner ``apply_if_finite`` receives; it
    decides from the cast gradients, as optax does on them. Through an exact cast (bf16
    gradients, fp32 masters) the flag is passed on and trusted (it also covers the loss)."""
    g = {"w": torch.tensor([1e5, 1.0, 1.0])}
    narrowing = ff.master_weights(
        ff.apply_if_finite(ff.sgd(0.1), 2), param_dtype=torch.float32, master_dtype=torch.float16
    )
    p = {"w": torch.ones(3)}
    updates, state = narrowing.update(g, narrowing.init(p), p, finite=torch.tensor(True))
    ref = optax.apply_if_finite(optax.sgd(0.1), 2)
    half = {"w": jnp.asarray(g["w"].numpy()).astype(jnp.float16)}
    _, ref_state = ref.update(half, ref.init(half), half)
    assert bool(state.inner.last_finite) == bool(ref_state.last_finite) is False
    assert updates["w"].tolist() == [0.0, 0.0, 0.0]
    exact = ff.master_weights(ff.apply_if_finite(ff.sgd(0.1), 2))
    p16 = {"w": torch.ones(3, dtype=torch.bfloat16)}
    g16 = {"w": g["w"].to(torch.bfloat16)}
    _, state = exact.update(g16, exact.init(p16), p16, finite=torch.tensor(False))
    assert bool(state.inner.last_skipped)
    _, state = exact.update(g16, exact.init(p16), p16, finite=torch.tensor(True))
    assert not bool(state.inner.last_skipped)


def test_tensor_counts_name_their_cause_and_fix() -> None:
    """A scheduled hyperparameter an optimizer takes only as a number, under apply_if_finite's
    tensor counts; MultiSteps whose counters are tensors; a changing Python number in an
    inner state: each error says what made the tensors and what to do."""
    p = {"w": torch.ones(2)}
    g = {"w": torch.ones(2)}
    b1 = fs.linear_schedule(0.8, 0.9, 10)
    opt = ff.apply_if_finite(ff.inject_hyperparams(ff.adamw)(learning_rate=0.1, b1=b1), 2)
    with pytest.raises(
        TypeError,
        match=r"schedules of \['b1'\] are evaluated on the device.*"
        r"static_args=\('b1',\)",
    ):
        opt.update(g, opt.init(p), p)
    jitted = ff.inject_hyperparams(ff.adamw)(learning_rate=0.1, weight_decay=0.01)
    state = jitted.init(p)
    traced = state._replace(  # what ff.jit makes of the state's numbers
        count=torch.tensor(0),
        hyperparams={k: torch.tensor(v) for k, v in state.hyperparams.items()},
    )
    with pytest.raises(TypeError, match=r"numbers \['weight_decay'\] are tensors \(ff.jit"):
        jitted.update(g, traced, p)

    def drifting_update(updates, state, params=None):
        return updates, state + 0.5

    drift = ff.apply_if_finite(ff.GradientTransformation(lambda params: 0.5, drifting_update), 1)
    with pytest.raises(TypeError, match=r"as a 0-dim tensor"):
        drift.update(g, drift.init(p), p)


@pytest.mark.parametrize("guard", [False, True], ids=["inject", "apply_if_finite_inject"])
def test_a_scheduled_rate_is_reported_and_traced(guard: bool) -> None:
    """``inject_hyperparams`` with a scheduled rate: ``metrics["lr"]`` is the rate each step
    applied (optax's ``hyperparams["learning_rate"]``), and ``ff.jit`` runs it (the count a
    tensor, the rate computed in the graph) bitwise as the eager step, under apply_if_finite
    too."""
    sched = fs.warmup_cosine_decay_schedule(**W.SCHEDULE)

    def make() -> ff.GradientTransformation:
        opt = ff.inject_hyperparams(ff.adamw, static_args="weight_decay")(
            learning_rate=sched, weight_decay=0.01
        )
        return ff.apply_if_finite(opt, 2) if guard else opt

    runs = []
    for jit in (False, True):
        opt = make()
        step = ff.train_step(lambda p, b: ((b @ p["w"]) ** 2).mean(), opt, batch="local")
        step = ff.jit(step, backend="eager") if jit else step
        state = ff.TrainState.create({"w": W.params()["w"]}, opt)
        rates = []
        for i in range(5):
            state, metrics = step(
                state, torch.randn(4, 7, generator=torch.Generator().manual_seed(i))
            )
            rates.append(float(metrics["lr"]))
        runs.append((rates, state.params["w"]))
    (eager_rates, eager_w), (jit_rates, jit_w) = runs
    np.testing.assert_allclose(eager_rates, [sched(i) for i in range(5)], rtol=1e-12)
    np.testing.assert_allclose(jit_rates, eager_rates, rtol=1e-12)
    assert torch.equal(jit_w, eager_w)


def test_a_scheduled_hyperparameter_state_resumes_from_a_checkpoint(tmp_path: Any) -> None:
    """The state of ``apply_if_finite(inject_hyperparams(...))`` has one layout before and
    after a step (a scheduled value is a tensor in both), so a checkpoint loads into a fresh
    template and the next step is bitwise the uninterrupted one's."""
    sched = fs.warmup_cosine_decay_schedule(**W.SCHEDULE)

    def make() -> ff.GradientTransformation:
        return ff.apply_if_finite(
            ff.inject_hyperparams(ff.adamw)(learning_rate=sched, weight_decay=0.01), 2
        )

    step = ff.train_step(lambda p, b: ((b @ p["w"]) ** 2).mean(), make(), batch="local")
    state = ff.TrainState.create({"w": W.params()["w"]}, make())
    batches = [torch.randn(4, 7, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for b in batches[:3]:
        state, _ = step(state, b)
    ff.checkpoint.save(tmp_path / "ckpt", state)
    template = ff.TrainState.create({"w": torch.zeros_like(W.params()["w"])}, make())
    resumed = ff.checkpoint.load(tmp_path / "ckpt", template)
    (a, ma), (b, mb) = step(state, batches[3]), step(resumed, batches[3])
    assert torch.equal(a.params["w"], b.params["w"]) and float(ma["lr"]) == float(mb["lr"])
