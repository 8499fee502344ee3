"""Buffers carried as state, Flax's way: ``FSDP.apply(buffers=..., mutable=...)`` returns the
new BatchNorm statistics functionally, synchronised over the data axes (equal to one process on
the global batch) or per data rank (equal to torch DDP), on 2 gloo processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functional_fsdp as ff

from . import _buffers_workers as W


@pytest.fixture
def sim_dp2():
    with ff.simulated_mesh({"dp": 2}) as mesh:
        yield mesh


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "engine,checkpointed", [("func", False), ("autograd", False), ("func", True)]
)
def test_sync_batch_stats_equal_one_process_on_the_global_batch(pools, engine, checkpointed):
    for r in pools.run(2, W.sync_matches_one_process, engine, checkpointed):
        assert r["units"] > 2, r  # BatchNorm layers inside units, not only in the root
        assert r["logits"] < 1e-5 and r["grads"] < 1e-5, r
        assert r["buffers"] < 1e-5, r
        assert r["moved"] > 1e-3 and r["tracked"] == W.STEPS, r  # the statistics did move
        assert r["given_written"] == 0 and r["unchanged"] == 0, r  # inputs never written


@pytest.mark.multiprocess
def test_per_rank_batch_stats_equal_torch_ddp(pools):
    results = pools.run(2, W.per_rank_matches_ddp)
    for r in results:
        assert r["logits"] < 1e-5 and r["grads"] < 1e-5, r
        assert r["buffers"] < 1e-6 and r["buffers_rank0"] < 1e-6, r
        assert r["eval"] < 1e-5, r
    # rank 1's own statistics (DDP's, before its next broadcast) differ from rank 0's: each
    # rank normalised with its own share
    assert results[1]["spread"] > 1e-3, results


@pytest.mark.multiprocess
@pytest.mark.parametrize("accumulate", [1, 2])
def test_train_step_threads_buffers_and_equals_one_process(pools, accumulate):
    for r in pools.run(2, W.train_step_sync_matches_one_process, accumulate):
        assert r["params"] < 1e-5 and r["buffers"] < 1e-5, r
        assert r["tracked"] == {W.STEPS * accumulate}, r  # every micro-batch, in order
        assert r["unchanged"] == 0, r


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2"])
def test_train_step_with_sync_statistics_is_exact_in_float64(pools, world, name):
    # In float64 the rounding of either side is far below what the test reads, so any
    # difference in the algorithm (the statistics, their gradients, the running updates)
    # would show: 3 SGD steps on transformers' ResNet and MobileNetV2 equal one process (at a
    # learning rate that does not diverge, which would amplify any rounding at all).
    fn = W.train_step_sync_matches_one_process
    results = pools.run(world, fn, 1, name, torch.float64, 1e-3)
    for r in results:
        assert r["params"] < 1e-9 and r["buffers"] < 1e-9, r
        assert r["tracked"] == {W.STEPS}, r


@pytest.mark.multiprocess
def test_mobilenet_v2_float32_gradients_are_as_close_to_exact_as_one_process(pools):
    # MobileNetV2's last BatchNorms see a few values per channel with eps 1e-3: one process's
    # own float32 gradients are 5e-5 (relative) from float64's, and SGD amplifies that over
    # steps. Sync statistics on 4 ranks are no further from float64 than one process is.
    for r in pools.run(4, W.first_gradients_against_float64, "mobilenet_v2"):
        assert r["ours"] <= 1.5 * r["one_process"] and r["one_process"] < 1e-3, r


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,axes",
    [(2, {"dp": 2}), (4, {"dp": 4}), (4, {"replicate": 2, "shard": 2})],
    ids=["dp2", "dp4", "hsdp2x2"],
)
def test_sync_statistics_keep_their_digits_when_the_mean_is_far_from_zero(pools, world, axes):
    # Inputs of std 1 and mean up to 1e4: the global variance by E[x²] − E[x]² in float32
    # loses every digit at 1e3 (outputs off by 0.35); per-rank moments combined by Chan's
    # formula are as close to one float64 process on the global batch as one process in the
    # same dtype is, or within the float32 rounding of the inputs themselves (a float32 input
    # of mean s is known to eps·s) and of the result's own dtype.
    eps32 = torch.finfo(torch.float32).eps
    for r in pools.run(world, W.sync_statistics_at_shifts, axes):
        assert len(r) == 2 * len(W.SHIFTS) * 2, sorted(r)
        for case, quantities in r.items():
            dtype, shift, _ = case.split()
            stored = torch.finfo(getattr(torch, dtype)).eps
            for what, (ours, one_process, scale) in quantities.items():
                if what == "statistics":
                    noise = 8 * eps32 * scale
                else:
                    noise = 4 * eps32 * (1 + float(shift)) * max(1.0, scale)
                tolerance = 2 * one_process + noise + (stored * scale if dtype != "float32" else 0)
                assert ours <= tolerance, (case, what, quantities)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_bad_mutable_arguments_are_refused_with_the_fix(sim_dp2):
    model = _bn_model()
    sm = ff.fsdp(model, sim_dp2)
    params, x = sm.shard(), torch.ones(4, 3)
    bufs = dict(model.named_buffers())
    with pytest.raises(ValueError, match=r"mutable='bogus'; pass mutable='sync'.*'per_rank'"):
        sm.apply(params, x, buffers=bufs, mutable="bogus")
    with pytest.raises(ValueError, match=r"needs the buffers it updates: pass buffers=dict\("):
        sm.apply(params, x, mutable="sync")
    with pytest.raises(ValueError, match=r"writes the buffer '1.running_mean'.*mutable='sync'"):
        sm.apply(params, x, buffers=bufs)  # without mutable=: refused, naming the new way
    with pytest.raises(ValueError, match=r"per_rank'\) runs on real processes only"):
        sm.apply(params, x, buffers=bufs, mutable="per_rank")


def test_train_step_with_buffers_asks_for_the_new_ones():
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    ref = _bn_model()
    ref(x)  # one process on the global batch
    model = _bn_model()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(model, mesh)
        opt = ff.sgd(0.1)
        state = ff.TrainState.create(sm.shard(), opt, buffers=dict(model.named_buffers()))
        loss_only = ff.train_step(
            lambda p, b, bufs: sm.apply(p, b, buffers=bufs, mutable="sync")[0].sum(),
            opt,
            model=sm,
        )
        with pytest.raises(TypeError, match=r"must return \(loss, new_buffers\)"):
            loss_only(state, x)
        with pytest.raises(TypeError, match=r"buffers must be a dict \{name: tensor\}"):
            ff.TrainState.create(sm.shard(), opt, buffers=[1])

        def loss_fn(p, b, bufs):
            out, new = sm.apply(p, b, buffers=bufs, mutable="sync")
            return out.square().mean(), new

        # sync mode on a simulated mesh: the statistics of the global batch, on every rank
        new, _ = ff.train_step(loss_fn, opt, model=sm)(state, x)
        values = {k: ff.rank_values(v) for k, v in new.buffers.items()}
    for k, b in ref.named_buffers():
        for v in values[k]:
            torch.testing.assert_close(v, b)
