"""hpZ, a secondary shard within the node (``Policy(reshard_after_forward=axis)``): a step
on a ``{"node": 2, "gpu": 2}`` mesh with and without it, and FSDP2's integer
``reshard_after_forward`` on the same model and batch. Runs in a simulated mesh or on gloo
ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import lm_loss

from . import _qgather_workers as W

AXES = {"node": 2, "gpu": 2}


def step(mesh: Any, policy: ff.Policy, specs: Any = None) -> dict[str, Any]:
    """One SGD(1) step of the small GPT: its loss, gradients and collectives per axis."""
    return W.step(mesh, W.model(), W.data(), policy=policy, specs=specs)


def compare(mesh: Any) -> dict[str, Any]:
    """hpZ over ``gpu``, and plain FSDP on the same specs (``gpu`` major: the default under
    hpZ) and on the default ones."""
    return {
        "hpz": step(mesh, ff.Policy(reshard_after_forward="gpu")),
        "fsdp": step(mesh, ff.Policy(), specs=ff.P(("gpu", "node"))),
        "default": step(mesh, ff.Policy()),
    }


def fsdp2(reshard: int | bool) -> dict[str, Any]:
    """FSDP2's ``fully_shard(reshard_after_forward=reshard)`` on the same model and batch,
    over all ranks: its loss and full gradients."""
    from torch.distributed.fsdp import fully_shard

    m, batch = W.model(), W.data()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    ref = copy.deepcopy(m)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(ref, mesh=mesh, reshard_after_forward=reshard)
    x, y = ff.local_batch((batch[:, :-1], batch[:, 1:]), mesh, ("dp",))
    loss = lm_loss(ref(x), y)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {
        "loss": float(total) / dist.get_world_size(),
        "grads": {n: p.grad.full_tensor() for n, p in ref.named_parameters()},
    }


def on_ranks() -> dict[str, Any]:
    mesh = ff.make_mesh(AXES)
    out = compare(mesh)
    out["fsdp2"] = fsdp2(2)
    out["peaks"] = peaks()
    dist.barrier()
    return out


def planned(policy: ff.Policy, specs: Any) -> dict[tuple[str, str], int]:
    """The bytes per (collective, axis) that ff.plan prices for :func:`step`."""
    report = ff.plan(
        W.model(), AXES, policy=policy, specs=specs, batch=W.data(), optimizer=ff.sgd(1.0)
    )
    out: dict[tuple[str, str], int] = {}
    for c in report.comms:
        out[c.kind, c.axis] = out.get((c.kind, c.axis), 0) + c.bytes
    return out


def peaks(repeats: int = 3) -> dict[str, int]:
    """The least tensor peak (``ff.tensor_peak``) of ``repeats`` SGD steps of the small GPT
    with hpZ over ``gpu`` and with plain FSDP on the same specs, on this rank's mesh."""
    mesh = ff.make_mesh(AXES)
    batch, opt, out = W.data(), ff.sgd(1.0), {}
    for name, policy in (("hpz", ff.Policy(reshard_after_forward="gpu")), ("fsdp", ff.Policy())):
        sharded = ff.fsdp(W.model(), mesh, policy=policy, specs=ff.P(("gpu", "node")))
        train = ff.train_step(
            lambda p, b, s=sharded: lm_loss(s.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sharded
        )
        state = {"state": ff.TrainState.create(sharded.shard(), opt)}

        def run(train: Any = train, state: dict[str, Any] = state) -> None:
            state["state"], _ = train(state["state"], batch)

        run()  # warm-up: the first call builds caches and groups
        out[name] = min(ff.tensor_peak(run).added_bytes for _ in range(repeats))
    return out


def planned_peak(policy: ff.Policy, specs: Any = None) -> int:
    """The gathered-parameter peak ff.plan prices for :func:`peaks`' step."""
    report = ff.plan(W.model(), AXES, policy=policy, specs=specs, optimizer=ff.sgd(1.0))
    return report.gathered_peak_bytes


def intermediate_bytes(unit: str) -> int:
    """The bytes of ``unit``'s parameters gathered over ``node`` only (dim 0 split in
    ``gpu * node`` chunks of ``ceil(rows / 4)`` rows, ``node`` of them): what a gather over
    "node" then "gpu" holds between its two rounds."""
    chunk = AXES["gpu"] * AXES["node"]
    return sum(
        AXES["node"] * -(-p.shape[0] // chunk) * p[0].numel() * p.element_size()
        for n, p in W.model().named_parameters()
        if n.startswith(unit + ".")
    )
