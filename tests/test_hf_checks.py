"""The checks that refuse silent wrong numbers, on ``transformers`` models built from a config
(2 gloo processes): a forward that writes BatchNorm statistics, and ranks passing different
global batches to ``train_step``. What the checks let through matches one process."""

from __future__ import annotations

import pytest

from . import _hf_checks_workers as W

pytestmark = pytest.mark.multiprocess


def test_a_resnet_in_training_mode_is_refused_and_in_eval_mode_matches_one_process(pools):
    for r in pools.run(2, W.resnet_batchnorm):
        assert r["message"].startswith(
            "FSDP.apply: the forward writes the buffer "
            "'resnet.embedder.embedder.normalization.running_mean' of BatchNorm2d (shape (8,), "
            "torch.float32) in place"
        ), r["message"]
        assert r["unchanged"]  # refused before the write
        assert r["loss_error"] < 1e-6 and r["grad_error"] < 1e-6, r


def test_a_llama_step_refuses_per_rank_batches_and_matches_one_process_on_one_batch(pools):
    for r in pools.run(2, W.llama_per_rank_batch, False):
        assert r["message"].startswith(
            "train_step(batch='global'): batch['input_ids'] differs between the ranks of "
            "Mesh(dp=2):\n  rank 0: shape (4, 16), torch.int64, checksum "
        ), r["message"]
    for r in pools.run(2, W.llama_per_rank_batch, True):
        assert r["message"] == "no error" and r["loss_error"] < 1e-5, r
