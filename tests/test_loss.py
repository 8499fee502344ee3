"""The loss users mean: ``(sum, count)`` losses give one process's token mean of the global
batch (Hugging Face Trainer's default), in every strategy and mode, with variable-length
data split unevenly over 2 and 4 gloo ranks and micro-batches; ``has_aux`` outputs reduce
by their rule. One process on the global batch is the reference."""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff

from . import _loss_workers as W

TWO = [name for name, (axes, _, _) in W.CASES.items() if sum(axes.values()) == 2]
FOUR = [name for name in W.CASES if name not in TWO]


def check(results: dict[str, dict[str, float]], names: list[str]) -> None:
    assert sorted(results) == sorted(names), results
    for name in names:
        err = results[name]
        assert err["loss"] < 1e-5, (name, err)
        assert err["count"] == 0, (name, err)
        assert err["counted_share"] < 1e-6, (name, err)
        assert err.get("accuracy", 0.0) < 1e-6, (name, err)
        assert err["grads"] < 1e-4, (name, err)


def test_token_mean_on_two_ranks(pools) -> None:
    results = pools.run(2, W.gloo_token_mean, TWO)
    assert results[0] == results[1]
    old = results[0].pop("mean_of_means")
    check(results[0], TWO)
    # The mean of the shares' means (a scalar loss) is not the token mean on this data:
    # the comparison above can fail.
    assert old["loss"] > 1e-3 and old["grads"] > 0.1, old


def test_token_mean_on_four_ranks(pools) -> None:
    results = pools.run(4, W.gloo_token_mean, FOUR)
    check(results[0], FOUR)


def test_sum_count_on_one_process_matches_torch() -> None:
    """Without a mesh: the step's loss is the sum over the count, its gradient that of the
    token mean; metrics['count'] is the count."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(6, 4), torch.tensor([0, -100, 2, 1, -100, 2])
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_fn(p, b):
        out = torch.func.functional_call(model, p, (b[0],))
        total = torch.nn.functional.cross_entropy(out, b[1], reduction="sum")
        return total, (b[1] != -100).sum()

    step = ff.train_step(loss_fn, ff.sgd(1.0), batch="local", accumulate=3)
    new, metrics = step(ff.TrainState.create(params, ff.sgd(1.0)), (x, y))
    grads, expected = torch.func.grad_and_value(
        lambda p: torch.nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y)
    )(params)
    torch.testing.assert_close(metrics["loss"], expected)
    assert metrics["count"].item() == 4 and not metrics["count"].is_floating_point()
    for n, g in grads.items():
        torch.testing.assert_close(params[n] - new.params[n], g)


def test_plain_aux_is_averaged_and_sum_count_aux_divided() -> None:
    def loss_fn(p, b):
        return p["w"].sum() * b.sum(), {"m": b.mean(), "r": ff.SumCount(b.sum(), (b > 1.5).sum())}

    step = ff.train_step(
        loss_fn,
        ff.sgd(0.1),
        batch="local",
        accumulate=2,
        has_aux=True,
    )
    b = torch.tensor([1.0, 2.0, 3.0, 10.0])
    _, metrics = step(ff.TrainState.create({"w": torch.ones(4)}, ff.sgd(0.1)), b)
    torch.testing.assert_close(metrics["aux"]["m"], b.mean())  # the mean of 1.5 and 6.5
    # 16 over 3 counted, not the mean of the micro-batches' ratios 3 / 1 and 13 / 2
    torch.testing.assert_close(metrics["aux"]["r"], torch.tensor(16 / 3))
    assert "count" not in metrics


@pytest.mark.parametrize(
    ("out", "has_aux", "match"),
    [
        (lambda p: (p.sum(), {"acc": p.mean()}), False, r"not a count.*has_aux=True"),
        (lambda p: p.sum(), True, r"has_aux=True.*must return \(loss, aux\)"),
        (lambda p: (p.sum(), p.sum(), p.sum()), False, r"tuple of 3.*\(sum, count\)"),
        (lambda p: (p, torch.tensor(2)), False, r"sum of a \(sum, count\) loss.*0-dim"),
        (lambda p: ((p.sum(), torch.ones(2)), None), True, r"count of a \(sum, count\) loss"),
    ],
)
def test_bad_loss_outputs_are_named(out, has_aux, match) -> None:
    step = ff.train_step(lambda p, b: out(p["w"]), ff.sgd(0.1), batch="local", has_aux=has_aux)
    with pytest.raises((ValueError, TypeError), match=match):
        step(ff.TrainState.create({"w": torch.ones(2)}, ff.sgd(0.1)), torch.ones(2))
