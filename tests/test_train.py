"""TrainState and train_step: every strategy against the single-process trajectory."""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, lm_loss

from . import _train_workers as T
from ._fsdp_workers import CFG


def _simulated_strategy(name: str, steps: int = 4):
    axes, fsdp_kwargs, step_kwargs = T.STRATEGIES[name]
    step_kwargs = dict(step_kwargs)
    opt_specs = step_kwargs.pop("opt_specs", None)
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ff.adamw(T.LR, **T.OPT)
    data = T.batches(steps)  # outside the simulation: there, ranks draw from a generator in turn
    with ff.simulated_mesh(axes) as mesh:
        f = ff.fsdp(model, mesh, **fsdp_kwargs)
        step = ff.train_step(
            lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f, **step_kwargs
        )
        state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
        losses = []
        for b in data:
            state, metrics = step(state, b)
            losses.append(ff.rank_values(metrics["loss"])[0].item())
        params = {k: ff.rank_values(v)[0] for k, v in ff.gather(state.params).items()}
    return losses, params


@pytest.mark.parametrize("name", [n for n in T.STRATEGIES if not n.endswith("_dp4")])
def test_strategy_matches_single_process_simulated(name):
    ref_losses, ref_params = T.reference_trajectory(4)
    losses, params = _simulated_strategy(name)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], atol=2e-5, rtol=1e-4, msg=k)


def test_metrics_loss_grad_norm_and_lr():
    torch.manual_seed(0)
    model = GPT(CFG)
    b = T.batches(1)[0]
    schedule = ff.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    opt = ff.adamw(schedule, weight_decay=0.01)
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads = torch.func.grad(
        lambda p: lm_loss(torch.func.functional_call(model, p, (b[:, :-1],)), b[:, 1:])
    )(params)
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        step = ff.train_step(
            lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]),
            opt,
            model=f,
            learning_rate=schedule,
        )
        state = ff.TrainState.create(f.shard(), opt)
        state, m1 = step(state, b)
        _, m2 = step(state, b)
        norm = ff.rank_values(m1["grad_norm"])[0].item()
    assert abs(norm - ref_norm) < 1e-5 * ref_norm
    assert m1["lr"] == 0.0 and m2["lr"] == pytest.approx(5e-3)


def test_donated_state_raises_and_default_is_pure():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ff.sgd(0.1, momentum=0.9)
    b = T.batches(1)[0]
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        loss_fn = lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:])  # noqa: E731
        state = ff.TrainState.create(f.shard(), opt)
        before = [t.clone() for t in ff.tree_leaves(state.params)]
        pure = ff.train_step(loss_fn, opt, model=f)
        new, _ = pure(state, b)
        assert all(torch.equal(a, c) for a, c in zip(before, ff.tree_leaves(state.params)))
        donating = ff.train_step(loss_fn, opt, model=f, donate=True)
        donated, _ = donating(state, b)
        assert all(
            torch.equal(x, y)
            for x, y in zip(ff.tree_leaves(new.params), ff.tree_leaves(donated.params))
        )
        with pytest.raises(
            ff.DonatedStateError, match=r"donated to a train_step\(donate=True\) call at step 0"
        ):
            state.params  # noqa: B018
        with pytest.raises(ff.DonatedStateError, match="Use the state that call returned"):
            donating(state, b)


def test_bad_input_errors():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ff.sgd(0.1)
    b = T.batches(1, size=6)[0]
    b4, b8 = T.batches(1, size=4)[0], T.batches(1, size=8)[0]
    with ff.simulated_mesh({"dp": 4}) as mesh:
        f = ff.fsdp(model, mesh)
        state = ff.TrainState.create(f.shard(), opt)
        step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
        with pytest.raises(
            ValueError,
            match=r"global batch of 6 examples .* does not divide across the 4 data-parallel ranks of Mesh\(dp=4\)",
        ):
            step(state, b)
        bad = ff.train_step(lambda p, b: f.apply(p, b[:, :-1]).mean(-1), opt, model=f)
        with pytest.raises(
            ValueError, match=r"loss_fn must return a scalar tensor .* got \(1, 12\)"
        ):
            bad(state, b4)
        accum = ff.train_step(
            lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f, accumulate=3
        )
        with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
            accum(state, b8)
        other = ff.TrainState(state.params, ff.sgd(0.1, momentum=0.9).init({"w": torch.zeros(2)}))
        momentum = ff.train_step(
            lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]),
            ff.sgd(0.1, momentum=0.9),
            model=f,
        )
        with pytest.raises(ValueError, match="built by init\\(\\) for another params tree"):
            momentum(other, b4)


