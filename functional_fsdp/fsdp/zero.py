"""ZeRO-1/2's two collectives between the replicated and the sharded layout (private).

With parameters replicated at rest and the optimizer state sharded (``opt_specs``),
``train_step`` moves 2Ψ per step as DDP does, in two bucketed collectives:

* the gradient's **reduce-scatter** onto the owner of each optimizer shard: per unit during
  the backward for ZeRO-2 (the engine computes with the replicas, see
  :func:`functional_fsdp.fsdp.runtime.replicas`), once per step over every parameter for
  ZeRO-1 (:func:`reduce_to_shards`);
* the **all-gather** of the updated shards back into replicas (:func:`gather_replicas`).

Both run the engine's own bucketed rounds (:class:`~functional_fsdp.fsdp.units.Unit`) on a
unit made of all the trainable parameters: one collective per data axis and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dist import collectives as C
from ..dist.mesh import axis_sizes
from ..dist.simulate import is_simulated
from ..sharded import Sharded
from .plan import UnitPlan, gather_dtype, plan_rounds
from .policy import Policy
from .runtime import mesh_device
from .units import Context, InFlight, Unit


def _unit(
    shards: Sequence[Sharded],
    names: Sequence[str],
    data_axes: tuple[str, ...],
    policy: Policy,
) -> Unit:
    """A unit holding ``shards`` (the optimizer layout), gathered over ``data_axes``."""
    mesh = shards[0].mesh
    sizes = axis_sizes(mesh)
    layouts = tuple(s.layout for s in shards)
    dtypes = tuple(s.dtype for s in shards)
    gdtypes = [gather_dtype(d, policy.mixed_precision.param_dtype) for d in dtypes]
    rounds = plan_rounds(layouts, sizes, data_axes, gdtypes)
    last = [-1] * len(shards)
    for r, rnd in enumerate(rounds):
        for p in rnd.pieces:
            last[p.index] = r
    up = UnitPlan(
        name="<zero>",
        names=tuple(names),
        aliases=tuple((n,) for n in names),
        layouts=layouts,
        dtypes=dtypes,
        rounds=rounds,
        last_round=tuple(last),
        replicated=tuple(tuple(a for a in data_axes if a not in lay.spec.axes) for lay in layouts),
        gathered_bytes=0,
        labels=tuple(
            tuple(
                f"{names[p.index]} {layouts[p.index].global_shape} {layouts[p.index].spec}"
                for p in rnd.pieces
            )
            for rnd in rounds
        ),
    )
    ctx = Context(
        mesh=mesh,
        sizes=sizes,
        policy=policy,
        data_axes=data_axes,
        counters=C.active_counters(),
        trackers=(),
        simulated=is_simulated(),
        device=mesh_device(mesh),
    )
    return Unit(up, ctx, [s.local for s in shards], InFlight())


def reduce_to_shards(
    grads: Sequence[Sharded],
    shards: Sequence[Sharded],
    names: Sequence[str],
    data_axes: tuple[str, ...],
    policy: Policy,
) -> list[Sharded]:
    """Full local gradients (``grads``, replicated layout) reduce-scattered onto the layout of
    ``shards``, averaged over the data ranks as the policy says: one bucketed reduce-scatter
    per data axis and dtype (all-reduced over the data axes the shards replicate)."""
    unit = _unit(shards, names, data_axes, policy)
    with torch.no_grad():
        reduced = unit.reduce([g.local for g in grads], [s.dtype for s in shards])
    return [
        s.replace(r.to(s.dtype) if r is not None else torch.zeros_like(s.local))
        for s, r in zip(shards, reduced)
    ]


def gather_replicas(
    shards: Sequence[Sharded],
    replicas: Sequence[Sharded],
    names: Sequence[str],
    data_axes: tuple[str, ...],
    into: bool = False,
) -> list[Sharded]:
    """The updated ``shards`` all-gathered into the layout of ``replicas``: one bucketed
    all-gather per data axis and dtype. ``into``: written into the replicas' buffers."""
    unit = _unit(shards, names, data_axes, Policy())
    with torch.no_grad():
        _, full = unit.gather([s.local for s in shards])
    out = []
    for rep, new in zip(replicas, full):
        if into:
            rep.local.copy_(new)
            out.append(rep)
        else:
            out.append(rep.replace(new if new.is_contiguous() else new.contiguous()))
    return out
