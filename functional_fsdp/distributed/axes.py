"""Named mesh axes: reading a ``DeviceMesh`` by axis name, and checking one.

The bottom of the distributed layer: pure reads of a mesh (its axis names and sizes, where
each rank sits, this process's device) and the checks every layer above shares (is it a
mesh, is it still alive, does it have this axis). No collective, no process-group set-up:
that is :mod:`.mesh` (``init_distributed``, ``make_mesh``) and :mod:`.collectives`.

Code names mesh axes and never indexes them: ``axis_size(mesh, "dp")``, not ``mesh.size(0)``.
"""

from __future__ import annotations

import contextlib
import enum
import operator
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..spec import P, did_you_mean, format_mesh


class Axis(str, enum.Enum):
    """Conventional mesh-axis names. Any string works; these keep scripts consistent.

    Example:
        >>> from functional_fsdp import P
        >>> P(Axis.TP, Axis.DP)
        P('tp', 'dp')
    """

    DP = "dp"
    """Data parallel: shards parameters (FSDP) or replicates them (DDP)."""
    TP = "tp"
    """Tensor (model) parallel: splits layers; gradients need no data reduction over it."""
    REPLICATE = "replicate"
    """The replicated data axis of hybrid sharding (HSDP)."""
    SHARD = "shard"
    """The sharded data axis of hybrid sharding (HSDP)."""
    CP = "cp"
    """Context parallel: a data axis that splits each sequence (dim 1) instead of the batch."""

    def __str__(self) -> str:
        return self.value


def check_mesh(mesh: Any, where: str) -> None:
    """Raise a ``TypeError`` naming ``where`` if ``mesh`` is not a ``DeviceMesh``, and a
    ``ValueError`` if it is the mesh of a simulation that has ended."""
    if not isinstance(mesh, DeviceMesh):
        if hasattr(mesh, "__enter__"):  # e.g. ff.simulated_mesh(...) itself: it says how to use it
            getattr(mesh, "mesh_dim_names")  # noqa: B009

        swapped = " (the arguments look swapped)" if isinstance(mesh, P) else ""
        raise TypeError(
            f"{where} takes a DeviceMesh with named axes, got {mesh!r} "
            f"({type(mesh).__name__}){swapped}. Build one with ff.make_mesh({{'dp': N}}) "
            f"(or ff.simulated_mesh in a notebook)."
        )
    check_alive(mesh, where)  # a simulated mesh must still be running


def describe_mesh(mesh: DeviceMesh) -> str:
    """``Mesh(dp=2) over ranks [1, 0]``: the sizes and the rank layout, for error messages.

    Two meshes with the same sizes can hold the ranks in another order; the ranks tell them
    apart.
    """
    with torch._C._DisableFuncTorch():
        grid: Any = mesh.mesh
        per_rank = getattr(grid, "_local_tensors", None)  # simulated: the same everywhere
        if per_rank is not None:
            grid = next(iter(per_rank.values()))
        ranks = grid.tolist()
    return f"{format_mesh(axis_sizes(mesh))} over ranks {ranks}"


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's axis names, major to minor."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"this DeviceMesh (shape {tuple(mesh.shape)}) has no axis names; build it with "
            f"make_mesh({{'dp': ...}}) or init_device_mesh(..., mesh_dim_names=...)"
        )
    return tuple(names)


def axis_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """``{axis name: size}`` in mesh order.

    Example:
        >>> axis_sizes(make_mesh({"dp": 1}))  # doctest: +SKIP
        {'dp': 1}
    """
    return dict(zip(axis_names(mesh), (int(s) for s in mesh.shape)))


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """The size of one named axis.

    Raises:
        ValueError: if the mesh has no such axis (the message suggests the closest name).

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2, "tp": 4}) as mesh:
        ...     ff.axis_size(mesh, "tp")
        4
    """
    check_axes(mesh, (axis,), "axis_size")
    return axis_sizes(mesh)[axis]


def local_coordinate(mesh: DeviceMesh) -> dict[str, int]:
    """This process's mesh coordinate by axis name, from the mesh's cached Python ints.

    Unlike ``coordinate_of(mesh, dist.get_rank())`` it reads no tensor. Real processes only:
    on a simulated mesh every rank lives in one process (use ``per_coordinate``).

    Example:
        >>> local_coordinate(make_mesh({"dp": 1}))  # doctest: +SKIP
        {'dp': 0}
    """
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the mesh {format_mesh(axis_sizes(mesh))}; call "
            f"this only on ranks of the mesh."
        )
    return dict(zip(axis_names(mesh), (int(c) for c in coord)))


