"""Elastic resume on real gloo processes: saved on N ranks, continued on M, same trajectory.

The global batch stays 16 sequences: ``accumulate`` makes up for the data ranks that went
away (4 ranks x 1 micro-batch, 2 ranks x 2, each of 4 sequences). The losses follow the
uninterrupted 4-rank run within float reordering (a sum over ranks and micro-batches in
another order); docs/guides/preemption.md quotes the figures.
"""

from __future__ import annotations

import pytest

from . import _elastic_workers as W

pytestmark = pytest.mark.multiprocess

TOL = 1e-5  # measured: see docs/guides/preemption.md


def test_four_to_two_to_four_ranks_and_hsdp_2x2_to_four_follow_the_uninterrupted_run(
    pools, tmp_path
):
    ref = pools.run(4, W.segment, str(tmp_path / "ref"), {"dp": 4}, 6)[0]
    d = str(tmp_path / "elastic")
    got = pools.run(4, W.segment, d, {"dp": 4}, 2)[0]
    got += pools.run(2, W.segment, d, {"dp": 2}, 4)[0]  # accumulate 2
    got += pools.run(4, W.segment, d, {"dp": 4}, 6)[0]
    h = str(tmp_path / "hsdp")
    hsdp = pools.run(4, W.segment, h, {"replicate": 2, "shard": 2}, 3)[0]
    hsdp += pools.run(4, W.segment, h, {"dp": 4}, 6)[0]
    assert len(ref) == len(got) == len(hsdp) == 6
    print("4->2->4:", [abs(a - b) for a, b in zip(got, ref)])
    print("2x2->4:", [abs(a - b) for a, b in zip(hsdp, ref)])
    assert got[:2] == ref[:2]  # the same mesh, the same steps: bitwise
    assert max(abs(a - b) for a, b in zip(got, ref)) < TOL, (got, ref)
    assert max(abs(a - b) for a, b in zip(hsdp, ref)) < TOL, (hsdp, ref)
    assert ref[-1] < ref[0]  # it trains: the comparison is not between constants
