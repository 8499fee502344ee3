"""``Sharded``: a local shard plus its global shape, spec and mesh.

A ``Sharded`` is registered with optree under the library's namespace, and with
``torch.utils._pytree`` (which ``torch.func`` uses), as a node whose only child is the local
tensor. So ``tree_map`` over a tree of ``Sharded`` maps over local shards, and
``torch.func.grad(loss)(tree_of_sharded)`` returns a tree of ``Sharded`` gradients. The layout
is static auxiliary data.

The local tensor is the coordinate's padded block (see :mod:`functional_fsdp.spec`): every
rank holds the same shape, and padding is kept at zero. Padding never appears in a gathered
value or in :meth:`Sharded.to_dtensor`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.device_mesh import DeviceMesh

from ._tree import NAMESPACE
from .mesh import axis_names, axis_sizes
from .spec import Layout, P, format_mesh


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], spec: P, sizes: tuple[tuple[str, int], ...]) -> Layout:
    return Layout.make(shape, spec, dict(sizes))


class Sharded:
    """A DTensor-like value: this rank's padded local block of a global tensor.

    Attributes:
        local: this rank's block, of shape ``layout.local_shape`` (the same on every rank).
        global_shape: the shape of the full tensor.
        spec: how the dims are split over mesh axes.
        mesh: the named ``DeviceMesh``.

    Build one with :func:`functional_fsdp.shard` rather than by hand.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = ff.shard(torch.zeros(5, 3), mesh, ff.P("dp"))
        ...     print(w)
        Sharded(shape=(5, 3), dtype=torch.float32, spec=P('dp'), mesh=Mesh(dp=2), local=(3, 3))
    """

    __slots__ = ("global_shape", "local", "mesh", "spec")
    local: torch.Tensor
    global_shape: tuple[int, ...]
    spec: P
    mesh: DeviceMesh

    def __init__(
        self, local: torch.Tensor, global_shape: tuple[int, ...], spec: P, mesh: DeviceMesh
    ) -> None:
        global_shape = tuple(int(s) for s in global_shape)
        if not isinstance(spec, P):
            raise TypeError(
                f"Sharded needs a P spec, got {spec!r} ({type(spec).__name__}); write "
                f"P('dp', None) rather than a tuple."
            )
        problem = local_shape_problem(tuple(local.shape), global_shape, spec, mesh)
        if problem:
            raise ValueError(problem)
        self.local = local
        self.global_shape = global_shape
        self.spec = spec.padded(len(global_shape))
        self.mesh = mesh

    @classmethod
    def _unchecked(
        cls, local: Any, global_shape: tuple[int, ...], spec: P, mesh: DeviceMesh
    ) -> Sharded:
        obj = object.__new__(cls)
        obj.local, obj.global_shape, obj.spec, obj.mesh = local, global_shape, spec, mesh
        return obj

    def replace(self, local: torch.Tensor) -> Sharded:
        """The same layout with another local block (its shape must match)."""
        return Sharded(local, self.global_shape, self.spec, self.mesh)

    @property
    def layout(self) -> Layout:
        return _layout(self.global_shape, self.spec, _sizes_key(self.mesh))

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return torch.Size(self.global_shape)

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def numel(self) -> int:
        """Elements of the global tensor."""
        return math.prod(self.global_shape)

    def __repr__(self) -> str:
        local = getattr(self.local, "shape", self.local)
        local_str = tuple(local) if isinstance(local, torch.Size) else repr(local)
        return (
            f"Sharded(shape={self.global_shape}, dtype={getattr(self.local, 'dtype', None)}, "
            f"spec={self.spec.trimmed()}, mesh={format_mesh(axis_sizes(self.mesh))}, "
            f"local={local_str})"
        )

    def to_dtensor(self) -> torch.distributed.tensor.DTensor:
        """Convert to a ``DTensor`` (lossless; padding is dropped).

        A dim split over axes in mesh order uses ``Shard``; a dim split over two axes against
        mesh order (FSDP on top of TP) uses torch's ``_StridedShard``.
        """
        return _to_dtensor(self)

    @staticmethod
    def from_dtensor(dtensor: torch.distributed.tensor.DTensor) -> Sharded:
        """Convert a ``DTensor`` with ``Shard``/``_StridedShard``/``Replicate`` placements."""
        return _from_dtensor(dtensor)


def _sizes_key(mesh: DeviceMesh) -> tuple[tuple[str, int], ...]:
    return tuple(axis_sizes(mesh).items())


def local_shape_problem(
    local_shape: tuple[int, ...], global_shape: tuple[int, ...], spec: P, mesh: DeviceMesh
) -> str | None:
    """Why a local block of ``local_shape`` cannot belong to this layout, or ``None``."""
    layout = _layout(global_shape, spec.padded(len(global_shape)), _sizes_key(mesh))
    if tuple(local_shape) == layout.local_shape:
        return None
    return (
        f"Sharded local shape {tuple(local_shape)} contradicts its layout: global shape "
        f"{global_shape} with {spec.trimmed()} on {format_mesh(axis_sizes(mesh))} has padded "
        f"local blocks of shape {layout.local_shape}. Build Sharded values with "
        f"ff.shard(full_tensor, mesh, spec), or pass the padded block; a function mapped over "
        f"local shards must keep their shape."
    )


def _flatten(s: Sharded) -> tuple[tuple[Any], tuple[Any, ...], tuple[str]]:
    return (s.local,), (s.global_shape, s.spec, s.mesh), ("local",)


def _unflatten(aux: tuple[Any, ...], children: tuple[Any, ...]) -> Sharded:
    return Sharded._unchecked(children[0], *aux)


optree.register_pytree_node(Sharded, _flatten, _unflatten, namespace=NAMESPACE)
torch_pytree.register_pytree_node(
    Sharded,
    lambda s: ([s.local], (s.global_shape, s.spec, s.mesh)),
    lambda children, aux: Sharded._unchecked(children[0], *aux),
    serialized_type_name="functional_fsdp.Sharded",
    flatten_with_keys_fn=lambda s: (
        [(torch_pytree.GetAttrKey("local"), s.local)],
        (s.global_shape, s.spec, s.mesh),
    ),
)


def unpad(local: torch.Tensor, layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    """The real (unpadded) part of a coordinate's block, as a view."""
    _, pads = layout.owned(coord)
    out = local
    for dim, pad in enumerate(pads):
        if pad:
            out = out.narrow(dim, 0, out.shape[dim] - pad)
    return out


