"""gloo process groups that run their collectives on one thread, in the order they are issued.

torch's ``ProcessGroupGloo`` runs collectives on a pool of two threads. With two collectives
of one group in flight at once (an all-gather issued ahead while a reduction still runs,
which is what overlapping communication means), torch 2.13 on the CPU can corrupt the
process's heap: ``python benchmarks/gloo_threads.py`` reproduces it with torch's own
functional collectives and none of this library (``malloc(): unaligned tcache chunk
detected`` or a segmentation fault within about 40,000 to 110,000 steps of an all-gather and
an all-reduce in flight together; none in 250,000 steps of the same with one thread, nor in
150,000 with one collective in flight at a time).

With one thread a group still runs its collectives asynchronously, so they overlap with the
computation as before; two collectives of one group no longer run at the same time. Every
rank issues a group's collectives in the same order, so running them in that order cannot
deadlock. NCCL and other backends are untouched.

:func:`use_one_thread` makes every gloo group created afterwards in this process (the world
group, the mesh axes' groups, a checkpoint manager's group) such a group;
:func:`~functional_fsdp.init_distributed` and :func:`~functional_fsdp.make_mesh` call it
before they create any. A world group created earlier by ``torch.distributed`` itself keeps
torch's two threads: start the job with :func:`~functional_fsdp.init_distributed`.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

THREADS = 1

_TorchGloo = getattr(dist, "ProcessGroupGloo", None)


def use_one_thread() -> None:
    """Make every gloo process group created from now on in this process run on one thread.

    Idempotent. Where torch has no gloo, nothing changes.

    Example:
        >>> use_one_thread()
        >>> issubclass(dist.ProcessGroupGloo, c10d.ProcessGroupGloo)  # torch's checks still hold
        True
    """
    if _TorchGloo is None or c10d.ProcessGroupGloo is not _TorchGloo:
        return  # no gloo, or already done (or another library replaced it: leave it)
    c10d.ProcessGroupGloo = _OneThreadGloo


class _OneThread(type):
    """``c10d.ProcessGroupGloo`` as torch's code uses it, but built with one thread.

    Calling it builds a real ``ProcessGroupGloo`` (no subclass: torch hands the object back
    from C++ as its own type), and ``isinstance``/attribute access answer for torch's class,
    so torch's checks (``_set_pg_timeout``'s, for one) see the gloo group they expect.
    """

    def __call__(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta = c10d.default_pg_timeout,
    ) -> object:
        gloo = _TorchGloo
        assert gloo is not None
        options = gloo._Options()
        options._threads = THREADS
        options._timeout = timeout
        # As torch's own constructor: the interfaces GLOO_SOCKET_IFNAME names, else the default.
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        options._devices = (
            [gloo.create_device(interface=n) for n in names]
            if names
            else [gloo.create_default_device()]
        )
        return gloo(store, rank, size, options)

    def __instancecheck__(cls, obj: object) -> bool:
        return _TorchGloo is not None and isinstance(obj, _TorchGloo)

    def __subclasscheck__(cls, sub: type) -> bool:
        return _TorchGloo is not None and issubclass(sub, _TorchGloo)

    def __getattr__(cls, name: str) -> object:
        return getattr(_TorchGloo, name)


class _OneThreadGloo(metaclass=_OneThread):
    """Stands in for ``torch.distributed.ProcessGroupGloo`` inside c10d (see :class:`_OneThread`)."""
