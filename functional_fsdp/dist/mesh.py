"""Processes and named device meshes.

Code names mesh axes and never indexes them: ``axis_size(mesh, "dp")``, not ``mesh.size(0)``.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import math
import os
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..spec import format_mesh


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

    def __str__(self) -> str:
        return self.value


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rank_device(
    device_type: str | None = None,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    oversubscribe: bool = False,
) -> torch.device:
    """The device this process should use: ``cuda:LOCAL_RANK``, or the CPU.

    ``local_rank`` and ``local_world_size`` default to ``torchrun``'s ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (0 and 1 without them). Each rank on a node gets its own GPU; more
    ranks than visible GPUs is refused, because ranks that share a GPU contend for its memory
    and compute, and NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected").

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` means CUDA when a GPU is visible.
        local_rank: this process's rank on its node.
        local_world_size: the number of ranks on this node.
        oversubscribe: allow more ranks than GPUs (rank ``i`` uses GPU ``i % count``). For
            correctness tests on a machine with fewer GPUs than ranks, with ``gloo``.

    Raises:
        ValueError: for an unknown device type, ``"cuda"`` without a visible GPU, or more
            ranks on this node than GPUs without ``oversubscribe``.

    Example:
        >>> rank_device("cpu")
        device(type='cpu')
    """
    device_type = device_type or default_device_type()
    if device_type not in ("cuda", "cpu"):
        raise ValueError(
            f"device_type must be 'cuda' or 'cpu', got {device_type!r}; pass e.g. "
            f"--device cuda, or leave it unset to use CUDA when a GPU is visible."
        )
    if device_type == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return torch.device("cuda", _gpu_index(local_rank, local_world_size, count, oversubscribe))


def _gpu_index(local_rank: int, local_world_size: int, count: int, oversubscribe: bool) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if count == 0:
        raise ValueError(
            f"device 'cuda' was asked for, but no GPU is visible (CUDA_VISIBLE_DEVICES="
            f"{visible}). Run on the CPU with device_type='cpu' (e.g. --device cpu), or check "
            f"the CUDA install with `python -c 'import torch; print(torch.cuda.is_available())'`."
        )
    if local_world_size > count and not oversubscribe:
        raise ValueError(
            f"{local_world_size} ranks on this node need one GPU each, but {count} GPU(s) are "
            f"visible (CUDA_VISIBLE_DEVICES={visible}). Launch at most {count} ranks per node "
            f"(torchrun --nproc-per-node {count}), run on the CPU with device_type='cpu' "
            f"(gloo), or, for correctness tests only, pass oversubscribe=True to share GPUs "
            f"(with backend='gloo': NCCL refuses two ranks on one GPU)."
        )
    return local_rank % count


def init_distributed(
    backend: str | None = None,
    *,
    device_type: str | None = None,
    oversubscribe: bool = False,
    timeout: datetime.timedelta | None = None,
) -> torch.device:
    """Join the process group described by the ``torchrun`` environment; return this rank's device.

    On CUDA each rank uses GPU ``LOCAL_RANK`` (see :func:`rank_device`) and NCCL; on the CPU,
    gloo. Does nothing but return the device if a process group already exists. Without
    ``torchrun`` variables it starts a single-process group, so the same script runs with
    ``python`` and with ``torchrun``.

    Args:
        backend: the c10d backend; ``None`` means NCCL on CUDA (gloo when oversubscribing)
            and gloo on the CPU.
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` means CUDA when a GPU is visible.
        oversubscribe: allow more ranks per node than GPUs (tests only; see
            :func:`rank_device`).
        timeout: how long collectives wait before failing (torch's default if ``None``).

    Raises:
        ValueError: if the device cannot be used (see :func:`rank_device`).

    Example:
        >>> device = init_distributed(device_type="cpu")  # doctest: +SKIP
        >>> model = model.to(device)  # doctest: +SKIP
    """
    single = "RANK" not in os.environ
    device = rank_device(
        device_type,
        local_rank=0 if single else None,
        local_world_size=1 if single else None,
        oversubscribe=oversubscribe,
    )
    if dist.is_initialized():
        return device
    if backend is None:
        backend = "nccl" if device.type == "cuda" and not oversubscribe else "gloo"
    if single:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)
    return device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_mesh(axes: Mapping[str, int], *, device_type: str | None = None) -> DeviceMesh:
    """A ``DeviceMesh`` with named axes over all ranks, e.g. ``make_mesh({"dp": 2, "tp": 2})``.

    Axes are ordered major to minor, like the dims of a row-major array of ranks. The device
    defaults to CUDA when present, else CPU. Calls :func:`init_distributed` if needed (with
    the same device type).

    Raises:
        ValueError: if the product of the axis sizes differs from the world size, or an axis
            name repeats or is not a string.

    Example:
        >>> mesh = make_mesh({"dp": 1})  # doctest: +SKIP
        >>> mesh.mesh_dim_names  # doctest: +SKIP
        ('dp',)
    """
    names = tuple(str(a) for a in axes)
    sizes = tuple(int(s) for s in axes.values())
    if any(not isinstance(a, str) for a in axes):
        raise ValueError(f"mesh axis names must be strings, got {tuple(axes)}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive, got {dict(axes)}")
    init_distributed(device_type=device_type)
    world = dist.get_world_size()
    if math.prod(sizes) != world:
        raise ValueError(
            f"make_mesh({dict(zip(names, sizes))}) needs {math.prod(sizes)} ranks, but the world "
            f"size is {world}. Choose axis sizes whose product is {world}, or launch with "
            f"`torchrun --nproc-per-node {math.prod(sizes)}`."
        )
    return init_device_mesh(device_type or default_device_type(), sizes, mesh_dim_names=names)


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

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2, "tp": 4}) as mesh:
        ...     ff.axis_size(mesh, "tp")
        4
    """
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


_GRIDS: weakref.WeakKeyDictionary[DeviceMesh, MeshGrid] = weakref.WeakKeyDictionary()


def mesh_grid(mesh: DeviceMesh) -> MeshGrid:
    """The mesh's :class:`MeshGrid`, computed on first use and cached with the mesh.

    Reading ``mesh.mesh`` builds a tensor; on a simulated mesh every op on it runs once per
    rank, so reading it per parameter and rank cost O(ranks²) each. The grid is read once,
    outside any ``torch.func`` transform and outside the simulation.
    """
    grid = _GRIDS.get(mesh)
    if grid is None:
        grid = _GRIDS[mesh] = _read_grid(mesh)
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
