"""Workers for tests/test_elastic.py: a run saved on one mesh continues on another.

Every rank builds the same small GPT (no dropout: see the test) and draws the same global
batch of 16 sequences from a generator whose state is saved with the checkpoint. A mesh of
``n`` data ranks with ``accumulate=16 // (4 * n)`` splits it into the same four micro-batches
of 4 sequences whatever ``n`` is, so the step's loss and gradient are the same mean.
"""

from __future__ import annotations

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=2, block_size=16, dropout=0.0)
GLOBAL_BATCH = 16
MICRO = 4  # sequences per micro-batch on every mesh


def segment(directory: str, axes: dict[str, int], until: int) -> list[float]:
    """Train on a mesh of ``axes`` from the latest checkpoint in ``directory`` (or from the
    start) to step ``until``, save there; the losses of the steps run."""
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = ff.make_mesh(axes)
    f = ff.fsdp(model, mesh)
    data_ranks = 1
    for axis in f.data_axes:
        data_ranks *= ff.axis_size(mesh, axis)
    accumulate = GLOBAL_BATCH // (MICRO * data_ranks)
    opt = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(3e-3, weight_decay=0.1))
    step = ff.train_step(
        lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f, accumulate=accumulate
    )
    state = ff.TrainState.create(f.shard(), opt, rng=0)
    gen = torch.Generator().manual_seed(1)
    mgr = ff.checkpoint.CheckpointManager(directory, save_every=1_000_000)
    if mgr.latest_step() is not None:
        ckpt = mgr.restore({"state": state, "data": {"rng": gen.get_state()}})
        state = ckpt["state"]  # resharded onto this mesh by the load
        gen.set_state(ckpt["data"]["rng"])  # the data position: the next global batch
    losses = []
    while int(state.step) < until:
        batch = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, 13), generator=gen)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    mgr.save(int(state.step), {"state": state, "data": {"rng": gen.get_state()}}, force=True)
    mgr.close()
    return losses
