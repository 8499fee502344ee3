"""A small launcher: run a function on N local processes joined in a process group.

For notebooks and tests. Scripts use ``torchrun`` as it is. Workers are reused across calls
(starting a process and a process group costs seconds), and functions travel with cloudpickle,
so functions defined in a notebook or in a script's ``__main__`` work.

Each worker is a fresh interpreter started with :mod:`subprocess` (like ``spawn``, but it never
re-runs the caller's ``__main__``, so a script without an ``if __name__ == "__main__":`` guard
works too). Tasks and results travel over one socket pair per rank. The launcher watches every
worker: its output is printed line by line with its rank (``[rank 1] ...``); a worker that
raises, dies (killed, ``os._exit``, a crash in native code) or fails to start is reported
within seconds, with its traceback or exit status, its last output lines and the likely fix;
and ranks that do not answer in time are named, with the Python stack each was in.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import importlib
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import IO, Any, NamedTuple

import cloudpickle
import torch

from .distributed import process
from .distributed.mesh import rank_device
from .distributed.process import free_port

_GRACE_S = 3.0
"""After one rank fails, how long the others get to answer (they are often stuck in a
collective waiting for the failed rank) before the pool reports and stops them."""
_START_S = 60.0
"""The least time workers get to start and join the process group (``timeout`` if longer)."""
_POLL_S = 0.2
"""How often a waiting caller checks that its workers are alive."""
_TAIL = 60
"""Output lines kept per rank for error reports."""
_MARK = "\x1e[ff-launch-sync {}]"
"""Written by a worker to stdout and stderr after each call, so that ``run`` returns only
once the call's output has been printed (it is not printed itself)."""


class WorkerError(RuntimeError):
    """A function failed, a worker died, or a rank did not answer in a :class:`ProcessPool`.

    The message holds, per failing rank, its traceback (or exit status and last output lines)
    and the likely fix; the pool is closed afterwards.

    Example:
        >>> def fails():
        ...     raise ValueError("bad input")
        >>> ff.launch(fails, 2)  # doctest: +SKIP
        Traceback (most recent call last):
        WorkerError: fails failed on ranks [0, 1]:
        --- rank 0: raised ValueError ---
        ...
        ValueError: bad input
        ...
    """


# --------------------------------------------------------------------------- the worker side

_BOOTSTRAP = """\
import faulthandler, pickle, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stack dump, asked for on a time out
from multiprocessing.connection import Connection
conn = Connection({fd})
config = pickle.loads(conn.recv_bytes())
sys.path[:] = config["sys_path"]
from functional_fsdp.launcher import _worker_main
_worker_main(conn, config)
"""


def _sync_output(seq: int) -> None:
    """Mark the end of call ``seq`` on stdout and stderr (see ``_MARK``)."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
        with contextlib.suppress(OSError):
            os.write(fd, (_MARK.format(seq) + "\n").encode())


def _worker_main(conn: Connection, config: dict[str, Any]) -> None:
    """A worker's life: join the process group, serve calls, tear down cleanly."""
    from .distributed.mesh import init_distributed

    torch.set_num_threads(config["threads"])
    timeout = config["collective_timeout"]
    try:
        init_distributed(
            config["backend"],
            device_type=config["device_type"],
            oversubscribe=config["oversubscribe"],
            timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
        )
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("error", _describe(e, "start"))))
        raise SystemExit(1) from None
    conn.send_bytes(pickle.dumps(("ready", None)))
    seq = 0
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the caller is gone: nothing to tear down with
            raise SystemExit(1) from None
        if task == b"close":
            break
        seq += 1
        stage = "load"
        try:
            fn, args, kwargs = cloudpickle.loads(task)
            stage = "run"
            message = ("ok", cloudpickle.dumps(fn(*args, **kwargs)))
        except BaseException as e:  # report everything, keep serving
            message = ("error", _describe(e, stage, timeout))
        _sync_output(seq)
        conn.send_bytes(pickle.dumps(message))
    # Clean teardown: no rank closes its connections while another still uses them.
    process.barrier()
    process.destroy_group()


def _describe(e: BaseException, stage: str, timeout: float | None = None) -> dict[str, str]:
    return {
        "stage": stage,
        "type": type(e).__name__,
        "traceback": "".join(traceback.format_exception(e)).rstrip(),
        "hint": _error_hint(e, stage, timeout),
    }


