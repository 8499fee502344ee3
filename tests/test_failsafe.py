"""Failure as a tested path: non-finite steps are skipped, exceptions leave states intact,
collectives that wait in vain raise named errors in seconds, and a debug mode finds
collectives and values that differ between ranks."""

from __future__ import annotations

import math
import re

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.optim.finite import _tensor_counts

from . import _failsafe_workers as W

# --------------------------------------------------------------------------- item 1: skip


def test_apply_if_finite_skips_exactly_like_the_step_never_happened():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 2), "b": torch.tensor([0.0, -0.0])}  # -0.0 must survive
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    bad = {"w": grads[0]["w"].clone(), "b": torch.tensor([float("inf"), 1.0])}
    bad["w"][1, 1] = float("nan")
    opt = ff.adamw(ff.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 5), weight_decay=0.1)
    guarded = ff.apply_if_finite(opt, max_consecutive_errors=2)

    def run(transform, sequence):
        p, state = params, transform.init(params)
        for g in sequence:
            u, state = transform.update(g, state, p)
            p = ff.apply_updates(p, u)
        return p, state

    ref, ref_state = run(opt, grads)
    got, state = run(guarded, [grads[0], bad, bad, grads[1], bad, grads[2]])
    assert all(torch.equal(got[k], ref[k]) for k in ref)  # bitwise, counts and moments too
    assert int(state.total_notfinite) == 3 and int(state.notfinite_count) == 0
    assert int(state.inner_state[0].count) == ref_state[0].count == 3
    assert torch.equal(state.inner_state[0].mu["w"], ref_state[0].mu["w"])
    # A skip is bitwise: -0.0 + -0.0 stays -0.0.
    kept, _ = run(guarded, [bad])
    assert all(torch.equal(kept[k].view(torch.int32), params[k].view(torch.int32)) for k in params)
    # More than max_consecutive_errors in a row: applied anyway (optax), so NaNs show.
    _, s = run(guarded, [bad, bad])
    u, s = guarded.update(bad, s, params)
    assert not bool(s.last_finite) and int(s.notfinite_count) == 3
    assert torch.isnan(u["w"]).any()


def test_apply_if_finite_errors():
    with pytest.raises(ValueError, match=r"max_consecutive_errors must be an int >= 0, got -1"):
        ff.apply_if_finite(ff.sgd(0.1), -1)
    with pytest.raises(TypeError, match=r"inner must be a GradientTransformation.*adamw\(1e-3\)"):
        ff.apply_if_finite(ff.adamw, 1)
    guarded = ff.apply_if_finite(ff.adam(0.1), 1)
    params = {"w": torch.ones(2)}
    state = guarded.init(params)
    int_counts = state._replace(inner_state=ff.adam(0.1).init(params))
    with pytest.raises(TypeError, match=r"at inner_state\.0\.count, which changed to 1.*counts"):
        guarded.update({"w": torch.ones(2)}, int_counts, params)


def test_counts_and_schedules_as_tensors_match_python_ints_bitwise():
    schedules = [
        ff.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=12),
        ff.linear_schedule(0.1, 0.01, transition_steps=7, transition_begin=2),
        ff.join_schedules([ff.constant_schedule(1.0), ff.cosine_decay_schedule(1.0, 4)], [3]),
    ]
    for s in schedules:
        for count in range(15):
            value = s(torch.tensor(count))
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float64
            assert value.item() == s(count), (s, count)
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3)}
    opt = ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(schedules[0], weight_decay=0.1))
    ints, tensors = opt.init(params), _tensor_counts(opt.init(params), torch.device("cpu"))
    p_int = p_tensor = params
    for _ in range(8):
        g = {"w": torch.randn(4, 3)}
        u, ints = opt.update(g, ints, p_int)
        p_int = ff.apply_updates(p_int, u)
        u, tensors = opt.update(g, tensors, p_tensor)
        p_tensor = ff.apply_updates(p_tensor, u)
    assert torch.equal(p_int["w"], p_tensor["w"]) and int(tensors[1][0].count) == 8
    assert ff.learning_rate_of(tensors).item() == ff.learning_rate_of(ints) == schedules[0](7)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_apply_if_finite_state_round_trips_through_a_checkpoint(tmp_path):
    opt = ff.apply_if_finite(ff.adamw(ff.linear_schedule(1e-2, 0.0, 5), weight_decay=0.01), 2)
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local")
    state, _ = step(ff.TrainState.create({"w": torch.randn(3, 2)}, opt), torch.randn(3, 2))
    state, m = step(state, torch.full((3, 2), float("nan")))
    assert bool(m["skipped"]) and int(m["nonfinite_steps"]) == 1
    ff.checkpoint.save(tmp_path / "ckpt", state)
    loaded = ff.checkpoint.load(
        tmp_path / "ckpt", ff.TrainState.create({"w": torch.zeros(3, 2)}, opt)
    )
    assert loaded.step == 2 and int(loaded.opt_state.total_notfinite) == 1
    for a, b in zip(ff.tree_leaves(loaded), ff.tree_leaves(state), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert int(loaded.opt_state.inner_state[0].count) == 1  # the skipped step did not count


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "donate"), [("mlp", False), ("llama", True)])
def test_skip_nonfinite_steps_on_gloo(pools, kind, donate):
    """NaN in rank 1's share of the batch, then an infinite gradient on rank 1's rows: both
    ranks skip both steps, the state stays bitwise as it was, and the run equals plain adamw
    on the good batches only (a transformers Llama built from a config, donated)."""
    r0, r1 = pools.run(2, W.skip_nonfinite, kind, donate)
    assert str(r0["metrics"]) == str(r1["metrics"])  # the same on both ranks, NaNs included
    _check_skips(r0)


