"""Processes and named device meshes.

Code names mesh axes and never indexes them: ``axis_size(mesh, "dp")``, not ``mesh.size(0)``.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import math
import os
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


DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for the other ranks before failing, unless told otherwise."""


def _timeout(value: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """``value`` as a timedelta; ``None``: ``FUNCTIONAL_FSDP_TIMEOUT`` seconds, if set."""
    if value is None:
        env = os.environ.get("FUNCTIONAL_FSDP_TIMEOUT", "").strip()
        if not env:
            return None
        try:
            value = float(env)
        except ValueError:
            raise ValueError(
                f"FUNCTIONAL_FSDP_TIMEOUT={env!r} is not a number of seconds; set it to e.g. "
                f"FUNCTIONAL_FSDP_TIMEOUT=600, or unset it for the default of "
                f"{DEFAULT_TIMEOUT.total_seconds():g} s."
            ) from None
    if isinstance(value, bool) or not isinstance(value, (datetime.timedelta, int, float)):
        raise TypeError(
            f"init_distributed: timeout must be a datetime.timedelta or a number of seconds, "
            f"got {value!r} ({type(value).__name__}); e.g. timeout=datetime.timedelta(minutes=10)."
        )
    if not isinstance(value, datetime.timedelta):
        value = datetime.timedelta(seconds=value)
    if value.total_seconds() <= 0:
        raise ValueError(
            f"init_distributed: timeout must be positive, got {value.total_seconds():g} s; e.g. "
            f"timeout=datetime.timedelta(minutes=10)."
        )
    return value


def _use_timeout(timeout: datetime.timedelta) -> None:
    """Apply ``timeout`` to every existing process group and to those created later.

    ``DeviceMesh`` creates a group per axis of a multi-dimensional mesh with
    ``new_group(timeout=None)``, which takes c10d's module default (30 minutes for gloo),
    not the default group's timeout; so the default is set as well.
    """
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout
    for group in list(c10d._world.pg_map):
        with contextlib.suppress(Exception):  # groups this rank is not part of
            c10d._set_pg_timeout(timeout, group)


def init_distributed(
    backend: str | None = None,
    *,
    device_type: str | None = None,
    oversubscribe: bool = False,
    timeout: datetime.timedelta | float | None = None,
) -> torch.device:
    """Join the process group described by the ``torchrun`` environment; return this rank's device.

    On CUDA each rank uses GPU ``LOCAL_RANK`` (see :func:`rank_device`) and NCCL; on the CPU,
    gloo. If a process group already exists it only applies ``timeout`` (when given) and
    returns the device. Without ``torchrun`` variables it starts a single-process group, so
    the same script runs with ``python`` and with ``torchrun``.

    The timeout is how long a collective waits for the other ranks before it fails with
    :class:`~functional_fsdp.CollectiveError` (naming the collective and the mesh axis). The
    default, 10 minutes (:data:`DEFAULT_TIMEOUT`, NCCL's own default), is suited to training:
    healthy ranks reach each collective of a step milliseconds apart, so a wait only grows
    long when one rank does extra work outside the step (saving a checkpoint, evaluating,
    loading data) while the others are already waiting, and 10 minutes covers that. A rank
    that dies or raises ends the job within seconds whatever the timeout (``torchrun`` stops
    the other workers, and on gloo they also see the connection close at once); the timeout
    bounds the rarer hang, where a rank stays alive but skips a collective (a notebook, a
    caught exception, a branch on the rank), at minutes instead of gloo's 30-minute default.
    Shorten it for interactive work and tests, lengthen it for slow checkpoints. On NCCL,
    torch's watchdog ends a process whose collective timed out (the library's named error
    needs ``TORCH_NCCL_BLOCKING_WAIT=1``).

    Args:
        backend: the c10d backend; ``None`` means NCCL on CUDA (gloo when oversubscribing)
            and gloo on the CPU.
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` means CUDA when a GPU is visible.
        oversubscribe: allow more ranks per node than GPUs (tests only; see
            :func:`rank_device`).
        timeout: how long collectives wait (a ``timedelta`` or seconds). ``None``: the
            ``FUNCTIONAL_FSDP_TIMEOUT`` environment variable (seconds) if set, else
            :data:`DEFAULT_TIMEOUT` for a new group and unchanged for an existing one. It
            applies to every group, the mesh axes' groups included.

    Raises:
        ValueError: if the device cannot be used (see :func:`rank_device`), or the timeout
            is not positive.
        TypeError: if the timeout is not a ``timedelta`` or a number.

    Example:
        >>> import datetime
        >>> device = init_distributed(timeout=datetime.timedelta(minutes=5))  # doctest: +SKIP
        >>> model = model.to(device)  # doctest: +SKIP
    """
    from . import collectives

    chosen = _timeout(timeout)
    if collectives._env_check():  # the debug switch, read again once the run starts
        collectives._CHECK = True
    single = "RANK" not in os.environ
    device = rank_device(
        device_type,
        local_rank=0 if single else None,
        local_world_size=1 if single else None,
        oversubscribe=oversubscribe,
    )
    if dist.is_initialized():
        if chosen is not None:
            _use_timeout(chosen)
        return device
    if backend is None:
        backend = "nccl" if device.type == "cuda" and not oversubscribe else "gloo"
    if single:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chosen = chosen or DEFAULT_TIMEOUT
    dist.init_process_group(backend, timeout=chosen)
    _use_timeout(chosen)
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
