"""The ZeRO paper's ZeRO-1 and ZeRO-2 on real gloo processes: DDP's traffic, the planner's
bytes at rest for every strategy (fp32, and bf16 with fp32 masters in the optimizer state),
the bf16 bound against the fp32 run, and checkpoints that keep the masters.

Trajectories against one process (fp32) are in ``tests/test_train.py``.
"""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT

from . import _zero_workers as W


def planned(name: str, bf16: bool) -> ff.PlanReport:
    axes, fsdp_kwargs, step_kwargs = W.STRATEGIES[name]
    fsdp_kwargs = dict(fsdp_kwargs)
    if bf16:
        policy = fsdp_kwargs.pop("policy", ff.Policy())
        fsdp_kwargs["policy"] = ff.Policy(
            reshard_after_forward=policy.reshard_after_forward, mixed_precision=W.BF16
        )
    with torch.device("meta"):
        model = GPT(W.CFG)
    return ff.plan(
        model,
        axes,
        batch=(W.BATCH, W.SEQ - 1),
        optimizer=W.optimizer(bf16),
        opt_specs=step_kwargs.get("opt_specs"),
        accumulate_mode=step_kwargs.get("accumulate_mode", "reduce_each"),
        **fsdp_kwargs,
    )


def check_measured(measured: dict) -> None:
    for (name, bf16), got in measured.items():
        report = planned(name, bf16)
        where = (name, "bf16" if bf16 else "fp32")
        assert report.by_kind_and_axis() == got["comms"], where
        assert report.param_bytes == got["param_bytes"], where
        assert report.grad_bytes == got["grad_bytes"], where
        assert report.opt_state_bytes == got["opt_state_bytes"], where
        assert got["param_dtypes"] == ["torch.bfloat16" if bf16 else "torch.float32"], where


def check_paper_traffic(measured: dict, n: int, suffix: str = "") -> None:
    """Per rank per step: DDP all-reduces 2Ψ(N-1)/N; ZeRO-1/2 reduce-scatter Ψ(N-1)/N and
    all-gather Ψ(N-1)/N (Ψ: parameter bytes in the compute dtype), one collective each for
    ZeRO-1 and the gather, one reduce-scatter per unit for ZeRO-2."""
    units = W.CFG.n_layer + 1
    for bf16 in (False, True):
        psi = measured[("ddp" + suffix, bf16)]["param_bytes"]
        share = psi * (n - 1) // n
        scalar = 2 * 4 * (n - 1) // n  # one fp32 scalar all-reduced (the loss, the norm)
        ddp = measured[("ddp" + suffix, bf16)]["comms"]
        assert ddp == {("all_reduce", "dp"): (units + 1, 2 * share + scalar)}
        for name, reduce_scatters in (("zero1", 1), ("zero2", units)):
            got = measured[(name + suffix, bf16)]["comms"]
            assert got == {
                ("reduce_scatter", "dp"): (reduce_scatters, share),
                ("all_gather", "dp"): (1, share),
                # the loss; the norm's sum of squares with its count of non-finite tensors
                # beside it (per-element finiteness rides in the same all-reduce)
                ("all_reduce", "dp"): (2, 3 * scalar),
            }, (name, bf16)


@pytest.mark.multiprocess
def test_gloo_2_ranks_traffic_and_bytes_at_rest_equal_the_planner_and_the_paper(pools):
    names = ["ddp", "zero1", "zero2", "shard_grad_op", "zero3"]
    measured = pools.run(2, W.measure, names)[0]
    check_measured(measured)
    check_paper_traffic(measured, 2)
    # The paper's memory per parameter: ZeRO-1 keeps full gradients, ZeRO-2 their shard;
    # with masters the replicated params are bf16 and the optimizer holds 12 bytes / N.
    psi = sum(p.numel() for p in GPT(W.CFG).parameters())
    z1, z2 = measured[("zero1", True)], measured[("zero2", True)]
    assert (z1["param_bytes"], z1["grad_bytes"], z1["opt_state_bytes"]) == (
        2 * psi,
        2 * psi,
        12 * psi // 2,
    )
    assert (z2["param_bytes"], z2["grad_bytes"], z2["opt_state_bytes"]) == (
        2 * psi,
        2 * psi // 2,
        12 * psi // 2,
    )


@pytest.mark.multiprocess
def test_gloo_4_ranks_traffic_and_bytes_at_rest_hsdp_and_zero(pools):
    measured = pools.run(4, W.measure, ["hsdp", "ddp_dp4", "zero1_dp4", "zero2_dp4"])[0]
    check_measured(measured)
    check_paper_traffic(measured, 4, "_dp4")


@pytest.mark.multiprocess
def test_gloo_bf16_with_fp32_masters_follows_the_fp32_run_and_checkpoints_keep_them(pools):
    results = pools.run(2, W.bf16_runs, ["ddp", "zero1", "zero2"], 10)[0]
    for name, r in results.items():
        # The masters are what fp32 parameters computing in bf16 would be, bit for bit ...
        assert r["vs_fp32_params"] == (0.0, 0.0), (name, r)
        # ... the bf16 parameters are exactly the masters rounded ...
        assert r["rounded"], name
        # ... and the whole run stays within bf16's reach of the all-fp32 one (measured:
        # 0.068 in the loss and 0.067 in a master after 10 AdamW steps at lr 1e-2).
        loss_diff, master_diff, param_diff = r["vs_fp32"]
        assert loss_diff < 0.1 and master_diff < 0.1 and param_diff < 0.1, (name, r)
    # Every strategy computes the same bf16 step: only the layout differs.
    assert len({r["vs_fp32"] for r in results.values()}) == 1, results
    same, resumed = pools.run(2, W.checkpoint_masters, "zero2")[0]
    assert same and resumed


@pytest.mark.multiprocess
def test_master_weights_pass_the_step_norm_to_a_clip_inside(pools):
    """``master_weights(chain(clip_by_global_norm, adamw))`` all-reduces one gradient norm per
    step, not two: the bf16 gradients widened to fp32 have the norm the step computed (same
    values, same dtype), so it is passed on, and the run is bitwise the one whose clip
    computes its own."""
    r = pools.run(2, W.clipped_masters)[0]
    assert r["clipped"]
    assert r["passed/all_reduces"] == 2  # the loss's mean and the one gradient norm
    assert r["own/all_reduces"] == 3
    with torch.device("meta"):
        model = GPT(W.CFG)
    bf16 = ff.Policy(mixed_precision=W.BF16)
    optimizer = W.clipped_masters_optimizer()
    report = ff.plan(model, {"dp": 2}, batch=(W.BATCH, W.SEQ - 1), optimizer=optimizer, policy=bf16)
    assert report.by_kind_and_axis()[("all_reduce", "dp")][0] == 2  # the planner runs the step
    assert r["passed/norms"] == r["own/norms"]
    for k, v in r["passed/masters"].items():
        assert torch.equal(v, r["own/masters"][k]), k
