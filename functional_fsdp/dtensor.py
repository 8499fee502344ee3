"""Lossless conversion between :class:`~functional_fsdp.Sharded` and torch's ``DTensor``.

A spec maps onto DTensor placements: ``Shard(dim)`` per axis of a dim's entry in mesh order,
and ``_StridedShard`` for a two-axis entry in the other order (``P(("tp", "dp"))`` on a
``(dp, tp)`` mesh). Where DTensor's split of uneven multi-axis dims differs from this
library's padded blocks, rows are moved (gather, cut, reshard) so the result stays exact.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .distributed.mesh import axis_names, axis_sizes, rank_at
from .distributed.simulate import on_rank, per_coordinate
from .resharding import gather, reshard
from .sharded import Sharded, _layout, _sizes_key, provide, unpad
from .spec import Layout, P


def _placements(s: Sharded) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    names = axis_names(s.mesh)
    sizes = axis_sizes(s.mesh)
    placements: list[Any] = [Replicate() for _ in names]
    for dim in range(s.ndim):
        entry = s.spec.entry(dim)
        order = sorted(entry, key=names.index)
        if list(order) == list(entry):
            for axis in entry:
                placements[names.index(axis)] = Shard(dim)
        elif len(entry) == 2:
            major, minor = entry
            placements[names.index(minor)] = _StridedShard(dim, split_factor=sizes[major])
            placements[names.index(major)] = Shard(dim)
        else:
            raise NotImplementedError(
                f"to_dtensor: dim {dim} of {s.spec} splits over {len(entry)} axes in an order "
                f"other than the mesh's {names}; DTensor can express this only for two axes. "
                f"reshard to a spec whose tuples follow mesh order first."
            )
    return placements


def _dtensor_mismatch(layout: Layout, mesh: DeviceMesh, placements: tuple[Any, ...]) -> str | None:
    """Where DTensor's ``placements`` lay out a tensor differently from ``layout``, or ``None``.

    Both split a dim over several axes level by level, but this library splits each level's
    padded block (``ceil(n/s1)``, then ``ceil(ceil(n/s1)/s2)``) while DTensor splits the real
    rows a coordinate holds at each level. For some uneven sizes the two disagree, e.g. 5 rows
    over ``("dp", "tp")`` on a 2x2 mesh: this library gives rows ``[0:2], [2:3], [3:5], []``,
    DTensor ``[0:2], [2:3], [3:4], [4:5]``.
    """
    return _dtensor_mismatch_cached(layout, _sizes_key(mesh), placements)


@functools.lru_cache(maxsize=1024)
def _dtensor_mismatch_cached(
    layout: Layout, sizes: tuple[tuple[str, int], ...], placements: tuple[Any, ...]
) -> str | None:
    import itertools

    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    names = [a for a, _ in sizes]
    shape = [n for _, n in sizes]
    for coord in itertools.product(*(range(n) for n in shape)):
        theirs_shape, theirs_offset = _compute_local_shape_and_global_offset(
            layout.global_shape, shape, list(coord), list(placements)
        )
        named = dict(zip(names, coord))
        slices, _ = layout.owned(named)
        for dim, sl in enumerate(slices):
            ours = sl.stop - sl.start
            theirs = int(theirs_shape[dim])
            if ours != theirs or (ours and sl.start != int(theirs_offset[dim])):
                start = int(theirs_offset[dim])
                return (
                    f"at mesh coordinate {named}, dim {dim} holds indices [{sl.start}:{sl.stop}] "
                    f"here but [{start}:{start + theirs}] under DTensor's placements "
                    f"{list(placements)}"
                )
    return None


def to_dtensor(s: Sharded) -> torch.distributed.tensor.DTensor:
    from torch.distributed.tensor import DTensor

    layout = s.layout
    placements = _placements(s)
    stride = torch.empty(s.global_shape, device="meta").stride()
    if _dtensor_mismatch(layout, s.mesh, tuple(placements)):
        local = _dtensor_local_via_gather(s, placements)
    else:
        local = per_coordinate(s.mesh, lambda c: unpad(_rank_local(s.local, s.mesh, c), layout, c))
    return DTensor.from_local(
        local, s.mesh, placements, run_check=False, shape=s.shape, stride=stride
    )


def _multi_axis_dims(s: Sharded) -> list[int]:
    return [d for d in range(s.ndim) if len(s.spec.entry(d)) > 1]


def _dtensor_local_via_gather(s: Sharded, placements: list[Any]) -> torch.Tensor:
    """DTensor's local piece when its row split differs from ours (uneven multi-axis dims).

    The dims split over several axes are gathered (one all-gather per axis), then each rank
    cuts DTensor's own chunk; the other dims already agree.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    dims = _multi_axis_dims(s)
    axes = [a for d in dims for a in s.spec.entry(d)]
    part = gather(s, axes)
    part_local = part.local if isinstance(part, Sharded) else part
    part_layout = (
        part.layout
        if isinstance(part, Sharded)
        else _layout(s.global_shape, P().padded(s.ndim), _sizes_key(s.mesh))
    )
    names = axis_names(s.mesh)
    shape = [int(n) for n in s.mesh.shape]

    def piece(coord: dict[str, int]) -> torch.Tensor:
        out = unpad(_rank_local(part_local, s.mesh, coord), part_layout, coord)
        sizes, offsets = _compute_local_shape_and_global_offset(
            s.global_shape, shape, [coord[a] for a in names], placements
        )
        for d in dims:
            out = out.narrow(d, int(offsets[d]), int(sizes[d]))
        return out.clone()

    return per_coordinate(s.mesh, piece)