class MeshGrid:
    """Where every rank of a mesh sits, as Python ints, computed once per mesh.

    Attributes:
        names: the axis names, major to minor.
        shape: the axis sizes.
        ranks: the global ranks in row-major coordinate order.
    """

    __slots__ = ("_coords", "_index", "names", "ranks", "shape")

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...], ranks: tuple[int, ...]):
        self.names, self.shape, self.ranks = names, shape, ranks
        self._index = {r: i for i, r in enumerate(ranks)}
        self._coords: dict[int, dict[str, int]] = {}

    def coordinate(self, rank: int) -> dict[str, int]:
        """The coordinate of a global rank by axis name (a new dict each call)."""
        coord = self._coords.get(rank)
        if coord is None:
            index = self._index.get(rank)
            if index is None:
                raise ValueError(
                    f"rank {rank} is not in the mesh {format_mesh(dict(zip(self.names, self.shape)))} "
                    f"of ranks {list(self.ranks)}"
                )
            values = []
            for size in reversed(self.shape):
                values.append(index % size)
                index //= size
            coord = self._coords[rank] = dict(zip(self.names, reversed(values)))
        return dict(coord)

    def rank(self, coord: Mapping[str, int]) -> int:
        """The global rank at a coordinate given by axis name."""
        index = 0
        for name, size in zip(self.names, self.shape):
            index = index * size + coord[name]
        return self.ranks[index]


# Keyed by the mesh's identity, not its equality: two equal meshes (the same names and ranks,
# made by two tests in one worker) would share one WeakKeyDictionary entry, which goes when
# the first of them dies, and the living one would then be read again, inside a trace.
_GRIDS: dict[int, tuple[weakref.ref[DeviceMesh], MeshGrid]] = {}


def mesh_grid(mesh: DeviceMesh) -> MeshGrid:
    """The mesh's :class:`MeshGrid`, computed on first use and cached with the mesh.

    Reading ``mesh.mesh`` builds a tensor; on a simulated mesh every op on it runs once per
    rank, so reading it per parameter and rank cost O(ranks²) each. The grid is read once,
    outside any ``torch.func`` transform and outside the simulation.
    """
    entry = _GRIDS.get(id(mesh))
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    grid = _read_grid(mesh)
    key = id(mesh)

    def forget(ref: weakref.ref[DeviceMesh]) -> None:
        if _GRIDS.get(key, (None,))[0] is ref:
            del _GRIDS[key]

    _GRIDS[key] = (weakref.ref(mesh, forget), grid)
    return grid


def _read_grid(mesh: DeviceMesh) -> MeshGrid:
    names = axis_names(mesh)
    with torch._C._DisableFuncTorch(), _simulation_paused():
        tensor = mesh.mesh
        per_rank = getattr(tensor, "_local_tensors", None)  # the same on every simulated rank
        if per_rank is not None:
            tensor = next(iter(per_rank.values()))
        shape = tuple(int(s) for s in tensor.shape)
        ranks = tuple(int(r) for r in tensor.reshape(-1).tolist())
    return MeshGrid(names, shape, ranks)


