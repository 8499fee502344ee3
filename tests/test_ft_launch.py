"""``ff.ft.launch``: a fault-tolerant job on this machine with failures injected (a real
torchft lighthouse, 2 replica groups of 2 gloo processes), and what each step did."""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff

pytest.importorskip("torchft")


def build(group):
    mesh = ff.make_mesh({"dp": 2})
    torch.manual_seed(0)
    sm = ff.fsdp(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), mesh)
    opt = ff.adamw(1e-2)
    step = ff.train_step(lambda p, b: sm.apply(p, b).pow(2).mean(), opt, model=sm, replicas=group)
    return step, ff.TrainState.create(sm.shard(), opt, trainable=sm)


def batch_of(group_id: str, step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * int(group_id) + step))


def test_a_killed_group_rejoins_and_a_failed_all_reduce_is_run_again():
    rows = ff.ft.launch(build, batch_of, steps=8, kill={"1": 3}, fail={"0": 1}, timeout=240)
    zero = [r for r in rows if r.group == "0"]
    first = [r for r in rows if r.group == "1" and r.life == 0]
    again = [r for r in rows if r.group == "1" and r.life == 1]
    # Group 0's all-reduce failed in step 1: group 0 did not commit it, group 1 committed
    # it with both batches, and group 0 took group 1's state in step 2, counting no batch.
    assert [(r.step, r.committed, r.joined) for r in zero[:3]] == [
        (0, True, False),
        (1, False, False),
        (2, True, True),
    ]
    assert [(r.step, r.replicas, r.joined) for r in first] == [
        (0, 2, False),
        (1, 2, False),
        (2, 1, False),
    ]
    # Group 1 died at the start of step 3: group 0 went on alone, committing each step once.
    committed = [r for r in zero if r.committed]
    assert [r.step for r in committed] == [0, *range(2, 8)]
    counted = {r.step: r.replicas for r in committed}
    # The restarted group joined when group 0 reached step 5 (or a paced step later),
    # taking its state; from the next step on both groups' batches count.
    joined_at = again[0].step
    assert again[0].joined and again[0].committed and 5 <= joined_at <= 6, again
    assert [r.step for r in again] == list(range(joined_at, 8))
    assert not any(r.joined for r in again[1:])
    assert [counted[s] for s in range(3, 8)] == [1] * (joined_at - 2) + [2] * (7 - joined_at)
    # Both groups hold the same state, bitwise, at every step both committed.
    mine = {r.step: r.state for r in committed}
    both = [r for r in first[1:] + again if r.committed and r.step in mine]
    assert len(both) >= 3 and all(r.state == mine[r.step] for r in both), (both, mine)
    assert len(set(mine.values())) == len(mine)  # a hash of the state: new every step
    assert all(r.loss == r.loss for r in rows)  # a number in every row


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (dict(kill={"2": 1}), r"there is no group '2'; the groups are \['0', '1'\]"),
        (dict(kill={"1": 6}), r"group\(s\) \['1'\] would rejoin at or after the last step"),
        (dict(kill={"0": 1, "1": 2}), "every group is killed; at least one must live"),
        (dict(fail={"0": 8}), r"step 8 \(group '0'\) is not a step of the job \(0 to 7\)"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_before_any_process_starts(plan, match):
    with pytest.raises(ValueError, match=match):
        ff.ft.launch(build, batch_of, steps=8, **plan)