def _rank_local(t: torch.Tensor, mesh: DeviceMesh, coord: dict[str, int]) -> torch.Tensor:
    # No is_simulated() test: per_coordinate calls this with the simulation switched off.
    return on_rank(t, rank_at(mesh, coord))  # the cached grid: no mesh tensor per rank


def from_dtensor(dt: torch.distributed.tensor.DTensor) -> Sharded:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = dt.device_mesh
    names = axis_names(mesh)
    entries: list[list[str]] = [[] for _ in range(dt.ndim)]
    strided: list[tuple[int, str]] = []
    for axis, placement in zip(names, dt.placements):
        if isinstance(placement, _StridedShard):
            strided.append((placement.dim, axis))
        elif isinstance(placement, Shard):
            entries[placement.dim].append(axis)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"from_dtensor: placement {placement} on mesh axis {axis!r} is not supported; "
                f"redistribute the DTensor to Shard/Replicate placements first "
                f"(e.g. dt.redistribute(placements=[Replicate()]*mesh.ndim))."
            )
    for dim, axis in strided:
        entries[dim].append(axis)  # the strided axis is minor to the later Shard axes
    spec = P(*(tuple(e) for e in entries))
    shape = tuple(dt.shape)
    layout = _layout(shape, spec.padded(len(shape)), _sizes_key(mesh))
    if _dtensor_mismatch(layout, mesh, tuple(dt.placements)):
        # DTensor splits these dims' real rows, we split padded blocks: replicate the
        # multi-axis dims (DTensor's redistribute), convert, then cut our blocks locally.
        multi = {d for d, e in enumerate(entries) if len(e) > 1}
        replicated = [
            Replicate() if isinstance(p, (Shard, _StridedShard)) and p.dim in multi else p
            for p in dt.placements
        ]
        return reshard(from_dtensor(dt.redistribute(dt.device_mesh, replicated)), spec)
    local_real = dt.to_local()

    def padded(coord: dict[str, int]) -> torch.Tensor:
        piece = _rank_local(local_real, mesh, coord)
        _, pads = layout.owned(coord)
        padding: list[int] = []
        for pad in reversed(pads):
            padding += [0, pad]
        return torch.nn.functional.pad(piece, padding) if any(pads) else piece

    return Sharded(per_coordinate(mesh, padded), shape, spec, mesh)


provide("to_dtensor", to_dtensor)
provide("from_dtensor", from_dtensor)