def _simulation_paused() -> contextlib.AbstractContextManager[None]:
    """Switch a simulation's ``LocalTensorMode`` off (its factories make per-rank tensors)."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # pragma: no cover - depends on the torch build
        return contextlib.nullcontext()
    mode = enabled_local_tensor_mode()
    return mode.disable() if mode is not None else contextlib.nullcontext()


def coordinate_of(mesh: DeviceMesh, rank: int) -> dict[str, int]:
    """The mesh coordinate of a global rank, by axis name.

    Reads the mesh's cached :class:`MeshGrid`, so it costs a dict look-up and works inside
    ``torch.func`` transforms and simulations alike.
    """
    return mesh_grid(mesh).coordinate(rank)


def rank_at(mesh: DeviceMesh, coord: Mapping[str, int]) -> int:
    """The global rank at a mesh coordinate given by axis name (the cached grid's)."""
    return mesh_grid(mesh).rank(coord)


def checked_axes(axes: Any, where: str, example_size: str = "2") -> dict[str, int]:
    """``axes`` checked: a non-empty mapping of non-empty string names to positive int sizes.

    The one check of the ``{axis name: size}`` argument of :func:`~.mesh.make_mesh` and
    :func:`~.simulate.simulated_mesh`; ``where`` names the caller in the messages.

    Example:
        >>> checked_axes({"dp": 2, "tp": 1}, "make_mesh")
        {'dp': 2, 'tp': 1}
        >>> checked_axes({"dp": 0}, "make_mesh")
        Traceback (most recent call last):
        ...
        ValueError: make_mesh({'dp': 0}): mesh axis sizes must be positive integers, but 'dp' has size 0. Give every axis a size >= 1 (an axis of size 1 is allowed), with a product equal to the number of ranks.
    """
    if not isinstance(axes, Mapping):
        example = "{'dp': 2, 'tp': 2}"
        if isinstance(axes, (list, tuple)) and axes and all(isinstance(a, str) for a in axes):
            example = "{" + ", ".join(f"{a!r}: <size>" for a in axes) + "}"
        raise TypeError(
            f"{where} takes a dict {{axis name: size}}, got {axes!r} ({type(axes).__name__}). "
            f"Give every axis its size, e.g. {where}({example})."
        )
    if not axes:
        raise ValueError(
            f"{where}({{}}) has no axes; name at least one, e.g. {where}({{'dp': {example_size}}})."
        )
    out: dict[str, int] = {}
    for name, size in axes.items():
        if not isinstance(name, str):
            raise TypeError(
                f"{where}({dict(axes)!r}): mesh axis names must be strings, but {name!r} is "
                f"not ({type(name).__name__}). Name axes with strings, e.g. {{'dp': {size!r}}} "
                f"(ff.Axis.DP, ff.Axis.TP, ... are strings too)."
            )
        if not name:
            raise TypeError(
                f"{where}({dict(axes)!r}): a mesh axis name is the empty string; name every "
                f"axis, e.g. {{'dp': {size!r}}}."
            )
        try:
            if isinstance(size, bool):
                raise TypeError
            value = operator.index(size)  # ints, numpy and 0-dim torch ints; never 1.7 -> 1
        except TypeError:
            raise TypeError(
                f"{where}({dict(axes)!r}): mesh axis {name!r} has size {size!r} "
                f"({type(size).__name__}); sizes must be integers, e.g. {{{name!r}: 2}}. "
                f"A size is never rounded."
            ) from None
        if value < 1:
            raise ValueError(
                f"{where}({dict(axes)!r}): mesh axis sizes must be positive integers, but "
                f"{name!r} has size {value}. Give every axis a size >= 1 (an axis of size 1 "
                f"is allowed), with a product equal to the number of ranks."
            )
        out[str.__str__(name)] = value
    return out


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device the mesh computes on (this process's current GPU for a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def check_axes(
    mesh: DeviceMesh | Mapping[str, int], axes: Iterable[str], what: str, hint: str = ""
) -> None:
    """Raise ``ValueError`` unless every name in ``axes`` is an axis of ``mesh`` (a mesh, or
    its ``{axis: size}``): the one check of an axis name, wherever one is given.

    The message starts with ``what`` (the caller and the axis it was given), names the mesh,
    suggests the closest axis name, and ends with ``hint`` (what to pass instead) or, without
    one, the mesh's axes.

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     check_axes(mesh, ["pd"], "all_gather over 'pd'")
        Traceback (most recent call last):
        ...
        ValueError: all_gather over 'pd': the mesh Mesh(dp=2) has no axis 'pd' (did you mean 'dp'?); name one of its axes ('dp',).
    """
    sizes = dict(mesh) if isinstance(mesh, Mapping) else axis_sizes(mesh)
    for axis in axes:
        if axis not in sizes:
            raise ValueError(
                f"{what}: the mesh {format_mesh(sizes)} has no axis {axis!r}"
                f"{did_you_mean(axis, sizes)}; {hint or f'name one of its axes {tuple(sizes)}'}."
            )


def data_axes_of(
    mesh: DeviceMesh | Mapping[str, int],
    data_axes: str | Iterable[str] | None,
    where: str,
    *,
    model_axes: Iterable[str] = (Axis.TP.value,),
    hint: str = "",
) -> tuple[str, ...]:
    """The mesh axes that split the batch (and over which gradients are reduced).

    ``data_axes`` as given (a name or names), checked against the mesh; by default every
    axis of the mesh but the model-parallel ones (``"tp"``), whose ranks share a batch. The
    one place this default is written: ``ff.fsdp``, ``ff.local_batch`` and ``ff.plan`` ask it.
    ``hint`` is added to the error's advice.

    Example:
        >>> data_axes_of({"dp": 2, "tp": 2}, None, "ff.fsdp")
        ('dp',)
        >>> data_axes_of({"dp": 2}, "pd", "ff.fsdp")
        Traceback (most recent call last):
        ...
        ValueError: ff.fsdp(data_axes=('pd',)): the mesh Mesh(dp=2) has no axis 'pd' (did you mean 'dp'?); name the mesh axes that split the batch, some of ('dp',).
    """
    sizes = dict(mesh) if isinstance(mesh, Mapping) else axis_sizes(mesh)
    if data_axes is None:
        skip = set(model_axes)
        return tuple(a for a in sizes if a not in skip)
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    check_axes(
        sizes,
        axes,
        f"{where}(data_axes={axes})",
        f"name the mesh axes that split the batch, some of {tuple(sizes)}{hint}",
    )
    return axes


def sequence_axis_of(
    mesh: DeviceMesh | Mapping[str, int],
    data_axes: tuple[str, ...],
    sequence_axis: str | bool | None,
    where: str,
) -> str | None:
    """The data axis that splits each sequence (context parallelism), or ``None``.

    ``sequence_axis`` as given, checked to be one of ``data_axes``; by default (``True``)
    ``"cp"`` when it is a data axis of the mesh. ``None`` or ``False``: no axis splits the
    sequence.

    Example:
        >>> sequence_axis_of({"dp": 2, "cp": 2}, ("dp", "cp"), True, "ff.fsdp")
        'cp'
        >>> sequence_axis_of({"dp": 2}, ("dp",), True, "ff.fsdp") is None
        True
    """
    if sequence_axis is True:
        return Axis.CP.value if Axis.CP.value in data_axes else None
    if sequence_axis is None or sequence_axis is False:
        return None
    if sequence_axis not in data_axes:
        sizes = dict(mesh) if isinstance(mesh, Mapping) else axis_sizes(mesh)
        raise ValueError(
            f"{where}(sequence_axis={sequence_axis!r}): the axis that splits the sequence must "
            f"be one of the data axes {data_axes} of {format_mesh(sizes)} (its ranks hold "
            f"different tokens, so gradients are reduced over it); name one of them, or add "
            f"it to data_axes."
        )
    return sequence_axis


def same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether two values' meshes are one: the same object, or equal (the same ranks in the
    same order, the same axis names). Meshes of the same sizes over other ranks differ."""
    return a is b or a == b


# --------------------------------------------------------------------------- simulations that ended


class _MeshMarks:
    """A value per mesh object, by identity: meshes of two simulations compare equal."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[weakref.ref[DeviceMesh], Any]] = {}

    def mark(self, mesh: DeviceMesh, value: Any) -> None:
        key = id(mesh)
        self._marks[key] = (weakref.ref(mesh), value)
        weakref.finalize(mesh, self._marks.pop, key, None)

    def get(self, mesh: DeviceMesh) -> Any:
        entry = self._marks.get(id(mesh))
        return entry[1] if entry is not None and entry[0]() is mesh else None


_ENDED = _MeshMarks()  # meshes of simulations that have ended: the call that made them


_ENDED = _MeshMarks()  # meshes of simulations that have ended: the call that made them


def check_alive(mesh: DeviceMesh, what: str) -> None:
    """Refuse a mesh whose simulation has ended, naming the fix."""
    call = _ENDED.get(mesh)
    if call is not None:
        raise ValueError(_ended_message(call, format_mesh(_sizes(mesh)), what))


def _ended_message(call: str, mesh: str, what: str) -> str:
    return (
        f"{what}: the value's mesh {mesh} belonged to {call}, which has ended (its process "
        f"group is gone). Values live only as long as their simulation: keep the mesh alive "
        f"with `mesh = ff.simulated_mesh(..., persistent=True)` (ended by "
        f"ff.end_simulation()), or create and use the values inside one `with "
        f"ff.simulated_mesh(...) as mesh:` block."
    )


def _sizes(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), (int(s) for s in mesh.shape)))
