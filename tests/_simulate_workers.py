"""Runs shared by the simulation tests and their real gloo ground truth."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.distributed.mesh import coordinate_of, local_coordinate, mesh_grid, rank_at
from functional_fsdp.models import GPT, lm_loss

from ._fsdp_workers import CFG
from ._hf import tiny_llama_config

Comms = dict[tuple[str, str], tuple[int, int]]


def build(kind: str, *, meta: bool) -> tuple[torch.nn.Module, Any]:
    """The model (on ``meta`` for a shapes-only run) and its ``loss(sm, params, batch)``."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        if kind == "gpt":
            model: torch.nn.Module = GPT(CFG)
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(tiny_llama_config(use_cache=False))
    if kind == "gpt":
        return model, lambda sm, p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:])
    return model, lambda sm, p, b: sm.apply(p, input_ids=b, labels=b).loss


def step_comms(mesh: Any, kind: str = "gpt", *, shapes_only: bool = False) -> tuple[Comms, Any]:
    """One ZeRO-3 AdamW step on ``mesh``: the collectives it issued, and its loss."""
    model, loss = build(kind, meta=shapes_only)
    sm = ff.fsdp(model, mesh)
    opt = ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(1e-2, weight_decay=0.01))
    step = ff.train_step(lambda p, b: loss(sm, p, b), opt, model=sm)
    # A meta model: its meta parameters as they are (shard() lays out meta blocks).
    params = sm.shard(dict(model.named_parameters())) if shapes_only else sm.shard()
    state = ff.TrainState.create(params, opt)
    vocab = CFG.vocab_size if kind == "gpt" else 96
    size = ff.axis_sizes(mesh)
    n = 1
    for s in size.values():
        n *= s
    device = "meta" if shapes_only else "cpu"
    # The same on every rank: inside a simulation, a generator would be drawn from in turn.
    batch = (torch.arange(2 * n * 13).reshape(2 * n, 13) * 7919) % vocab
    with ff.count_comms() as comms:
        state, metrics = step(state, batch.to(device))
    return comms.by_kind_and_axis(), metrics["loss"]


def real_step_comms(kind: str) -> Comms:
    """The ground truth: the same step on real gloo processes."""
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    comms, loss = step_comms(mesh, kind)
    assert torch.isfinite(loss)
    return comms


def real_grid() -> dict[str, Any]:
    """The cached mesh grid against what torch's DeviceMesh says, on a real 2D mesh."""
    mesh = ff.make_mesh({"replicate": 1, "dp": dist.get_world_size()})
    rank = dist.get_rank()
    grid = mesh_grid(mesh)
    return {
        "cached": mesh_grid(mesh) is grid,
        "ranks": list(grid.ranks),
        "mesh": mesh.mesh.reshape(-1).tolist(),
        "own": coordinate_of(mesh, rank) == local_coordinate(mesh),
        "round_trip": all(
            rank_at(mesh, coordinate_of(mesh, r)) == r for r in range(dist.get_world_size())
        ),
    }