def block_of(full: torch.Tensor, layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    """A coordinate's padded block cut from the full tensor (a new tensor)."""
    slices, pads = layout.owned(coord)
    piece = full[slices]
    if any(pads):
        padding: list[int] = []
        for pad in reversed(pads):
            padding += [0, pad]
        return torch.nn.functional.pad(piece, padding)
    return piece.clone()


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


def _to_dtensor(s: Sharded) -> torch.distributed.tensor.DTensor:
    from torch.distributed.tensor import DTensor

    from .simulate import per_coordinate

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

    from .sharding import gather
    from .simulate import per_coordinate

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
    from .simulate import on_rank

    rank = int(mesh.mesh[tuple(coord[a] for a in axis_names(mesh))])
    return on_rank(t, rank)


def _from_dtensor(dt: torch.distributed.tensor.DTensor) -> Sharded:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from .simulate import per_coordinate

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
        from .sharding import reshard

        multi = {d for d, e in enumerate(entries) if len(e) > 1}
        replicated = [
            Replicate() if isinstance(p, (Shard, _StridedShard)) and p.dim in multi else p
            for p in dt.placements
        ]
        return reshard(_from_dtensor(dt.redistribute(dt.device_mesh, replicated)), spec)
    local_real = dt.to_local()

    def padded(coord: dict[str, int]) -> torch.Tensor:
        piece = _rank_local(local_real, mesh, coord)
        _, pads = layout.owned(coord)
        padding: list[int] = []
        for pad in reversed(pads):
            padding += [0, pad]
        return torch.nn.functional.pad(piece, padding) if any(pads) else piece

    return Sharded(per_coordinate(mesh, padded), shape, spec, mesh)