def test_integer_leaves_train_with_the_fixes_the_error_suggests():
    """An int64 leaf without trainable= raises a TypeError (see the catalogue); both fixes its
    message suggests train the floating leaves exactly like plain SGD and keep the counter."""
    from ._catalogue_workers import _WithSteps

    torch.manual_seed(0)
    module = _WithSteps()
    x = torch.randn(4, 4)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(module.lin.state_dict())
    ref(x).pow(2).mean().backward()
    opt = ff.sgd(0.1)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(module, mesh)
        params = sm.shard()
        with pytest.raises(TypeError, match=r"params\['steps'\] is int64 \(shape \(3,\)\)"):
            ff.TrainState.create(params, opt)
        step = ff.train_step(lambda p, b: sm.apply(p, b).pow(2).mean(), opt, model=sm)
        for trainable in (sm, lambda path, p: p.dtype.is_floating_point):
            state, _ = step(ff.TrainState.create(params, opt, trainable=trainable), x)
            assert state.params["steps"] is params["steps"]
            got = {k: ff.rank_values(v)[0] for k, v in ff.gather(state.params).items()}
            for name in ("weight", "bias"):
                want = getattr(ref, name).detach() - 0.1 * getattr(ref, name).grad
                torch.testing.assert_close(got[f"lin.{name}"], want)


@pytest.mark.multiprocess
def test_gloo_strategies_match_reference_trajectory(pools):
    names = [n for n in T.STRATEGIES if n != "hsdp" and not n.endswith("_dp4")]
    results = pools.run(2, T.compare_strategies, names)[0]
    for name, (loss_diff, param_diff) in results.items():
        assert loss_diff < 1e-5 and param_diff < 5e-5, (name, loss_diff, param_diff)
    loss_diff, param_diff = pools.run(2, T.zero3_vs_fsdp2_adamw)[0]
    assert loss_diff < 1e-5 and param_diff < 5e-5, (loss_diff, param_diff)
    assert all(pools.run(2, T.determinism))


@pytest.mark.multiprocess
def test_gloo_clipping_reuses_the_steps_gradient_norm(pools):
    """With ``chain(clip_by_global_norm, ...)`` the step's gradient norm (for its metrics) is
    the one the clipping uses: one norm all-reduce per step where the gradients are sharded
    (ZeRO-3, ZeRO-2), none where they are replicated (DDP), and bitwise the same numbers as a
    clipping that computes the norm again."""
    got = pools.run(2, T.clip_norm_once, ["zero3", "zero2", "ddp"])[0]
    for name, r in got.items():
        assert r["bitwise"], name
        shared, own = r["shared"], r["own"]
        count, nbytes = shared[("all_reduce", "dp")]
        sharded = name != "ddp"
        # the same collectives, less the second norm all-reduce (one fp32 scalar: 2 * 4 *
        # (n - 1) / n bytes per rank on n = 2 ranks)
        assert own[("all_reduce", "dp")] == (count + sharded, nbytes + 4 * sharded), name
        assert {k: v for k, v in shared.items() if k != ("all_reduce", "dp")} == {
            k: v for k, v in own.items() if k != ("all_reduce", "dp")
        }
    assert got["zero3"]["shared"][("all_reduce", "dp")][0] == 2  # the loss and the norm


@pytest.mark.multiprocess
def test_gloo_hsdp_trajectory(pools):
    names = ["hsdp", "zero1_dp4", "zero2_dp4"]
    for name, (loss_diff, param_diff) in pools.run(4, T.compare_strategies, names)[0].items():
        assert loss_diff < 1e-5 and param_diff < 5e-5, (name, loss_diff, param_diff)


def _peak_bytes(fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize(
    "make_opt",
    [lambda: ff.adamw(1e-2, weight_decay=0.1), lambda: ff.sgd(0.1, momentum=0.9, nesterov=True)],
    ids=["adamw", "sgd_nesterov"],
)
def test_donation_is_bitwise_pure_and_lowers_peak_memory(make_opt):
    torch.manual_seed(0)
    init = {"w1": torch.randn(256, 512) / 16, "w2": torch.randn(512, 256) / 23}
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    opt = make_opt()

    def loss_fn(p, b):  # plain tensor math: MemTracker's module hooks dislike torch.func wrappers
        return (torch.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]).pow(2).mean()

    def fresh() -> ff.TrainState:
        return ff.TrainState.create({k: v.clone() for k, v in init.items()}, opt)

    results, peaks = {}, {}
    for donate in (False, True):
        step = ff.train_step(loss_fn, opt, batch="local", donate=donate)
        state, _ = step(fresh(), (x, y))  # a first step, so optimizer state is non-trivial
        box = {}
        peaks[donate] = _peak_bytes(lambda s=state: box.update(out=step(s, (x, y))[0]))
        results[donate] = box["out"]
    for a, b in zip(ff.tree_leaves(results[False].params), ff.tree_leaves(results[True].params)):
        assert torch.equal(a, b)
    for a, b in zip(
        ff.tree_leaves(results[False].opt_state), ff.tree_leaves(results[True].opt_state)
    ):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)
    param_bytes = sum(v.numel() * 4 for v in init.values())
    # Pure keeps old and new params and optimizer state alive together; donation does not.
    assert peaks[True] <= peaks[False] - param_bytes, (peaks, param_bytes)
