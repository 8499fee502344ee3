"""Worker functions for the checkpoint tests (real gloo)."""

from __future__ import annotations

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, lm_loss

from ._fsdp_workers import CFG
from ._train_workers import batches


def _setup(axes: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    mesh = ff.make_mesh(axes)
    f = ff.fsdp(model, mesh)
    opt = ff.adamw(1e-2, eps=1e-6, weight_decay=0.01)
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    return f, opt, step


def train_and_save(axes: dict, path: str, steps: int) -> dict:
    """Train ``steps`` steps, save, and return the full params plus the loss of one more step."""
    f, opt, step = _setup(axes)
    state = ff.TrainState.create(f.shard(), opt)
    data = batches(steps + 1)
    for b in data[:steps]:
        state, _ = step(state, b)
    ff.checkpoint.save(path, state)
    full = ff.gather(state.params)
    _, metrics = step(state, data[steps])
    return {"params": full, "next_loss": float(metrics["loss"]), "step": state.step}


def load_and_continue(axes: dict, path: str, steps: int) -> dict:
    """Load into a fresh state on another mesh (different seed), take the next step."""
    f, opt, step = _setup(axes, seed=123)
    template = ff.TrainState.create(f.shard(), opt)
    before = [t.clone() for t in ff.tree_leaves(template.params)]
    state = ff.checkpoint.load(path, template)
    untouched = all(torch.equal(a, b) for a, b in zip(before, ff.tree_leaves(template.params)))
    full = ff.gather(state.params)
    _, metrics = step(state, batches(steps + 1)[steps])
    return {
        "params": full,
        "next_loss": float(metrics["loss"]),
        "step": state.step,
        "untouched": untouched,
    }
