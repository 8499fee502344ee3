"""ZeRO-1/2's two collectives between the replicated and the sharded layout (private).

With parameters replicated at rest and the optimizer state sharded (``opt_specs``),
``train_step`` moves 2Ψ per step as DDP does, in two bucketed collectives:

* the gradient's **reduce-scatter** onto the owner of each optimizer shard: per unit during
  the backward for ZeRO-2 (the engine computes with the replicas, see
  :class:`functional_fsdp.fsdp.step_inputs.StepInputs`), once per step over every parameter for
  ZeRO-1 (:func:`reduce_to_shards`);
* the **all-gather** of the updated shards back into replicas (:func:`gather_replicas`).

Both run the engine's own bucketed rounds (:class:`~functional_fsdp.fsdp.units.Unit`) on a
unit made of all the trainable parameters: one collective per data axis and dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..distributed.mesh import axis_sizes
from ..distributed.simulate import is_simulated
from ..resharding import _cut_block, reshard
from ..sharded import Sharded
from ..spec import Layout, P
from .gradients import reduction
from .layout import UnitLayout, gather_dtype, gather_rounds
from .policy import Policy
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
    up = _unit_layout(
        tuple(names),
        tuple(s.layout for s in shards),
        tuple(s.dtype for s in shards),
        tuple(sizes.items()),
        data_axes,
        policy.mixed_precision.param_dtype,
    )
    # No memory trackers: this unit is the step's, not one of the model's.
    ctx = Context.for_call(mesh, sizes, policy, data_axes)
    return Unit(up, ctx, [s.local for s in shards], InFlight())


@functools.lru_cache(maxsize=64)
def _unit_layout(
    names: tuple[str, ...],
    layouts: tuple[Layout, ...],
    dtypes: tuple[torch.dtype, ...],
    sizes: tuple[tuple[str, int], ...],
    data_axes: tuple[str, ...],
    param_dtype: torch.dtype | None,
) -> UnitLayout:
    """The layout of :func:`_unit` (pure data of shapes and dtypes: built once per layout)."""
    gdtypes = [gather_dtype(d, param_dtype) for d in dtypes]
    rounds = gather_rounds(layouts, dict(sizes), data_axes, gdtypes)
    last = [-1] * len(names)
    for r, rnd in enumerate(rounds):
        for p in rnd.pieces:
            last[p.index] = r
    return UnitLayout(
        name="<zero>",
        names=tuple(names),
        aliases=tuple((n,) for n in names),
        layouts=layouts,
        dtypes=dtypes,
        rounds=rounds,
        last_round=tuple(last),
        replicated=tuple(reduction(lay.spec, data_axes).replicated for lay in layouts),
        gathered_bytes=0,
        labels=tuple(
            tuple(
                f"{names[p.index]} {layouts[p.index].global_shape} {layouts[p.index].spec}"
                for p in rnd.pieces
            )
            for rnd in rounds
        ),
    )


def slice_to_shards(replicas: Sequence[Sharded], specs: Sequence[P]) -> list[Sharded]:
    """This rank's blocks of ``replicas`` (replicated over the axes ``specs`` add): local
    copies, no communication. What :func:`~functional_fsdp.reshard` does, without its
    per-value checks (the layouts are the state's own, checked when it was made)."""
    if is_simulated():
        return reshard(list(replicas), list(specs))
    out = []
    for rep, spec in zip(replicas, specs):
        mesh = rep.mesh
        target = spec.padded(len(rep.global_shape))
        if target == rep.spec.padded(len(rep.global_shape)):
            out.append(rep)
            continue
        sub, dims = _sub_layout(tuple(rep.local.shape), target, tuple(axis_sizes(mesh).items()))
        local = _cut_block(rep.local, sub, mesh, dims)
        out.append(Sharded._unchecked(local, rep.global_shape, target, mesh))
    return out


@functools.lru_cache(maxsize=1024)
def _sub_layout(
    shape: tuple[int, ...], spec: P, sizes: tuple[tuple[str, int], ...]
) -> tuple[Layout, list[int]]:
    return Layout.make(shape, spec, dict(sizes)), [d for d in range(len(shape)) if spec.entry(d)]


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
        Sharded._unchecked(
            r.to(s.dtype) if r is not None else torch.zeros_like(s.local),
            s.global_shape,
            s.spec,
            s.mesh,
        )
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
        _, full, _ = unit.gather([s.local for s in shards])
    out = []
    for rep, new in zip(replicas, full):
        if into:
            rep.local.copy_(new)
            out.append(rep)
        else:
            local = new if new.is_contiguous() else new.contiguous()
            out.append(Sharded._unchecked(local, rep.global_shape, rep.spec, rep.mesh))
    return out
