"""``CheckpointManager``: periodic, atomic, optionally asynchronous checkpoints of a training loop.

In the spirit of Orbax's ``CheckpointManager`` and torchtitan's: save every ``save_every``
steps into ``<directory>/step_<n>``, keep the last ``keep_last`` (and every ``keep_every``-th)
complete steps, find the latest complete step, restore from it. Each save is atomic (see
:func:`functional_fsdp.checkpoint.save`), so a crash costs at most the steps since the last
complete checkpoint and never leaves a corrupt one where a restore would look.

With ``async_save=True`` a save copies the tree's local tensors (a staged copy, so later
steps, donation included, cannot change what is written) and writes it on a background
thread over the manager's own gloo process group, so the step loop does not wait for the
disk and the training collectives never interleave with the checkpoint's.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from .._tree import tree_map
from ..distributed import process, teardown
from ..sharded import Sharded
from . import _atomic
from .dcp import _flatten, refuse_simulated
from .dcp import load as _load

_STEP = re.compile(r"^step_(\d+)$")


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def _stage(tree: Any) -> Any:
    """A copy of ``tree``'s tensors (local shards of ``Sharded`` values included)."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def _state_dict(tree: Any) -> dict[str, Any]:
    keys, leaves, _ = _flatten(tree)
    return {k: v.to_dtensor() if isinstance(v, Sharded) else v for k, v in zip(keys, leaves)}


