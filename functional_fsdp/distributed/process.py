"""This process in the job: its rank, the world, and the few object collectives outside a step.

The rest of the library asks these small functions instead of calling ``torch.distributed``
itself (the distributed layer is the only c10d caller). Each one also answers without a
process group, as the single process it then is: rank 0 of a world of 1, a barrier that
returns at once, a broadcast that hands the value back. Tensor collectives over mesh axes
are :mod:`.collectives`; these move small Python objects (a directory name, an error
message) and are for code outside the training step (checkpoints, the launcher).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Group = Any  # a c10d ProcessGroup; None means the default (world) group


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a single-node rendezvous).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world_size: int, port: str, **more: str) -> dict[str, str]:
    """This process's environment plus what ``torchrun`` sets for one of ``world_size``
    local ranks rendezvousing on ``127.0.0.1:port``, and ``more``.

    Example:
        >>> env = torchrun_env(1, 2, "29500", OMP_NUM_THREADS="1")
        >>> env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]
        ('1', '2', '29500', '1')
    """
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        **more,
    }


def is_initialized() -> bool:
    """Whether this process has joined a process group (``False`` where torch has no c10d)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Group = None) -> int:
    """This process's rank in ``group`` (the world by default); 0 without a process group.

    Example:
        >>> rank()  # a plain Python process
        0
    """
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: Group = None) -> int:
    """The number of ranks in ``group`` (the world by default); 1 without a process group.

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size(group) if dist.is_initialized() else 1


def barrier(group: Group = None) -> None:
    """Wait until every rank of ``group`` gets here; returns at once without a process group."""
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast_object(value: Any, group: Group = None) -> Any:
    """Rank 0's ``value`` (rank 0 of ``group``) on every rank; ``value`` without a group.

    Example:
        >>> broadcast_object({"step": 3})
        {'step': 3}
    """
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def gather_objects(value: Any, group: Group = None) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank; ``[value]`` without a group.

    Example:
        >>> gather_objects("ok")
        ['ok']
    """
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def new_group(backend: str) -> Group | None:
    """A new process group over all ranks on ``backend`` (e.g. a gloo group for background
    work beside the training collectives); ``None`` without a process group."""
    return dist.new_group(backend=backend) if dist.is_initialized() else None


def destroy_group(group: Group = None) -> None:
    """Tear ``group`` down (the default group and every other, when ``None``), if it exists."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


def start_max(value: int, group: Group = None) -> Callable[[], int]:
    """Start the maximum of every rank's ``value`` over ``group``; return a function that waits
    for it and returns it. Asynchronous (a tiny all-reduce), so a caller can look at the result
    a few steps later without waiting; ``value`` itself without a process group.

    Example:
        >>> start_max(3)()
        3
    """
    if not dist.is_initialized():
        return lambda: value
    box = torch.tensor([value], dtype=torch.int64)
    work = dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result() -> int:
        work.wait()
        return int(box.item())

    return result