def _error_hint(e: BaseException, stage: str, timeout: float | None = None) -> str:
    if stage == "load" and isinstance(e, (ImportError, AttributeError)):
        return (
            "The workers could not load the function (or an object it uses) by reference: "
            "its module is not importable in a fresh Python process. Put it in a module on "
            "sys.path or PYTHONPATH, or define it in the notebook or the script's __main__ "
            "(those are sent by value)."
        )
    text = str(e)
    if stage == "run" and "Timed out" in text:
        limit = "torch's default" if timeout is None else f"{timeout:g} seconds"
        return (
            f"A collective waited longer than the collective timeout ({limit}, "
            f"ProcessPool(collective_timeout=...)): another rank skipped it, called a "
            f"different one, or is much slower. Make every rank issue the same collectives, "
            f"or raise collective_timeout."
        )
    if stage == "run" and ("Connection reset by peer" in text or "Connection closed" in text):
        return (
            "Another rank failed or died while this one waited in a collective; its "
            "report says why."
        )
    if stage == "start":
        return (
            "The worker could not join the process group. Check the backend and device "
            "(ProcessPool(backend=..., device_type=...)) and that no firewall blocks 127.0.0.1."
        )
    return ""


# --------------------------------------------------------------------------- the caller side


class _Worker:
    """One rank: its process, its connection, and the threads relaying its output."""

    def __init__(self, rank: int, config: dict[str, Any], env: dict[str, str]) -> None:
        self.rank = rank
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP.format(fd=child.fileno())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(child.fileno(),),
            start_new_session=True,  # Ctrl-C reaches the caller, which stops the workers
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send_bytes(pickle.dumps(config))
        self.ready = False
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self.lines = 0  # lines seen so far (the tail's index base)
        self.synced = {"stdout": 0, "stderr": 0}  # the last call whose output is all printed
        self.quiet = False  # set while the pool kills its workers
        self.changed = threading.Condition()
        self.relays = [
            threading.Thread(target=self._relay, args=(name, pipe), daemon=True)
            for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for t in self.relays:
            t.start()

    def _relay(self, name: str, pipe: IO[bytes]) -> None:
        prefix = f"[rank {self.rank}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            start = line.rfind("\x1e[ff-launch-sync ")
            if start >= 0 and line.endswith("]\n"):
                with self.changed:
                    self.synced[name] = int(line[start + 17 : -2])
                    self.changed.notify_all()
                line = line[:start]
                if not line:
                    continue
            if not line.endswith("\n"):
                line += "\n"
            with self.changed:
                self.tail.append(line)
                self.lines += 1
            if not self.quiet:
                out = sys.stdout if name == "stdout" else sys.stderr
                try:
                    out.write(prefix + line)
                    out.flush()
                except (OSError, ValueError):  # the caller's stream was closed
                    pass
        pipe.close()

    def wait_output(self, seq: int, timeout: float) -> None:
        """Wait until the output of call ``seq`` is printed (or ``timeout`` passes)."""
        with self.changed:
            self.changed.wait_for(lambda: min(self.synced.values()) >= seq, timeout=timeout)

    def output_since(self, line: int) -> str:
        with self.changed:
            lines = list(self.tail)[max(0, len(self.tail) - (self.lines - line)) :]
        return "".join(lines)

    def drain(self, timeout: float = 1.0) -> None:
        """Wait for the relays to print what the (exited) process wrote last."""
        for t in self.relays:
            t.join(timeout=timeout)

    def last_output(self, n: int = 25) -> str:
        self.drain()
        with self.changed:
            return "".join(list(self.tail)[-n:])

    def kill(self) -> None:
        self.quiet = True
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.quiet = True
    for w in workers:
        w.kill()


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _death_hint(code: int, output: str) -> str:
    if code == -signal.SIGKILL:
        return (
            "Likely fix: SIGKILL usually comes from the kernel's out-of-memory killer (see "
            "`dmesg`) or from `kill -9`; use less memory per rank (a smaller batch or model, "
            "fewer ranks, ff.Policy(offload=True))."
        )
    if code < 0 or "terminate called" in output:
        return (
            "Likely fix: the worker crashed in native code; its last output lines above "
            "say where (a gloo/NCCL error, or a bug in an extension)."
        )
    if "ModuleNotFoundError" in output or "ImportError" in output:
        return (
            "Likely fix: the worker could not import what it needs; start Python where "
            "functional_fsdp and your modules are importable (the workers get the caller's "
            "sys.path and environment)."
        )
    return (
        "Likely fix: the function (or a library it called) ended the process without a "
        "Python exception, e.g. with os._exit(); raise an exception instead to get a "
        "traceback here."
    )


class _Failure(NamedTuple):
    """How one rank failed: a line for the summary, the details, and whether it died."""

    summary: str
    detail: str
    dead: bool

    @classmethod
    def raised(cls, info: dict[str, str]) -> _Failure:
        what = {"start": "failed to start", "load": "could not load the function"}
        hint = f"\nLikely fix: {info['hint']}" if info["hint"] else ""
        summary = what.get(info["stage"], "raised " + info["type"])
        return cls(summary, info["traceback"] + hint, dead=False)

    @classmethod
    def died(cls, code: int, output: str) -> _Failure:
        shown = f"Its last output lines:\n{output}" if output else "It printed nothing.\n"
        return cls(f"died ({_exit_status(code)})", shown + _death_hint(code, output), dead=True)


class ProcessPool:
    """``world_size`` worker processes in one gloo (or NCCL) process group, reused across calls.

    Each rank gets its own device as under ``torchrun`` (see :func:`~functional_fsdp.distributed.mesh.rank_device`):
    GPU ``rank`` with NCCL when CUDA is visible, the CPU with gloo otherwise. Workers' output
    is printed with their rank (``[rank 1] ...``) before :meth:`run` returns.

    Args:
        world_size: number of ranks (at least 1).
        backend: the c10d backend; ``None`` picks it from the device (see
            :func:`~functional_fsdp.init_distributed`).
        timeout: seconds to wait for every rank to finish one call (starting the workers
            and joining the process group gets this long too, and at least 60 s).
        collective_timeout: seconds a collective waits for the other ranks before it fails
            on the workers (``init_distributed(timeout=...)``); ``None`` keeps torch's default
            (30 minutes for gloo).
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` means CUDA when a GPU is visible.
        oversubscribe: allow more ranks than GPUs (ranks share GPUs, over gloo); for
            correctness tests on a machine with fewer GPUs than ranks.

    Raises:
        ValueError: for a ``world_size`` below 1 or a non-positive timeout, and on CUDA, if
            ``world_size`` exceeds the visible GPUs without ``oversubscribe`` (before any
            process starts).
        TypeError: for a ``world_size`` that is not an ``int``.

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
        collective_timeout: float | None = 120,
        device_type: str | None = None,
        oversubscribe: bool = False,
    ) -> None:
        _check_world_size(world_size, "ProcessPool")
        for name, value in (("timeout", timeout), ("collective_timeout", collective_timeout)):
            if value is not None and not value > 0:
                raise ValueError(
                    f"ProcessPool({name}={value!r}): the timeout must be a positive number "
                    f"of seconds, e.g. {name}=300."
                )
        self.world_size = world_size
        # Refuse a bad device choice here, before starting processes that would all fail.
        device = rank_device(
            device_type, local_rank=0, local_world_size=world_size, oversubscribe=oversubscribe
        )
        self.device_type = device.type
        gpu_backend = "gloo" if oversubscribe else "nccl"
        self.backend = backend or (gpu_backend if device.type == "cuda" else "gloo")
        self.timeout = float(timeout)
        self.collective_timeout = collective_timeout
        threads = max(1, (os.cpu_count() or 1) // world_size)
        port = str(free_port())
        config = {
            "sys_path": list(sys.path),
            "threads": threads,
            "backend": self.backend,
            "device_type": self.device_type,
            "oversubscribe": oversubscribe,
            "collective_timeout": collective_timeout,
        }
        self.broken = False
        self._calls = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        for r in range(world_size):
            env = process.torchrun_env(
                r, world_size, port, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1"
            )
            self._workers.append(_Worker(r, config, env))

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            TypeError: if ``fn`` or its arguments cannot be pickled (nothing is sent).
            WorkerError: if any rank raised, died, failed to start, or did not answer within
                ``timeout`` seconds. The pool is then closed, since ranks may be stuck in a
                collective.

        Example:
            >>> with ProcessPool(2) as pool:  # doctest: +SKIP
            ...     pool.run(pow, 2, 3)
            [8, 8]
        """
        if self.broken:
            raise WorkerError("this ProcessPool failed earlier and was closed; make a new one")
        return self._run(_name(fn), _pack(fn, args, kwargs))

    def _run(self, name: str, task: bytes) -> list[Any]:
        self._calls += 1
        try:
            results, failures, missing, waited = self._collect(task)
        except BaseException:  # e.g. KeyboardInterrupt: the ranks may be mid-collective
            self._stop()
            raise
        if failures or missing:
            stacks = self._stacks(missing)
            self._stop()
            raise WorkerError(self._report(name, failures, missing, waited, stacks))
        for w in self._workers:  # the call's output is printed before it returns
            w.wait_output(self._calls, timeout=1.0)
        return [results[r] for r in range(self.world_size)]

    def _collect(
        self, task: bytes
    ) -> tuple[dict[int, Any], dict[int, _Failure], dict[int, str], float]:
        """Send ``task`` and gather the answers, watching that every worker is alive.

        Returns the results, the failures, the ranks that did not answer (rank: "start" or
        "run") and how many seconds the caller waited for those.
        """

        def send() -> None:  # in a thread: a worker that is not reading must not block us
            for w in self._workers:
                with contextlib.suppress(OSError):  # a dead worker: found below
                    w.conn.send_bytes(task)

        threading.Thread(target=send, daemon=True).start()
        results: dict[int, Any] = {}
        failures: dict[int, _Failure] = {}
        pending = {w.rank: w for w in self._workers}
        now = time.monotonic()
        started = now if all(w.ready for w in self._workers) else None
        start_deadline = now + max(self.timeout, _START_S)
        failed_at: float | None = None

        def deadline() -> float:
            ends = [start_deadline if started is None else started + self.timeout]
            if failed_at is not None:
                ends.append(failed_at + _GRACE_S)
            return min(ends)

        while pending and time.monotonic() < deadline():
            ready = wait(
                [w.conn for w in pending.values()],
                timeout=max(0.0, min(_POLL_S, deadline() - time.monotonic())),
            )
            for w in list(pending.values()):
                if w.conn in ready:
                    try:
                        kind, payload = pickle.loads(w.conn.recv_bytes())
                    except (EOFError, OSError):
                        kind, payload = "dead", None
                    if kind == "ready":
                        w.ready = True
                        if started is None and all(x.ready for x in self._workers):
                            started = time.monotonic()
                        continue
                    if kind == "ok":
                        results[w.rank] = cloudpickle.loads(payload)
                    elif kind == "error":
                        failures[w.rank] = _Failure.raised(payload)
                    if kind != "dead":
                        del pending[w.rank]
                        continue
                if w.proc.poll() is not None:
                    failures[w.rank] = _Failure.died(w.proc.wait(), w.last_output())
                    del pending[w.rank]
            if failures and failed_at is None:
                failed_at = time.monotonic()
        missing = {r: ("run" if w.ready else "start") for r, w in pending.items()}
        if failed_at is not None:
            waited = time.monotonic() - failed_at
        else:
            waited = self.timeout if started is not None else max(self.timeout, _START_S)
        return results, failures, missing, waited

    def _stacks(self, missing: dict[int, str]) -> dict[int, str]:
        """Ask the ranks that did not answer for their Python stacks (faulthandler)."""
        marks = {}
        for r in missing:
            w = self._workers[r]
            if w.proc.poll() is None:
                marks[r] = w.lines
                w.quiet = True
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGUSR1)
        if marks:
            time.sleep(0.5)
        return {r: self._workers[r].output_since(line) for r, line in marks.items()}

    def _report(
        self,
        name: str,
        failures: dict[int, _Failure],
        missing: dict[int, str],
        waited: float,
        stacks: dict[int, str],
    ) -> str:
        # Deaths first: the other ranks' errors ("Connection reset by peer") often follow.
        order = sorted(failures, key=lambda r: (not failures[r].dead, r))
        lines = []
        if failures:
            what = "; ".join(f"rank {r} {failures[r].summary}" for r in order)
            lines.append(f"{name} failed: {what}.")
        late = sorted(missing)
        if late:
            doing = (
                "did not start (join the process group)"
                if all(s == "start" for s in missing.values())
                else "did not answer"
            )
            if failures:
                lines.append(
                    f"Ranks {late} {doing} within {waited:.0f} s after that and were stopped "
                    f"(they are often waiting in a collective for a failed rank)."
                )
            else:
                done = sorted(set(range(self.world_size)) - set(late))
                lines.append(
                    f"{name} timed out: ranks {late} {doing} within {waited:.0f} s "
                    f"(ProcessPool(timeout={self.timeout:g}))"
                    + (f"; ranks {done} finished." if done else ".")
                    + " A rank that skips a collective leaves the others waiting in it; the "
                    "stacks below show where each rank was."
                )
        for r in order:
            lines.append(f"--- rank {r}: {failures[r].summary} ---\n{failures[r].detail}")
        for r in late:
            stack = stacks.get(r, "").strip()
            lines.append(
                f"--- rank {r}: no answer; where it was ---\n{stack}"
                if stack
                else f"--- rank {r}: no answer ---"
            )
        return "\n".join(lines)

    def close(self) -> None:
        """Shut the workers down cleanly (barrier, then ``destroy_process_group``).

        Example:
            >>> pool = ProcessPool(2)  # doctest: +SKIP
            >>> pool.close()  # doctest: +SKIP
        """
        if self.broken:
            return
        self.broken = True
        for w in self._workers:
            with contextlib.suppress(OSError):
                w.conn.send_bytes(b"close")
        end = time.monotonic() + 30
        for w in self._workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.1, end - time.monotonic()))
        for w in self._workers:
            w.drain()
        self._stop()

    def _stop(self) -> None:
        self.broken = True
        _kill_all(self._workers)

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with module-like objects sent by name.

    Some of torch's modules replace themselves in ``sys.modules`` with an object that is not
    a module (``torch.distributed.config`` and the other config modules are
    ``ConfigModuleInstance``s, a subclass of the module type). cloudpickle sends a module by
    name, but only one of exactly the module type, and fails on such an object; here anything
    that is ``sys.modules[its __name__]`` is imported by name in the worker, as a module is.
    """

    def reducer_override(self, obj: Any) -> Any:
        name = getattr(obj, "__name__", None)
        if (
            isinstance(name, str)
            and type(obj) is not types.ModuleType  # cloudpickle's own rule for modules
            and not isinstance(obj, (type, types.FunctionType))
            and sys.modules.get(name) is obj
        ):
            return importlib.import_module, (name,)
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _unpicklable_globals(fn: Callable[..., Any]) -> list[str]:
    """The globals ``fn`` (and the functions it defines) reads that cannot be pickled."""
    code, names = getattr(fn, "__code__", None), set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    found = []
    for name in sorted(names):
        value = getattr(fn, "__globals__", {}).get(name, None)
        if value is None or type(value) is types.ModuleType:
            continue
        try:
            _dumps(value)
        except Exception as e:
            found.append(f"{name!r} ({type(value).__name__}: {type(e).__name__}: {e})")
    return found


def _pack(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return _dumps((fn, args, kwargs))
    except Exception as e:
        culprits = _unpicklable_globals(fn)
        where = (
            f"{_name(fn)} reads the global {', '.join(culprits)}, which cannot be pickled. "
            f"Create or import it inside the function, or move the function into a module "
            f"of its own that the workers can import (it is then sent by name)."
            if culprits
            else "Pass picklable values (tensors, numbers, plain containers), and create "
            "locks, files or processes inside the function."
        )
        raise TypeError(
            f"cannot send {_name(fn)} and its arguments to the worker processes: "
            f"{type(e).__name__}: {e}. {where}"
        ) from e


def _check_world_size(world_size: object, caller: str) -> None:
    example = "launch(fn, 2)" if caller == "launch" else "ProcessPool(2)"
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"{caller}: world_size must be an int (the number of processes), got "
            f"{world_size!r} of type {type(world_size).__name__}; e.g. {example}."
        )
    if world_size < 1:
        raise ValueError(
            f"{caller}: world_size must be at least 1 (the number of processes to start), "
            f"got {world_size}; e.g. {example} starts 2 processes."
        )


def launch(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once on ``world_size`` fresh processes; return per-rank results.

    Each rank gets its own GPU when CUDA is visible (more ranks than GPUs is refused), else
    the CPU; use :class:`ProcessPool` to choose the device, the timeouts, or to oversubscribe
    GPUs. Workers' output lines are printed with their rank; a rank that raises, dies or
    hangs raises :class:`WorkerError` naming it.

    Raises:
        ValueError: if ``world_size`` is below 1.
        TypeError: if ``world_size`` is not an ``int``, or ``fn`` cannot be pickled.
        WorkerError: if a rank raised, died or did not answer (see :meth:`ProcessPool.run`).

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
    _check_world_size(world_size, "launch")
    task = _pack(fn, args, kwargs)  # before starting processes that could not run it
    with ProcessPool(world_size) as pool:
        return pool._run(_name(fn), task)
