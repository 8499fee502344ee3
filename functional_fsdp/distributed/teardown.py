"""Process groups that end before the interpreter does, so a finished job exits 0.

A gloo collective's work object holds the tensors it was given, and the group's worker thread
drops it just after marking it complete: after the rank that waited on it has moved on. A
tensor that has a Python object needs the GIL to let go of it. When the last collective of a
job (the final ``ff.gather`` of an export, a checkpoint's last barrier) is waited on just
before the script ends, the worker can still be dropping it while Python finalizes; taking
the GIL then ends the thread with ``pthread_exit``, whose unwinding through torch's
``noexcept`` destructors aborts the process ("terminate called without an active exception",
SIGABRT): ``torchrun`` reports a finished job as failed. ``destroy_process_group`` at the end
of a script does not prevent it either: a ``DeviceMesh`` keeps its groups in a registry of its
own, so while the script's mesh (or a ``Sharded`` value, which holds it) is alive the group
survives the destroy, and so does its worker.

A group's destructor waits for its worker to finish and joins it. :func:`end_groups_at_exit`
(called by :func:`~functional_fsdp.init_distributed`) registers, once per process, an
``atexit`` hook that runs while the interpreter is still whole: it closes the objects that own
a group of their own (a :class:`~functional_fsdp.checkpoint.CheckpointManager`), destroys the
process groups, and drops the references that the meshes made by
:func:`~functional_fsdp.make_mesh` keep, so every group of the library is destroyed and its
threads joined before finalization. A script that ends by raising skips it: a collective
still in flight there could wait for ranks that are gone, and the process ends with an error
anyway.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_registered = False
_meshes: weakref.WeakSet[Any] = weakref.WeakSet()
_closers: dict[int, weakref.WeakMethod[Callable[[], None]]] = {}


def end_groups_at_exit() -> None:
    """Destroy this process's groups (and join their threads) before the interpreter finalizes.

    Idempotent: the hook is registered once per process.

    Example:
        >>> end_groups_at_exit()
        >>> end_groups_at_exit()  # registered once
    """
    global _registered
    if not _registered:
        atexit.register(_end_groups)
        _registered = True


def track_mesh(mesh: Any) -> None:
    """Drop ``mesh``'s references to its groups at exit (a ``DeviceMesh`` keeps them alive)."""
    _meshes.add(mesh)


def close_at_exit(close: Callable[[], None]) -> None:
    """Call the bound method ``close`` at exit, before the groups are destroyed, if its object
    is still alive (e.g. a checkpoint manager the script did not close)."""
    _closers[id(close.__self__)] = weakref.WeakMethod(close)  # type: ignore[attr-defined]


def forget_close(owner: object) -> None:
    """``owner`` closed itself: nothing to do for it at exit."""
    _closers.pop(id(owner), None)


def _ended_by_exception() -> bool:
    # Python keeps the uncaught exception it printed as sys.last_value (3.12: also last_exc).
    return (
        getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    )


def _end_groups() -> None:
    if _ended_by_exception():
        return
    for ref in list(_closers.values()):
        close = ref()
        if close is not None:
            close()
    _closers.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for mesh in list(_meshes):
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    gc.collect()  # groups held only by reference cycles die here too, not in finalization
