"""DCP checkpoints reshard: save on one mesh, load on another, training continues exactly."""

from __future__ import annotations

import pytest
import torch

from . import _ckpt_workers as K

pytestmark = pytest.mark.multiprocess


def _same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert abs(a["next_loss"] - b["next_loss"]) < 1e-5, (a["next_loss"], b["next_loss"])


def test_save_on_2_load_on_4_and_2x2_and_1(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools.run(2, K.train_and_save, {"dp": 2}, path, 3)[0]
    for world, axes in [(4, {"dp": 4}), (4, {"replicate": 2, "shard": 2}), (1, {"dp": 1})]:
        loaded = pools.run(world, K.load_and_continue, axes, path, 3)
        assert all(r["untouched"] for r in loaded)
        _same(saved, loaded[0])