@pytest.mark.parametrize("donate", [False, True])
def test_skip_nonfinite_steps_on_a_simulated_mesh(donate):
    _check_skips(W.skip_nonfinite("mlp", donate=donate, simulated=True))


def _check_skips(r: dict) -> None:
    finite = [m["finite"] for m in r["metrics"]]
    assert finite == [True, False, True, False, True]
    assert [m["skipped"] for m in r["metrics"]] == [False, True, False, True, False]
    assert [m["nonfinite_steps"] for m in r["metrics"]] == [0, 1, 1, 2, 2]
    assert math.isnan(r["metrics"][1]["loss"])  # rank 1's NaN reached every rank's loss
    assert math.isfinite(r["metrics"][3]["loss"]) and math.isnan(r["metrics"][3]["grad_norm"])
    assert r["params_kept"] == [False, True, False, True, False]
    assert r["inner_kept"] == [False, True, False, True, False]
    assert r["params_equal_reference"] and r["moments_equal_reference"] and r["count"] == 3
    # metrics["lr"] is the rate the optimizer state records for its last update: a skipped
    # step keeps the record of the update before it, and does not advance the schedule.
    lr = [m["lr"] for m in r["metrics"]]
    assert lr[0::2] == r["ref_lr"] and lr[1] == lr[0] and lr[3] == lr[2]
    assert (
        r["types"] == [["Tensor"]] * 5 and r["loss_formatted"] == f"{r['metrics'][0]['loss']:.3f}"
    )


# --------------------------------------------------------------------------- item 2: exceptions

EXPECTED = {
    "loss_fn": ("Boom", True),
    "bad_input": ("RuntimeError", True),
    # The schedule runs inside the optimizer's update (the rate lives in its state), after
    # earlier transformations of a donated update wrote in place: like any update error.
    "schedule": ("Boom", False),
    "after_update": ("Boom", False),  # raised after the in-place update started: dead
}


@pytest.mark.multiprocess
def test_exceptions_leave_the_state_intact_on_gloo(pools):
    _check_exceptions(pools.run(2, W.exceptions_keep_state)[0])


def _check_exceptions(r: dict) -> None:
    for name, (raised, alive_if_donated) in EXPECTED.items():
        for donate in (False, True):
            got = r[f"{name}/donate={donate}"]
            alive = alive_if_donated or not donate
            assert got["raised"] == raised and got["alive"] == alive, (name, donate, got)
            assert got["intact"] == alive and got["usable"] in (None, True), (name, got)


def test_exception_after_a_donated_update_started_kills_the_state():
    torch.manual_seed(0)
    opt = ff.chain(ff.sgd(0.1, momentum=0.9), W._raising_transform())
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local", donate=True)
    state = ff.TrainState.create({"w": torch.ones(3)}, opt)
    with pytest.raises(W.Boom):
        step(state, torch.ones(3))
    with pytest.raises(ff.DonatedStateError, match=r"or part of it, if that call raised"):
        _ = state.params
    fresh = ff.TrainState.create({"w": torch.ones(3)}, opt)
    with pytest.raises(W.Boom):
        ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local")(fresh, torch.ones(3))
    assert torch.equal(fresh.params["w"], torch.ones(3)) and fresh.step == 0


