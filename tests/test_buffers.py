"""Buffers carried as state, Flax's way: ``FSDP.apply(buffers=..., mutable=...)`` returns the
new BatchNorm statistics functionally, synchronised over the data axes (equal to one process on
the global batch) or per data rank (equal to torch DDP), on 2 gloo processes."""

from __future__ import annotations

import pytest

from . import _buffers_workers as W

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("engine", ["func", "autograd"])
def test_sync_batch_stats_equal_one_process_on_the_global_batch(pools, engine):
    for r in pools.run(2, W.sync_matches_one_process, engine):
        assert r["logits"] < 1e-5 and r["grads"] < 1e-5, r
        assert r["buffers"] < 1e-5, r
        assert r["moved"] > 1e-3 and r["tracked"] == W.STEPS, r  # the statistics did move
        assert r["given_written"] == 0 and r["unchanged"] == 0, r  # inputs never written


def test_per_rank_batch_stats_equal_torch_ddp(pools):
    results = pools.run(2, W.per_rank_matches_ddp)
    for r in results:
        assert r["logits"] < 1e-5 and r["grads"] < 1e-5, r
        assert r["buffers"] < 1e-6 and r["buffers_rank0"] < 1e-6, r
        assert r["eval"] < 1e-5, r
    # rank 1's own statistics (DDP's, before its next broadcast) differ from rank 0's: each
    # rank normalised with its own share
    assert results[1]["spread"] > 1e-3, results


@pytest.mark.parametrize("accumulate", [1, 2])
def test_train_step_threads_buffers_and_equals_one_process(pools, accumulate):
    for r in pools.run(2, W.train_step_sync_matches_one_process, accumulate):
        assert r["params"] < 1e-5 and r["buffers"] < 1e-5, r
        assert r["tracked"] == W.STEPS * accumulate, r  # every micro-batch, in order
        assert r["unchanged"] == 0, r


def test_buffers_are_checkpointed_and_resume_bitwise(pools, tmp_path):
    for r in pools.run(2, W.checkpoint_resume, str(tmp_path / "ckpt")):
        assert r["params"] == 0 and r["buffers"] == 0 and r["loaded_buffers"] == 0, r
        assert r["step"] == 3, r
        assert "buffers.resnet.embedder.embedder.normalization.running_mean" in r["buffer_keys"]
        assert (
            "buffers.resnet.embedder.embedder.normalization.num_batches_tracked"
            in (r["buffer_keys"])
        )
