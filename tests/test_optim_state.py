"""What passes between an optimizer and train_step: its arguments and its state, nothing else.

The learning rate and the reports of apply_if_finite live in the optimizer state (fields
listed in the state class's ``METRICS``), master_weights' parameter dtype is a static field of
its state, and train_step reads them from there (``optim/records.py``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.optim.records import metrics_of
from functional_fsdp.optim.transforms import ConstantLearningRateState, ScaleByLearningRateState

SCHEDULE = ff.linear_schedule(1.0, 0.0, transition_steps=4)


def _wrapped(opt: ff.GradientTransformation) -> ff.GradientTransformation:
    """The same optimizer behind new functions: nothing attached to ``opt``'s functions
    survives, only what its state holds."""
    return ff.GradientTransformationExtraArgs(
        lambda params: opt.init(params),
        lambda updates, state, params=None, **kw: opt.update(updates, state, params, **kw),
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: ff.adamw(SCHEDULE, weight_decay=0.01),
        lambda: ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.sgd(SCHEDULE, momentum=0.9)),
        lambda: ff.masked(ff.adamw(SCHEDULE, weight_decay=0.01), {"w": True}),
        lambda: ff.apply_if_finite(ff.adamw(SCHEDULE, weight_decay=0.01), 2),
        lambda: ff.master_weights(
            ff.adamw(SCHEDULE, weight_decay=0.01), param_dtype=torch.bfloat16
        ),
    ],
    ids=["adamw", "chain", "masked", "apply_if_finite", "master_weights"],
)
def test_the_learning_rate_is_read_from_the_state_through_any_wrapper(make):
    opt = make()
    step = ff.train_step(lambda p, b: (p["w"].float() * b).sum(), _wrapped(opt), batch="local")
    state = ff.TrainState.create({"w": torch.ones(3)}, opt)
    assert math.isnan(ff.learning_rate_of(state.opt_state))  # no update yet
    rates = []
    for _ in range(3):
        state, metrics = step(state, torch.ones(3))
        rates.append(float(metrics["lr"]))
        assert float(ff.learning_rate_of(state.opt_state)) == rates[-1]
    assert rates == [SCHEDULE(0), SCHEDULE(1), SCHEDULE(2)]


def test_a_constant_rate_is_recorded_and_train_step_can_still_be_told_one():
    opt = ff.sgd(0.25)
    state = opt.init({"w": torch.ones(1)})
    assert state == (ConstantLearningRateState(0.25),) and ff.learning_rate_of(state) == 0.25
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local", learning_rate=0.5)
    _, metrics = step(ff.TrainState.create({"w": torch.ones(1)}, opt), torch.ones(1))
    assert metrics["lr"] == 0.5  # train_step(learning_rate=...) wins over the record


def test_learning_rate_of_optimizer_and_state_is_deprecated():
    opt = ff.sgd(SCHEDULE)
    params = {"w": torch.ones(1)}
    _, state = opt.update({"w": torch.ones(1)}, opt.init(params), params)
    with pytest.warns(DeprecationWarning, match=r"learning_rate_of\(state\)"):
        assert ff.learning_rate_of(opt, state) == SCHEDULE(0)
    with pytest.raises(TypeError, match=r"takes one optimizer state, got 3 arguments"):
        ff.learning_rate_of(opt, state, state)


def test_apply_if_finite_reports_from_its_state():
    opt = ff.apply_if_finite(ff.sgd(SCHEDULE), max_consecutive_errors=1)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    seen = []
    for g in (1.0, float("nan"), float("nan"), 1.0):
        _, state = opt.update({"w": torch.full((2,), g)}, state, params)
        m = metrics_of(state)
        seen.append((bool(m["skipped"]), int(m["nonfinite_steps"]), float(m["lr"])))
    # The second NaN in a row exceeds max_consecutive_errors=1: applied anyway (rate 1: 0.75).
    assert seen == [(False, 0, 1.0), (True, 1, 1.0), (False, 2, 0.75), (False, 2, 0.5)]
    assert isinstance(state.inner_state[0], ScaleByLearningRateState)
    lr = state.inner_state[0].learning_rate  # tensor counts make a tensor record
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64


def test_donated_metrics_are_not_overwritten_by_the_next_step():
    opt = ff.apply_if_finite(ff.adamw(SCHEDULE, weight_decay=0.01), 3)
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local", donate=True)
    state = ff.TrainState.create({"w": torch.ones(2)}, opt)
    state, first = step(state, torch.ones(2))
    kept = {k: float(v) for k, v in first.items()}
    state, _ = step(state, torch.ones(2))
    assert {k: float(v) for k, v in first.items()} == kept


def test_master_weights_keeps_its_param_dtype_in_the_state_not_in_checkpoints(tmp_path):
    opt = ff.master_weights(ff.adamw(1e-2, weight_decay=0.01), param_dtype=torch.float16)
    state = ff.TrainState.create({"w": torch.ones(2)}, opt)
    assert state.opt_state.param_dtype == torch.float16
    assert state.params["w"].dtype == torch.float16
    leaves = ff.tree_leaves(state.opt_state)
    assert not any(isinstance(x, torch.dtype) for x in leaves)  # static, not a leaf


def _old_adamw_state(params: dict[str, torch.Tensor], count: int) -> Any:
    """``adamw(schedule, weight_decay=0.01)``'s state as versions before the recorded rate built it."""
    adam = ff.scale_by_adam().init(params)._replace(count=count)
    return (adam, ff.EmptyState(), ff.ScaleByScheduleState(count))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_without_the_recorded_rate_loads(tmp_path):
    params = {"w": torch.ones(2)}
    old = ff.TrainState(params, _old_adamw_state(params, 3), 3)
    ff.checkpoint.save(tmp_path / "old", old)
    opt = ff.adamw(SCHEDULE, weight_decay=0.01)
    template = ff.TrainState.create({"w": torch.zeros(2)}, opt)
    loaded = ff.checkpoint.load(tmp_path / "old", template)
    assert loaded.opt_state[2] == ScaleByLearningRateState(3, template.opt_state[2].learning_rate)
    assert loaded.step == 3 and torch.equal(loaded.params["w"], params["w"])
    step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local")
    _, metrics = step(loaded, torch.ones(2))
    assert metrics["lr"] == SCHEDULE(3)  # the next update records its rate again
    # Another key missing is still an error that names it.
    with pytest.raises(ValueError, match=r"'params\.v' is not in the checkpoint"):
        ff.checkpoint.load(tmp_path / "old", ff.TrainState.create({"v": torch.zeros(2)}, opt))
