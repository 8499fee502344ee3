"""torch's tensor-parallel API accepted as written: plans in torch's styles, translated.

The reference model is torchtitan's Llama3 (its package), parallelized by torchtitan's own
``apply_tp`` (torch's ``parallelize_module``) and ``apply_fsdp`` (``fully_shard``).
"""

from __future__ import annotations

import importlib.util

import pytest

from . import _torch_tp_workers as W

needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan (a test-only dependency in the dev extra) is not installed",
)


@needs_torchtitan
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "sequence_parallel, loss_parallel", [(False, False), (True, True)], ids=["tp", "tp+sp+loss"]
)
def test_torchtitan_llama3_with_the_tutorial_plan_in_torch_styles(
    pools, sequence_parallel, loss_parallel
):
    runs = pools.run(4, W.compare, sequence_parallel, loss_parallel)
    for r in runs:
        assert r["loss_vs_single"] < 1e-5 and r["loss_vs_titan"] < 1e-5, r
        assert r["grad_vs_single"] < 1e-5 and r["grad_vs_titan"] < 1e-5, r
        assert r["param_vs_single"] < 2e-4 and r["param_vs_titan"] < 2e-4, r
        assert r["losses"][-1] < r["losses"][0], r  # the five steps train
    print({k: max(r[k] for r in runs) for k in runs[0] if k != "losses"})