# --------------------------------------------------------------------------- item 3: metrics


def test_simulated_metrics_are_plain_and_lr_comes_from_the_optimizer():
    model = W.mlp()
    batch = W.make_batch("mlp", 0)
    schedule = ff.linear_schedule(1.0, 0.0, transition_steps=4)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        opt = ff.sgd(schedule)
        step = ff.train_step(lambda p, b: W.mlp_loss(f, p, b), opt, model=f)
        state = ff.TrainState.create(f.shard(), opt)
        state = ff.TrainState(state.params, state.opt_state, torch.tensor(0))  # a tensor step
        state, m1 = step(state, batch)
        state, m2 = step(state, batch)
        text = f"{m2['loss']:.3f} {m2['grad_norm']:.3f}"
        given = ff.train_step(lambda p, b: W.mlp_loss(f, p, b), opt, model=f, learning_rate=0.5)
        _, m3 = given(state, batch)
    assert type(m2["loss"]) is torch.Tensor and type(m2["grad_norm"]) is torch.Tensor
    assert text == f"{float(m2['loss']):.3f} {float(m2['grad_norm']):.3f}"
    assert (m1["lr"], m2["lr"], m3["lr"]) == (1.0, 0.75, 0.5) and bool(m2["finite"])
    assert isinstance(state.step, torch.Tensor) and int(state.step) == 2


# --------------------------------------------------------------------------- item 4: no hangs


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_rank_failing_inside_a_step_ends_the_others_with_a_named_error():
    """Rank 1 raises inside a step, then exits (a script) or stays alive issuing no
    collective (a notebook). Rank 0 raises CollectiveError naming the collective, the axis,
    the shape and the timeout, within seconds, and its state is intact."""
    exited, alive = W.run_fresh(
        [(W.fail_inside_step, ("exit", 3.0)), (W.fail_inside_step, ("alive", 3.0))],
        world=2,
        timeout_s=3.0,
    )
    for run in (exited, alive):
        assert set(run) == {0, 1}, run  # nobody hung past the limit
        how, r = run[0]
        assert how == "returned" and r["error"], run
        assert r["intact"], "an exception in a collective left the input state changed"
        for part in (
            "all_gather over mesh axis 'dp' (size 2)",
            "Mesh(dp=2)",
            "failed on rank 0",
            "float32 of shape",
            "raised an exception",
            "skipped a collective",
            "process died",
            "ff.init_distributed(timeout=",
            "FUNCTIONAL_FSDP_TIMEOUT",
            "FUNCTIONAL_FSDP_CHECK=1",
        ):
            assert part in r["error"], (part, r["error"])
    assert exited[1][0] == "raised" and exited[1][1]["type"] == "Boom"
    # README.md quotes these (pytest -s): how long rank 0 took to fail after rank 1 raised.
    print(
        f"rank 1 raised and exited: rank 0 failed {exited[0][1]['at'] - exited[1][1]['at']:.2f} s "
        f"later; rank 1 stayed alive: {alive[0][1]['at'] - alive[1][1]['at']:.2f} s later "
        f"(timeout=3)"
    )
    assert exited[0][1]["at"] - exited[1][1]["at"] < 3.0  # the peer went away: no timeout
    assert alive[0][1]["error"].count("Timed out") == 1 and "(now 3 s)" in alive[0][1]["error"]
    assert 2.9 < alive[0][1]["at"] - alive[1][1]["at"] < 20.0
    assert alive[0][1]["timeouts"] == {"dp": 3.0, "one": 3.0}  # the mesh axes' groups too


