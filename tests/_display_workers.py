"""Worker functions for the picture tests: layouts drawn on real gloo processes.

Each function builds the same values as the simulated tests and returns what a picture
shows (text, HTML) with this rank's real local block, so the test can check every cell
against the data the rank holds.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

# (shape, spec) per value; the mesh is {"dp": world_size}
VALUES = {
    "w": ((5, 4), ff.P("dp")),
    "b": ((3,), ff.P("dp")),
    "r": ((2, 2), ff.P()),
}
GPT_CFG = GPTConfig(n_layer=2, vocab_size=32, n_embd=16, n_head=2, block_size=8)


def full(shape: tuple[int, ...]) -> torch.Tensor:
    """The global value: 1, 2, 3, ... (no zeros, so padding is told apart)."""
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def render(fn: Any, *args: Any, **kwargs: Any) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, color_system=None, record=True)
    fn(*args, console=console, **kwargs)
    return console.export_text()


def pictures() -> dict[str, Any]:
    """visualize/describe/_repr_html_ of :data:`VALUES` on this rank, with its local blocks."""
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    tree = {k: ff.shard(full(shape), mesh, spec) for k, (shape, spec) in VALUES.items()}
    return {
        "visualize": {k: render(ff.visualize, v, legend=False) for k, v in tree.items()},
        "tree": render(ff.visualize, tree),
        "describe": render(ff.describe, tree),
        "html": {k: v._repr_html_() for k, v in tree.items()},
        "local": {k: v.local.clone() for k, v in tree.items()},
    }


def gpt_comms(batch: torch.Tensor) -> dict[tuple[str, str], tuple[int, int]]:
    """One ZeRO-3 step of a tiny GPT: the collectives ``count_comms`` saw."""
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    sharded_model = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.adamw(1e-3, weight_decay=0.01)
    step = ff.train_step(
        lambda p, b: lm_loss(sharded_model.apply(p, b[:, :-1]), b[:, 1:]),
        opt,
        model=sharded_model,
    )
    state = ff.TrainState.create(sharded_model.shard(), opt)
    with ff.count_comms() as comms:
        step(state, batch)
    return comms.by_kind_and_axis()
