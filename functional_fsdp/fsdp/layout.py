"""A model's FSDP layout: its units, their parameters' layouts, and the gathers that rebuild them.

Everything ``apply`` needs that depends only on the module, mesh and policy. A
:class:`ModelLayout` is pure, immutable data built once by :func:`model_layout` from shapes,
dtypes, specs and unit paths; it holds no tensors but the meta placeholders. ``FSDP.apply``
interprets it together with the call's own state (:mod:`functional_fsdp.fsdp.runtime`).

Per unit (:class:`UnitLayout`) it lists the parameters (every alias of a tied parameter), their
:class:`~functional_fsdp.Layout`, and the bucketed all-gather *rounds* that rebuild them: one
round per data axis that is minor in a dim, bucketed by gather dtype. (Not to be confused with
a tensor-parallel plan, ``ff.tensor_parallel``'s ``{pattern: style}``, or the planner's report,
``ff.plan``.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._buckets import Piece as Piece
from .._buckets import Round as Round
from .._buckets import plan_rounds as _plan_rounds
from ..spec import Layout, P, format_mesh, spec_problem
from .gradients import reduction


@dataclass(frozen=True)
class UnitLayout:
    """A unit's parameters and how to gather them."""

    name: str  # module path ("" for the root unit)
    names: tuple[str, ...]  # parameter names (first alias)
    aliases: tuple[tuple[str, ...], ...]  # every name of each parameter (tied weights)
    layouts: tuple[Layout, ...]
    dtypes: tuple[torch.dtype, ...]  # of the shards
    rounds: tuple[Round, ...]
    last_round: tuple[int, ...]  # per parameter: the round that completes it (-1: none)
    replicated: tuple[tuple[str, ...], ...]  # per parameter: data axes it is replicated over
    gathered_bytes: int  # of the full (padded) parameters, in the gather dtypes
    # Per round, per piece: "name (global shape) spec", what the debug check of
    # ff.check_collectives compares between ranks (built once here, read only when it is on).
    labels: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class ModelLayout:
    """A module's FSDP layout (see the module docstring).

    Attributes:
        units: ``{unit path: UnitLayout}``, the root unit ``""`` first when it holds parameters,
            then every unit in module order (a unit without parameters has no rounds).
        order: the unit paths in module order (the forward prefetch order).
        specs: ``{parameter name: P}`` (first alias of tied parameters).
        expected: ``{parameter name: (global shape, spec padded to the ndim, dtype)}``, what
            ``apply`` checks.
        placeholders: ``{alias: meta tensor}`` standing in for the parameters of units that
            are not gathered (in the compute dtype).
    """

    units: dict[str, UnitLayout]
    order: tuple[str, ...]
    specs: dict[str, P]
    expected: dict[str, tuple[tuple[int, ...], P, torch.dtype]]
    placeholders: dict[str, torch.Tensor]

    @functools.cached_property
    def self_contained(self) -> frozenset[str]:
        """The units whose module tree reads no parameter of another unit: it holds no other
        unit's module, and no weight of another unit (one shared with it) lies in it."""
        foreign = {
            u: [
                a for other, up in self.units.items() if other != u for al in up.aliases for a in al
            ]
            for u in self.order
        }
        return frozenset(
            u
            for u in self.order
            if not any(v.startswith(u + ".") for v in self.order)
            and not any(a.startswith(u + ".") for a in foreign[u])
        )


def gather_rounds(
    layouts: Sequence[Layout],
    sizes: Mapping[str, int],
    data_axes: Sequence[str],
    gather_dtypes: Sequence[torch.dtype],
) -> tuple[Round, ...]:
    """The all-gather rounds that rebuild each parameter from its shard.

    Each round gathers one data axis that is minor in a dim of the parameters it lists (a
    dim split over two data axes takes two rounds), bucketed by gather dtype: the data axes
    each spec shards (the gradient rule's reduce-scatter axes), with the bucketing of
    :func:`functional_fsdp._buckets.plan_rounds` (an axis of size 1 takes no round).
    """
    # The data axes each spec shards: gathered here, reduce-scattered by the gradient rule.
    wanted = [reduction(lay.spec, data_axes).scattered for lay in layouts]
    return _plan_rounds(layouts, sizes, wanted, gather_dtypes)


def unit_of(name: str, units: Sequence[str]) -> str:
    """The innermost unit whose module path contains parameter ``name`` (``""``: the root)."""
    best = ""
    for u in units:
        if name.startswith(u + ".") and len(u) > len(best):
            best = u
    return best


