"""A small launcher: run a function on N local processes joined in a process group.

For notebooks and tests. Scripts use ``torchrun`` as it is. Workers are reused across calls
(starting a process and a process group costs seconds), functions travel with cloudpickle so
notebook-defined functions work, and a failure or a hang on any rank raises in the caller
with every rank's traceback instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as mp

from .mesh import rank_device


class WorkerError(RuntimeError):
    """A function failed (or timed out) on one or more ranks of a :class:`ProcessPool`.

    The message holds every failing rank's traceback; the pool is closed afterwards.

    Example:
        >>> def fails():
        ...     raise ValueError("bad input")
        >>> ff.launch(fails, 2)  # doctest: +SKIP
        Traceback (most recent call last):
        WorkerError: fails failed:
        --- rank 0 ---
        ValueError: bad input
        ...
    """


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    device: tuple[str | None, str, bool],
    threads: int,
    tasks: Any,
    results: Any,
) -> None:
    import torch.distributed as dist

    from .mesh import init_distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    backend, device_type, oversubscribe = device
    init_distributed(
        backend,
        device_type=device_type,
        oversubscribe=oversubscribe,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            try:
                fn, args, kwargs = cloudpickle.loads(task)
                out = fn(*args, **kwargs)
                results.put((rank, True, cloudpickle.dumps(out)))
            except BaseException as e:  # report everything, keep serving
                results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


class ProcessPool:
    """``world_size`` worker processes in one gloo (or NCCL) process group, reused across calls.

    Each rank gets its own device as under ``torchrun`` (see :func:`~functional_fsdp.dist.mesh.rank_device`):
    GPU ``rank`` with NCCL when CUDA is visible, the CPU with gloo otherwise.

    Args:
        world_size: number of ranks.
        backend: the c10d backend; ``None`` picks it from the device (see
            :func:`~functional_fsdp.init_distributed`).
        timeout: seconds to wait for every rank to finish one call.
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` means CUDA when a GPU is visible.
        oversubscribe: allow more ranks than GPUs (ranks share GPUs, over gloo); for
            correctness tests on a machine with fewer GPUs than ranks.

    Raises:
        ValueError: on CUDA, if ``world_size`` exceeds the visible GPUs without
            ``oversubscribe`` (before any process starts).

    Example:
        >>> def rank_and_size():
        ...     import torch.distributed as dist
        ...     return dist.get_rank(), dist.get_world_size()
        >>> with ProcessPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(rank_and_size)
        [(0, 2), (1, 2)]
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str | None = None,
        timeout: float = 300,
        device_type: str | None = None,
        oversubscribe: bool = False,
    ) -> None:
        self.world_size = world_size
        # Refuse a bad device choice here, before starting processes that would all fail.
        device = rank_device(
            device_type, local_rank=0, local_world_size=world_size, oversubscribe=oversubscribe
        )
        self.device_type = device.type
        gpu_backend = "gloo" if oversubscribe else "nccl"
        self.backend = backend or (gpu_backend if device.type == "cuda" else "gloo")
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    port,
                    (self.backend, self.device_type, oversubscribe),
                    threads,
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            WorkerError: if any rank raised or a rank did not answer within ``timeout``
                seconds. The pool is then closed, since ranks may be stuck in a collective.
        """
        if self.broken:
            raise WorkerError("this ProcessPool failed earlier and was closed; make a new one")
        task = cloudpickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put(task)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout)
        while len(results) + len(errors) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, payload = self._results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self._kill()
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                raise WorkerError(
                    f"{getattr(fn, '__name__', fn)} did not finish on ranks {missing} within "
                    f"{self.timeout}s (dead processes: {dead}).\n" + _format(errors)
                ) from None
            if ok:
                results[rank] = cloudpickle.loads(payload)
            else:
                errors[rank] = payload
                if not results and len(errors) == 1:
                    # Give the other ranks a moment: they either fail too or hang in a collective.
                    deadline = min(
                        deadline, datetime.datetime.now() + datetime.timedelta(seconds=20)
                    )
        if errors:
            self._kill()
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed:\n" + _format(errors))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Shut the workers down cleanly (barrier, then ``destroy_process_group``)."""
        if self.broken:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
        self._kill()

    def _kill(self) -> None:
        self.broken = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _format(errors: dict[int, str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))


def launch(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once on ``world_size`` fresh processes; return per-rank results.

    Each rank gets its own GPU when CUDA is visible (more ranks than GPUs is refused), else
    the CPU; use :class:`ProcessPool` to choose the device or to oversubscribe GPUs.

    Example:
        >>> import functional_fsdp as ff
        >>> def total():
        ...     import torch
        ...     mesh = ff.make_mesh({"dp": 2})
        ...     x = ff.shard(torch.arange(6.0), mesh, ff.P("dp"))
        ...     return ff.gather(x).sum().item()
        >>> ff.launch(total, 2)  # doctest: +SKIP
        [15.0, 15.0]
    """
    with ProcessPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)
