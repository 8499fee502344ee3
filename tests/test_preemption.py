"""CheckpointManager.reached_preemption: the signal handler is installed only when asked and
put back on close; a signal is noted, not fatal; the answer comes at a check step.

The agreement between ranks, the save and the bitwise requeued run are tested on real
processes under torchrun in tests/test_reliability.py
(test_sigterm_to_one_rank_saves_exits_zero_and_the_requeued_run_is_bitwise).
"""

from __future__ import annotations

import os
import signal

import pytest

from functional_fsdp.checkpoint import CheckpointManager


def test_the_handler_is_installed_by_the_first_call_and_restored_by_close(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(tmp_path, save_every=10)
    assert signal.getsignal(signal.SIGTERM) is before  # a manager alone changes nothing
    assert mgr.reached_preemption(1) is False
    assert signal.getsignal(signal.SIGTERM) is not before
    os.kill(os.getpid(), signal.SIGTERM)  # noted; the process goes on
    # Step 2 starts the vote that carries the note; step 3 reads it: every rank stops there.
    assert [mgr.reached_preemption(s) for s in (2, 3, 4)] == [False, True, True]
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_named_signal_and_a_check_every_k_steps(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    term = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(
        tmp_path, save_every=10, preemption_signals=[signal.SIGUSR1], preemption_check_every=3
    ) as mgr:
        assert [mgr.reached_preemption(s) for s in (1, 2, 3)] == [False] * 3
        assert signal.getsignal(signal.SIGTERM) is term  # only the named signal is watched
        os.kill(os.getpid(), signal.SIGUSR1)
        answers = {s: mgr.reached_preemption(s) for s in range(4, 10)}
    # The vote of step 3 saw nothing; step 6's carries the note; step 9 reads it.
    assert [s for s, stop in answers.items() if stop] == [9]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_no_signal_means_no_stop(tmp_path):
    with CheckpointManager(tmp_path, save_every=10) as mgr:
        assert not any(mgr.reached_preemption(s) for s in range(1, 20))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_check_every_must_be_a_positive_int(tmp_path, bad):
    with pytest.raises(ValueError, match=r"preemption_check_every must be a positive int, got"):
        CheckpointManager(tmp_path, save_every=10, preemption_check_every=bad)


@pytest.mark.parametrize("bad", [(), 15, ("SIGTERM",), (9999,)])
def test_signals_must_be_a_sequence_of_signals(tmp_path, bad):
    with pytest.raises(ValueError, match=r"preemption_signals must be a non-empty sequence of"):
        CheckpointManager(tmp_path, save_every=10, preemption_signals=bad)


def test_a_closed_manager_refuses(tmp_path):
    mgr = CheckpointManager(tmp_path, save_every=10)
    mgr.close()
    with pytest.raises(ValueError, match=r"reached_preemption: this manager for .* was closed"):
        mgr.reached_preemption(1)
