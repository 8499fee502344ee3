"""Joining the job and building named device meshes: ``init_distributed``, ``make_mesh``.

The top of the distributed layer. Reading a mesh by axis name (``axis_sizes``,
``coordinate_of``, ``check_mesh`` ...) is :mod:`.axes`, re-exported here so that
``from functional_fsdp.distributed.mesh import axis_sizes`` keeps working.

Code names mesh axes and never indexes them: ``axis_size(mesh, "dp")``, not ``mesh.size(0)``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..spec import did_you_mean
from . import checks, gloo, restarts, teardown
from .axes import Axis as Axis
from .axes import MeshGrid as MeshGrid
from .axes import _simulation_paused as _simulation_paused
from .axes import axis_names as axis_names
from .axes import axis_size as axis_size
from .axes import axis_sizes as axis_sizes
from .axes import check_axes as check_axes
from .axes import check_mesh as check_mesh
from .axes import checked_axes as checked_axes
from .axes import coordinate_of as coordinate_of
from .axes import describe_mesh as describe_mesh
from .axes import local_coordinate as local_coordinate
from .axes import mesh_device as mesh_device
from .axes import mesh_grid as mesh_grid
from .axes import rank_at as rank_at
from .process import free_port


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

    gloo groups created from here on (the world's, the mesh axes', a checkpoint manager's) run
    their collectives on one thread each, in the order they are issued, still asynchronously:
    with torch's two threads, two collectives of one group running at once can corrupt the
    process's heap (:mod:`functional_fsdp.distributed.gloo`, ``benchmarks/gloo_threads.py``).
    Start the job here rather than with ``torch.distributed.init_process_group`` on gloo.

    At interpreter exit, unless the script ends by raising, the process groups are destroyed
    and their threads joined before Python finalizes (:mod:`functional_fsdp.distributed.teardown`):
    a gloo worker still releasing the job's last collective then aborted a finished job.

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
    chosen = _timeout(timeout)
    _check_backend(backend)
    gloo.use_one_thread()  # before any group exists: see functional_fsdp/distributed/gloo.py
    _import_world_defaults()
    teardown.end_groups_at_exit()  # the groups and their threads end before the interpreter
    if checks._env_check():  # the debug switch, read again once the run starts
        checks._CHECK = True
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
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chosen = chosen or DEFAULT_TIMEOUT
    restarts.init_process_group(backend, chosen)  # a torchrun restart as well as the start
    _use_timeout(chosen)
    return device


def _import_world_defaults() -> None:
    """Import ``torch.distributed.nn`` while no world group exists.

    Its functions take ``group=group.WORLD`` as a default argument, and torch imports it
    lazily on the first functional collective (through ``torch._dynamo``). Imported after the
    world group exists, those defaults hold the group forever: ``destroy_process_group`` then
    cannot free it, and gloo's threads stay alive into interpreter exit, where a thread that
    touches Python aborts the process ("terminate called without an active exception").
    Imported first, the defaults are ``None`` and the group dies with its last user.
    """
    if not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401


def _check_backend(backend: Any) -> None:
    """A misspelt backend fails here, naming the choices, instead of inside c10d."""
    if backend is None or (isinstance(backend, str) and ":" in backend):
        return  # None: chosen from the device; "cpu:gloo,cuda:nccl": torch checks its parts
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    if not isinstance(backend, str) or backend.lower() not in known:
        raise ValueError(
            f"init_distributed(backend={backend!r}): not a c10d backend; use one of {known}, or "
            f"leave it None for NCCL on CUDA and gloo on the CPU"
            f"{did_you_mean(str(backend).lower(), known)}."
        )


# What init_distributed writes into os.environ outside torchrun (see make_mesh).
_LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)


@contextlib.contextmanager
def _environ_restored(keys: tuple[str, ...] = _LAUNCH_VARS) -> Iterator[None]:
    """Put ``keys`` of ``os.environ`` back as they were (set, changed or absent) on exit.

    The process group keeps its store; the variables only told it where to rendezvous. Left
    behind, they would make a child process started later rendezvous on this process's
    port (and fail to bind it) or believe it is rank 0 of an existing job.
    """
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_mesh(axes: Mapping[str, int], *, device_type: str | None = None) -> DeviceMesh:
    """A ``DeviceMesh`` with named axes over all ranks, e.g. ``make_mesh({"dp": 2, "tp": 2})``.

    Axes are ordered major to minor, like the dims of a row-major array of ranks. The device
    defaults to CUDA when present, else CPU. Calls :func:`init_distributed` if needed (with
    the same device type). Outside ``torchrun`` it leaves ``os.environ`` as it found it: the
    rendezvous variables of its single-process group are removed again, so that a process
    started afterwards can set up its own.

    Raises:
        TypeError: if ``axes`` is not a dict, an axis name is not a string, or a size is not
            an integer (``1.7``, ``"two"``, ``True``).
        ValueError: if there are no axes, a size is below 1, or the product of the sizes
            differs from the world size.

    Example:
        >>> mesh = make_mesh({"dp": 1})  # doctest: +SKIP
        >>> mesh.mesh_dim_names  # doctest: +SKIP
        ('dp',)
        >>> make_mesh({"dp": 1.7})
        Traceback (most recent call last):
        ...
        TypeError: make_mesh({'dp': 1.7}): mesh axis 'dp' has size 1.7 (float); sizes must be integers, e.g. {'dp': 2}. A size is never rounded.
    """
    sizes_by_name = checked_axes(axes, "make_mesh", example_size="world_size")
    names, sizes = tuple(sizes_by_name), tuple(sizes_by_name.values())
    with _environ_restored():
        init_distributed(device_type=device_type)
    world = dist.get_world_size()
    if math.prod(sizes) != world:
        raise ValueError(
            f"make_mesh({sizes_by_name}) needs {math.prod(sizes)} ranks, but the world "
            f"size is {world}. Choose axis sizes whose product is {world}, or launch with "
            f"`torchrun --nproc-per-node {math.prod(sizes)}`."
        )
    mesh = init_device_mesh(device_type or default_device_type(), sizes, mesh_dim_names=names)
    teardown.track_mesh(mesh)  # its groups die at exit even while the mesh is alive
    return mesh
