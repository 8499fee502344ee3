"""Processes and named device meshes.

Code names mesh axes and never indexes them: ``axis_size(mesh, "dp")``, not ``mesh.size(0)``.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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


def init_distributed(backend: str | None = None) -> None:
    """Join the process group described by the ``torchrun`` environment.

    Uses NCCL when CUDA is available and gloo otherwise. Does nothing if a process group
    already exists. Without ``torchrun`` variables it starts a single-process group, so the
    same script runs with ``python`` and with ``torchrun``.

    Example:
        >>> init_distributed()  # doctest: +SKIP
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_mesh(axes: Mapping[str, int], *, device_type: str | None = None) -> DeviceMesh:
    """A ``DeviceMesh`` with named axes over all ranks, e.g. ``make_mesh({"dp": 2, "tp": 2})``.

    Axes are ordered major to minor, like the dims of a row-major array of ranks. The device
    defaults to CUDA when present, else CPU. Calls :func:`init_distributed` if needed.

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
    init_distributed()
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


def coordinate_of(mesh: DeviceMesh, rank: int) -> dict[str, int]:
    """The mesh coordinate of a global rank, by axis name.

    Works inside ``torch.func`` transforms (e.g. ``reshard`` under ``torch.func.grad``), where
    ``mesh.mesh`` would otherwise be computed as a transformed tensor that cannot be read.
    """
    with torch._C._DisableFuncTorch():
        grid = mesh.mesh
        per_rank = getattr(grid, "_local_tensors", None)  # a simulated mesh: the same everywhere
        if per_rank is not None:
            grid = next(iter(per_rank.values()))
        ranks = grid.tolist()
    shape = tuple(int(s) for s in grid.shape)
    flat: list[int] = ranks
    for _ in shape[1:]:
        flat = [r for row in flat for r in row]  # type: ignore[union-attr]
    if flat.count(rank) != 1:
        raise ValueError(f"rank {rank} is not in the mesh {ranks}")
    index, coord = flat.index(rank), []
    for size in reversed(shape):
        coord.append(index % size)
        index //= size
    return dict(zip(axis_names(mesh), reversed(coord)))