def test_init_distributed_timeout_errors(monkeypatch):
    from functional_fsdp.distributed.mesh import _timeout

    with pytest.raises(ValueError, match=r"timeout must be positive, got -1 s"):
        ff.init_distributed(timeout=-1)
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta or a number"):
        ff.init_distributed(timeout="10m")
    monkeypatch.setenv("FUNCTIONAL_FSDP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"FUNCTIONAL_FSDP_TIMEOUT='soon' is not a number"):
        _timeout(None)
    monkeypatch.setenv("FUNCTIONAL_FSDP_TIMEOUT", "90")
    assert _timeout(None).total_seconds() == 90


# --------------------------------------------------------------------------- item 5: debug mode


@pytest.mark.multiprocess
def test_debug_mode_names_ranks_and_values_that_differ(pools):
    r0, r1 = pools.run(2, W.mismatched_collectives)
    assert (r0["unchecked"], r1["unchecked"]) == ((8, 6), (12, 4))  # silently reinterpreted
    for r in (r0, r1):
        assert r["healthy"] and r["healthy_after_all_gather"]
        assert "collective mismatch over mesh axis 'dp' of the mesh Mesh(dp=2)" in r["all_gather"]
        assert re.search(r"rank 0: all_gather #\d+ over 'dp' of float32 \(4, 6\)", r["all_gather"])
        assert re.search(r"rank 1: all_gather #\d+ over 'dp' of float32 \(6, 4\)", r["all_gather"])
        assert "local_shape=(4, 6)" in r["gather"] and "local_shape=(6, 4)" in r["gather"]
        assert "rank 0: all_gather" in r["skipped"] and "rank 1: all_reduce" in r["skipped"]
    s0, s1 = pools.run(2, W.shard_checks)
    for s in (s0, s1):
        assert s["same"] == "no error" and s["unchecked"] == "no error" and s["healthy"]
        # shard()'s check is on by default (and the same in debug mode): see test_catalogue.
        assert (
            "shard(): ['w'] (float32 (4, 3), P('dp')) differs between the ranks of Mesh(dp=2)"
            in (s["differs"])
        )
        assert "rank 0: checksum" in s["differs"] and "rank 1: checksum" in s["differs"]
        assert "torch.manual_seed" in s["differs"] and "['b']" not in s["differs"]
        assert s["default"] == s["differs"]
        assert s["env_switch"] is True and s["env_differs"] == s["differs"]
    assert all(pools.run(2, W.checked_train_step)[i]["same"] for i in (0, 1))


@pytest.mark.multiprocess
def test_debug_mode_names_the_parameters_of_fsdp_buckets_that_differ(pools):
    """Rank 0 runs an MLP 8-8-16-4, rank 1 an MLP 8-8-12-8 (and Llamas with other head_dim
    and intermediate sizes): equal bucket sizes, so only the parameters' names, shapes and
    specs that the engine hands its collectives can tell them apart."""
    r0, r1 = pools.run(2, W.mismatched_models)
    assert r0["shard_numel"] == r1["shard_numel"] == 142
    assert (r0["unchecked"], r1["unchecked"]) == ((4, 4), (4, 8))  # silently reinterpreted
    for r in (r0, r1):
        assert r["healthy"] and r["healthy_after_forward"] and r["healthy_after_llama"]
        fwd, bwd, llama = r["mlp_forward"], r["mlp_backward"], r["llama"]
        assert "collective mismatch over mesh axis 'dp' of the mesh Mesh(dp=2)" in fwd
        # The first two parameters agree; each rank's part starts at the first that differs.
        for rank, *rest in ((0, "(16, 8)", "(16,)", "(4, 16)"), (1, "(12, 8)", "(12,)", "(8, 12)")):
            expected = (
                f"holding 2 matching items, then (\"2.weight {rest[0]} P('dp', None)\", "
                f"\"2.bias {rest[1]} P('dp')\", \"4.weight {rest[2]} P('dp', None)\""
            )
            assert re.search(
                rf"rank {rank}: all_gather #\d+ over 'dp' of float32 \(142,\) "
                + re.escape(expected),
                fwd,
            )
        for rank, weight in ((0, "(16, 8)"), (1, "(12, 8)")):
            assert re.search(
                rf"rank {rank}: reduce_scatter #\d+ over 'dp' of float32 \(2, 142\) \(sum\) "
                rf"holding 2 matching items, then \(\"2\.weight {re.escape(weight)}",
                bwd,
            )
        assert "model.layers.0.self_attn.q_proj.weight (32, 32) P('dp', None)" in llama
        assert "model.layers.0.self_attn.q_proj.weight (16, 32) P('dp', None)" in llama


def test_debug_mode_is_off_by_default_and_scoped():
    from functional_fsdp.distributed import checks as C

    assert C._CHECK is False
    with ff.check_collectives():
        assert C._CHECK is True
        with ff.check_collectives(False):
            assert C._CHECK is False
    assert C._CHECK is False