class CheckpointManager:
    """Save every ``save_every`` steps, keep the last few, resume from the latest complete one.

    Construct it on every rank (with a process group it makes its own gloo group, a
    collective). ``save`` and ``restore`` are collective calls; ``latest_step`` and
    ``all_steps`` only read the directory.

    A ``TrainState`` brings its random key (``state.rng``, from which ``train_step`` draws
    dropout) and its step count, so a restored run draws the masks the uninterrupted run
    would have drawn; put what else decides the run in the saved tree, e.g. the data order
    (``gen`` below).

    Args:
        directory: holds one sub-directory ``step_<n>`` per checkpoint (created if needed).
        save_every: :meth:`save` writes when ``step % save_every == 0`` (or ``force=True``).
        keep_last: how many of the newest complete checkpoints to keep (``None``: all).
        keep_every: also keep every step that is a multiple of this (``None``: none).
        async_save: write on a background thread from a staged copy; :meth:`save` returns
            once the copy is made. Call :meth:`wait` or :meth:`close` before exiting.
        preemption_signals: the signals :meth:`reached_preemption` watches for (SIGTERM by
            default, what schedulers send before they stop a job; SLURM can send another,
            e.g. ``signal.SIGUSR1`` with ``--signal=USR1@90``). Their handlers are replaced
            only from the first call of :meth:`reached_preemption`, and put back by
            :meth:`close`: a loop that never asks keeps the default behaviour.
        preemption_check_every: the ranks compare notes every this many steps (one
            asynchronous all-reduce of one integer, waited on at the next check, by when it
            has finished); every rank learns of a signal between 1 and 2 times this many
            steps after it arrived.

    Example:
        >>> mgr = ff.checkpoint.CheckpointManager("ckpt", save_every=100)  # doctest: +SKIP
        >>> start = 0
        >>> if mgr.latest_step() is not None:  # doctest: +SKIP
        ...     ckpt = mgr.restore({"state": state, "data": {"rng": gen.get_state()}})
        ...     state, start = ckpt["state"], ckpt["state"].step
        ...     gen.set_state(ckpt["data"]["rng"])
        >>> for i in range(start, total_steps):  # doctest: +SKIP
        ...     state, metrics = step(state, next_batch(gen))
        ...     mgr.save(state.step, {"state": state, "data": {"rng": gen.get_state()}})
        >>> mgr.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_every: int,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = False,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        preemption_check_every: int = 1,
    ) -> None:
        refuse_simulated("CheckpointManager")
        if not isinstance(save_every, int) or save_every < 1:
            raise ValueError(
                f"CheckpointManager: save_every must be a positive int, got {save_every!r}; "
                f"e.g. save_every=100 saves at steps 100, 200, ..."
            )
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"CheckpointManager: {name} must be a positive int or None, got {value!r}."
                )
        if (
            isinstance(preemption_check_every, bool)
            or not isinstance(preemption_check_every, int)
            or preemption_check_every < 1
        ):
            raise ValueError(
                f"CheckpointManager: preemption_check_every must be a positive int, got "
                f"{preemption_check_every!r}; e.g. preemption_check_every=10 compares the "
                f"ranks' notes every 10 steps."
            )
        self.preemption_signals = _signals(preemption_signals)
        self.preemption_check_every = preemption_check_every
        self._preemption = _Preemption()
        self.directory = Path(os.path.abspath(directory))
        self.save_every = save_every
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self._group = process.new_group("gloo")
        self._rank = process.rank()
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            if async_save
            else None
        )
        self._pending: concurrent.futures.Future[None] | None = None
        self._closed = False
        teardown.close_at_exit(self.close)  # a manager left open still ends before its group
        if self._rank == 0:
            self._remove_stale()
        if self._group is not None:
            process.barrier(self._group)  # every rank sees the cleaned directory

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        """The steps with a complete (committed) checkpoint, ascending.

        Example:
            >>> CheckpointManager("/nonexistent", save_every=10).all_steps()
            []
        """
        if not self.directory.is_dir():
            return []
        steps = []
        for p in self.directory.iterdir():
            m = _STEP.match(p.name)
            if m and _atomic.is_complete(p):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or ``None``; partial saves are ignored.

        Example:
            >>> CheckpointManager("/nonexistent", save_every=10).latest_step() is None
            True
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` writes at ``step`` (without ``force``).

        Example:
            >>> CheckpointManager("/nonexistent", save_every=10).should_save(20)
            True
        """
        return step % self.save_every == 0

    # ------------------------------------------------------------------ save / restore

    def save(self, step: int, tree: Any, *, force: bool = False) -> bool:
        """Checkpoint ``tree`` as ``step`` if ``step % save_every == 0`` or ``force``.

        A collective call. A step that already has a complete checkpoint is not written
        again unless ``force``. With ``async_save``, waits for the previous save (raising its
        error, if any), stages a copy and returns; the write continues in the background.

        Returns:
            whether a save was started.

        Raises:
            CheckpointError: the directory cannot be written (also raised by the next
                ``save``, ``wait`` or ``close`` for a background save).
        """
        self._check_open("save")
        refuse_simulated("CheckpointManager.save")
        if not (force or self.should_save(step)):
            return False
        self.wait()
        target = _step_dir(self.directory, step)
        if not force and _atomic.is_complete(target):
            return False
        if self._executor is None:
            self._write(target, _state_dict(tree), step)
        else:
            staged = _state_dict(_stage(tree))
            self._pending = self._executor.submit(self._write, target, staged, step)
        return True

    def _write(self, target: Path, state_dict: dict[str, Any], step: int) -> None:
        _atomic.save_state_dict(
            target, state_dict, process_group=self._group, metadata={"step": step}
        )
        if self._rank == 0:
            self._apply_retention()

    def wait(self) -> None:
        """Block until a background save has finished; raise its error, if any.

        Example:
            >>> CheckpointManager("/nonexistent", save_every=10).wait()
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------------ preemption

    def reached_preemption(self, step: int) -> bool:
        """Whether to save and stop now: True on every rank at the same step once any rank
        received one of ``preemption_signals``, as Orbax's ``reached_preemption``.

        A collective call: every rank calls it once per step with the same ``step``. The
        first call installs the signal handlers (from the main thread: Python runs handlers
        there), which only note that the signal came; the process keeps running. Every
        ``preemption_check_every`` steps the ranks start one asynchronous all-reduce of
        that note and read the previous one's result, which has long finished: no step
        waits for it. When it says a rank was signalled, every rank returns True at that
        step; the loop then saves with ``force=True``, waits for the save and exits 0, so
        that the scheduler requeues the job and the next attempt resumes from the save.
        Save within the scheduler's grace period (SIGKILL follows it).

        Args:
            step: the step just completed (the one the save will be named after).

        Raises:
            ValueError: the first call is not made from the main thread, or the manager is
                closed.

        Example:
            >>> for i in range(start, total_steps):  # doctest: +SKIP
            ...     state, metrics = step(state, next_batch(gen))
            ...     tree = {"state": state, "data": {"rng": gen.get_state()}}
            ...     if mgr.reached_preemption(state.step):
            ...         mgr.save(state.step, tree, force=True)
            ...         mgr.close()  # waits for the save
            ...         raise SystemExit(0)  # the scheduler requeues the job
            ...     mgr.save(state.step, tree)
        """
        self._check_open("reached_preemption")
        return self._preemption.reached(
            int(step), self.preemption_signals, self.preemption_check_every
        )

    def restore(self, like: Any, step: int | None = None) -> Any:
        """Load the checkpoint of ``step`` (default: the latest complete one) into ``like``.

        A collective call: rank 0 picks the step, so all ranks read the same one. The
        checkpoint is verified (marker, sizes, hashes) before it is read.

        Raises:
            CheckpointError: there is no complete checkpoint, the step has none, or it is
                corrupt.
            ValueError: the checkpoint does not match ``like`` (another model).
        """
        self._check_open("restore")
        refuse_simulated("CheckpointManager.restore")
        self.wait()
        chosen: int | str | None = step
        if self._rank == 0:
            steps = self.all_steps()
            if step is None and not steps:
                chosen = (
                    f"CheckpointManager.restore: no complete checkpoint in "
                    f"{str(self.directory)!r}. Start from scratch when latest_step() is None, "
                    f"or check the directory."
                )
            elif step is not None and step not in steps:
                chosen = (
                    f"CheckpointManager.restore: step {step} has no complete checkpoint in "
                    f"{str(self.directory)!r}; complete steps: {steps}."
                )
            elif step is None:
                chosen = steps[-1]
        chosen = process.broadcast_object(chosen, self._group)
        if isinstance(chosen, str):
            raise _atomic.CheckpointError(chosen)
        return _load(_step_dir(self.directory, int(chosen)), like)

    def close(self) -> None:
        """Finish a background save (raising its error) and release the thread and group.

        Example:
            >>> CheckpointManager("/nonexistent", save_every=10).close()
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            teardown.forget_close(self)
            self._preemption.stop()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._group is not None:
                process.destroy_group(self._group)
                self._group = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ValueError(
                f"CheckpointManager.{what}: this manager for {str(self.directory)!r} was "
                f"closed; make a new one."
            )

    # ------------------------------------------------------------------ housekeeping

    def _apply_retention(self) -> None:
        steps = self.all_steps()
        keep = set(steps if self.keep_last is None else steps[-self.keep_last :])
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                # Rename first: a half-deleted directory never looks like a checkpoint.
                doomed = self.directory / f".step_{s:08d}.deleting-{uuid.uuid4().hex[:8]}"
                os.rename(_step_dir(self.directory, s), doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Remove the temporaries of killed saves; put back a step an overwrite moved aside."""
        if not self.directory.is_dir():
            return
        for p in sorted(self.directory.iterdir()):
            name, _, kind = p.name.partition(".step_")[2].rpartition(".")
            if not p.name.startswith(".step_") or not kind.startswith(
                ("tmp-", "old-", "deleting-")
            ):
                continue
            original = self.directory / f"step_{name}"
            if kind.startswith("old-") and not original.exists() and _atomic.is_complete(p):
                os.rename(p, original)  # an overwrite killed between its two renames
            else:
                shutil.rmtree(p, ignore_errors=True)


def _signals(values: Sequence[int]) -> tuple[signal.Signals, ...]:
    known = {s.value for s in signal.Signals}
    seq = not isinstance(values, (str, bytes, int)) and isinstance(values, Sequence)
    bad = [v for v in values if isinstance(v, bool) or v not in known] if seq else []
    if not seq or bad or not values:
        raise ValueError(
            f"CheckpointManager: preemption_signals must be a non-empty sequence of signals, "
            f"got {values!r}" + (f" ({bad!r} not a signal here)" if bad else "") + "; e.g. "
            "preemption_signals=(signal.SIGTERM,) or (signal.SIGTERM, signal.SIGUSR1)."
        )
    return tuple(signal.Signals(v) for v in values)


class _Preemption:
    """The signal note of one manager, and the ranks' agreement on the step to stop at."""

    def __init__(self) -> None:
        self.signalled: int | None = None  # the signal that came, on this rank
        self.stop_at: int | None = None  # the step every rank agreed to stop at
        self._previous: dict[signal.Signals, Any] = {}
        self._group: process.Group | None = None
        self._vote: Callable[[], int] | None = None  # the all-reduce in flight
        self._started = False

    def reached(self, step: int, signals: tuple[signal.Signals, ...], every: int) -> bool:
        if self.stop_at is not None:
            return step >= self.stop_at
        if not self._started:
            self._start(signals)
        if step % every != 0:
            return False
        vote, self._vote = self._vote, None
        if vote is not None and vote() > 0:  # finished during the steps since it started
            self.stop_at = step
            return True
        self._vote = process.start_max(0 if self.signalled is None else 1, self._group)
        return False

    def _start(self, signals: tuple[signal.Signals, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "CheckpointManager.reached_preemption: the first call installs the signal "
                "handlers, which Python allows only on the main thread; call it from the "
                "training loop on the main thread."
            )
        self._group = process.new_group("gloo")  # collective: the first call is on all ranks
        for s in signals:
            self._previous[s] = signal.signal(s, self._note)
        self._started = True

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signum

    def stop(self) -> None:
        """Put the previous handlers back; finish the vote in flight; end the group."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set in C
        self._previous.clear()
        vote, self._vote = self._vote, None
        if vote is not None:
            vote()
        if self._group is not None:
            process.destroy_group(self._group)
            self._group = None