def gather_dtype(dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter is gathered and computed in under a mixed-precision policy."""
    return param_dtype if param_dtype is not None and dtype.is_floating_point else dtype


def model_layout(
    module: nn.Module,
    sizes: Mapping[str, int],
    specs: Mapping[str, P],
    units: Sequence[str],
    data_axes: Sequence[str],
    param_dtype: torch.dtype | None,
) -> ModelLayout:
    """Build the FSDP layout of ``module`` (its parameters may live on any device, ``meta`` too).

    Args:
        module: the module; read for parameter names, shapes, dtypes and tying only.
        sizes: the mesh's ``{axis: size}``.
        specs: ``{parameter name: P}`` for every parameter (first alias).
        units: unit module paths.
        data_axes: the mesh axes that split the batch.
        param_dtype: the gather/compute dtype of floating parameters (``None``: their own).

    Raises:
        ValueError: a spec that does not fit its parameter, or a data axis major to a model
            axis in one dim.
    """
    mesh_str = format_mesh(sizes)
    module_params = dict(module.named_parameters())
    for name, p in module_params.items():
        spec = specs[name]
        problem = spec_problem(tuple(p.shape), spec, sizes)
        if problem:
            raise ValueError(
                f"the spec for parameter {name!r} (shape {tuple(p.shape)}) on {mesh_str}: "
                f"{problem}."
            )
        for dim in range(len(spec)):
            entry = spec.entry(dim)
            data = [a for a in entry if a in data_axes]
            model = [a for a in entry if a not in data_axes]
            if data and model and entry.index(data[0]) < entry.index(model[-1]):
                raise ValueError(
                    f"parameter {name!r} (shape {tuple(p.shape)}, {spec}, {mesh_str}): data "
                    f"axis {data[0]!r} is major to model axis {model[-1]!r} in dim {dim}; "
                    f"gathering it would not give a contiguous block. Put data axes last "
                    f"(minor), e.g. P(('tp', 'dp'))."
                )
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    owner: dict[str, str] = {}
    for name, p in module_params.items():
        owners = {unit_of(n, units) for n in aliases[id(p)]}
        owner[name] = owners.pop() if len(owners) == 1 else ""
    unit_layouts: dict[str, UnitLayout] = {}
    placeholders: dict[str, torch.Tensor] = {}
    expected: dict[str, tuple[tuple[int, ...], P, torch.dtype]] = {}
    for unit in ["", *units]:
        names = tuple(n for n in module_params if owner[n] == unit)
        if not names and unit == "":
            continue
        layouts = tuple(
            Layout.make(
                tuple(module_params[n].shape), specs[n].padded(module_params[n].ndim), sizes
            )
            for n in names
        )
        dtypes = tuple(module_params[n].dtype for n in names)
        gdtypes = [gather_dtype(d, param_dtype) for d in dtypes]
        rounds = gather_rounds(layouts, sizes, data_axes, gdtypes)
        last_round, full_bytes = [-1] * len(names), [0] * len(names)
        for r, rnd in enumerate(rounds):
            for piece in rnd.pieces:
                last_round[piece.index] = r
                full_bytes[piece.index] = math.prod(piece.padded_shape(rnd.size)) * (
                    rnd.dtype.itemsize
                )
        unit_layouts[unit] = UnitLayout(
            name=unit,
            names=names,
            aliases=tuple(tuple(aliases[id(module_params[n])]) for n in names),
            layouts=layouts,
            dtypes=dtypes,
            rounds=rounds,
            last_round=tuple(last_round),
            gathered_bytes=sum(full_bytes),
            replicated=tuple(reduction(specs[n], data_axes).replicated for n in names),
            labels=tuple(
                tuple(
                    f"{names[p.index]} {layouts[p.index].global_shape} {layouts[p.index].spec}"
                    for p in rnd.pieces
                )
                for rnd in rounds
            ),
        )
        for n, lay, gd in zip(names, layouts, gdtypes):
            expected[n] = (lay.global_shape, lay.spec, module_params[n].dtype)
            if unit:
                meta = torch.empty(lay.global_shape, dtype=gd, device="meta")
                for alias in aliases[id(module_params[n])]:
                    placeholders[alias] = meta
    return ModelLayout(
        units=unit_layouts,
        order=tuple(units),
        specs=dict(specs),
        expected=expected,
        placeholders=placeholders,
    )
