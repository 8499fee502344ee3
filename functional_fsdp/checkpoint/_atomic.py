"""Atomic, verified checkpoint directories on top of torch Distributed Checkpoint (DCP).

A save is visible only once it is complete:

1. rank 0 makes a fresh temporary directory ``.<name>.tmp-<id>`` next to the target;
2. every rank writes its DCP files there (``sync_files=True``: each file is fsynced);
3. every rank measures and hashes (CRC-32) the files it wrote; rank 0 gathers the lists and
   writes the commit marker ``COMMIT.json`` (sizes and hashes of every file), fsynced;
4. rank 0 renames the temporary directory onto the target (an existing target is first moved
   aside to ``.<name>.old-<id>`` and deleted afterwards) and fsyncs the parent directory.

A save killed at any point leaves either the previous checkpoint or the new one under the
target name; temporaries are ignored by :func:`resolve` and removed by the next save. If the
kill falls between the two renames of an overwrite (the target is briefly absent), loading
the target reads the previous checkpoint from its aside name.

:func:`verify` checks that the marker exists and that every file has its recorded size and
hash before anything is read. Hashing reads every byte once, split across the ranks.

Every failure raises :class:`CheckpointError` (an ``OSError``) naming the directory and the
problem, on every rank, never DCP's ``CheckpointException`` (a ``BaseException``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from ..distributed import process

MARKER = "COMMIT.json"
FORMAT = "functional_fsdp.checkpoint/1"
_CHUNK = 8 << 20

# Test-only seam: called with the name of each phase of a save (to inject crashes).
_on_phase: Callable[[str], None] | None = None


class CheckpointError(OSError):
    """A checkpoint could not be written or read: missing, incomplete, corrupt or unwritable.

    An ``OSError``, so ``except Exception`` and ``except OSError`` catch it. The message names
    the directory, the problem and the fix. A checkpoint whose keys or shapes do not match
    the template raises ``ValueError`` instead.

    Example:
        >>> import functional_fsdp as ff
        >>> ff.checkpoint.load("/nonexistent/step_5", {})
        Traceback (most recent call last):
        ...
        functional_fsdp.checkpoint._atomic.CheckpointError: checkpoint.load: no checkpoint at '/nonexistent/step_5': the directory does not exist. Check the path (ff.checkpoint.CheckpointManager.latest_step() finds the newest complete step).
    """


def _phase(name: str) -> None:
    if _on_phase is not None:
        _on_phase(name)


def _group_info(group: Any) -> tuple[int, int, bool]:
    return process.rank(group), process.world_size(group), process.is_initialized()


def _agree(error: str | None, group: Any) -> None:
    """Raise the same :class:`CheckpointError` on every rank if any rank reports an error."""
    errors = [e for e in process.gather_objects(error, group) if e]
    if errors:
        raise CheckpointError(errors[0] if len(set(errors)) == 1 else "\n".join(errors))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str | os.PathLike[str]) -> dict[str, int]:
    """``{"size": bytes, "crc32": hash}`` of one file (read in 8 MiB chunks)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": crc}


class _Recording:
    """A file stream that remembers the first ``OSError`` its writes raise."""

    def __init__(self, stream: Any, fs: _RecordingFS) -> None:
        self._stream, self._fs = stream, fs

    def _record(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            self._fs.first_error = self._fs.first_error or e
            raise

    def write(self, b: Any) -> int:
        return self._record(self._stream.write, b)

    def flush(self) -> None:
        self._record(self._stream.flush)

    def close(self) -> None:
        self._record(self._stream.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RecordingFS(FileSystem):
    """DCP's file system, remembering the first failed write (e.g. ``ENOSPC``).

    ``torch.save`` turns a failed write into ``RuntimeError: ... unexpected pos`` (the
    ``OSError`` is lost inside its C++ zip writer); the remembered error says what happened.
    """

    first_error: OSError | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _Recording(stream, self)
        except OSError as e:
            self.first_error = self.first_error or e
            raise


class _Writer(dcp.FileSystemWriter):
    """DCP's writer, reporting the phase between this rank's data files and the metadata,
    and remembering the first failed file write."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _RecordingFS()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()
        _phase("data_written")
        return future


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        failures = getattr(exc, "_failures", {}) or {}
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = getattr(failure, "exc", failure)
            if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
                inner = inner[0]  # DCP keeps (exception, traceback frames)
            parts.append(f"rank {rank}: {_describe(inner)}")
        return "; ".join(parts) or str(exc)
    text = f"{type(exc).__name__}: {exc}"
    if "unexpected pos" in text:  # torch.save's zip writer after a short write
        text += " (a file write was cut short: is the disk full?)"
    return text


def _fix_for(message: str) -> str:
    if any(m in message for m in ("No space left", "File too large", "Errno 28", "cut short")):
        return "Free disk space (or choose another directory) and save again."
    if "Permission denied" in message or "Read-only" in message or "Errno 13" in message:
        return "Choose a writable directory, or fix its permissions, and save again."
    return "Fix the cause above and save again."


def save_state_dict(
    path: str | os.PathLike[str],
    state_dict: dict[str, Any],
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write a DCP ``state_dict`` to ``path`` atomically, with a verified commit marker.

    A collective over ``process_group`` (default: the whole world). Every rank returns once
    the checkpoint is visible under ``path``, or raises the same :class:`CheckpointError`.

    Args:
        path: the checkpoint directory; an existing one is replaced only once the new one
            is complete.
        state_dict: what ``torch.distributed.checkpoint.save`` takes.
        process_group: the group the save runs over (a background saver passes its own).
        metadata: JSON-serialisable values stored in the marker (e.g. the step).
    """
    path = Path(os.path.abspath(path))
    rank, world, distributed = _group_info(process_group)
    where = f"checkpoint.save: cannot save to {str(path)!r}"

    tmp: Path | None = None
    error = None
    if rank == 0:
        error = _not_a_checkpoint(path, where)
    if rank == 0 and error is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
            tmp.mkdir()
        except OSError as e:
            error = (
                f"{where}: {_describe(e)}. {_fix_for(str(e))} The previous checkpoint at this "
                f"path, if any, is untouched."
            )
    tmp, error = process.broadcast_object((tmp, error), process_group)
    if error or tmp is None:
        raise CheckpointError(error or f"{where}: rank 0 made no temporary directory")
    _phase("started")

    writer = _Writer(tmp, sync_files=True)
    try:
        with _single_process_quiet(distributed):
            dcp.save(
                state_dict,
                storage_writer=writer,
                process_group=process_group,
                no_dist=not distributed,
            )
    except (CheckpointException, OSError, RuntimeError) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = writer.fs.first_error
        msg = _describe(cause) if cause is not None else _describe(e)
        raise CheckpointError(
            f"{where}: writing the files failed ({msg}). {_fix_for(msg)} The previous "
            f"checkpoint at this path, if any, is untouched."
        ) from None
    _phase("written")

    # Each rank hashes the files it wrote (DCP names them __<rank>_<n>.distcp).
    mine: dict[str, dict[str, int]] = {}
    error = None
    try:
        for f in sorted(tmp.glob(f"__{rank}_*")):
            mine[f.name] = file_digest(f)
    except OSError as e:
        error = f"{where}: hashing the files failed: {_describe(e)}"
    _agree(error, process_group)
    per_rank = process.gather_objects(mine, process_group)

    error = None
    if rank == 0:
        try:
            _commit(path, tmp, per_rank, world, metadata or {})
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = (
                f"{where}: committing failed: {_describe(e)}. {_fix_for(str(e))} The previous "
                f"checkpoint at this path, if any, is untouched."
            )
    _agree(error, process_group)


def _not_a_checkpoint(path: Path, where: str) -> str | None:
    """Why ``path`` must not be replaced by a save: it exists and is not a checkpoint.

    A save replaces its target whole; a file or a directory of other files there would be
    deleted. An empty directory, a committed checkpoint and a plain DCP directory (with
    ``.metadata``) may be replaced.
    """
    if not (path.exists() or path.is_symlink()):
        return None
    if not path.is_dir():
        return (
            f"{where}: it is a file, not a checkpoint directory. A save writes a directory "
            f"and would replace the file. Save into a new directory, e.g. "
            f"{str(path.parent / 'step_100')!r}, or remove the file first."
        )
    fix = (
        f"A save replaces its target directory whole. Save into a new directory, e.g. "
        f"{str(path / 'step_100')!r}, or remove this one first."
    )
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return None  # unreadable: the save itself reports the real problem
    if names and MARKER not in names and ".metadata" not in names:
        shown = names[:5] + (["..."] if len(names) > 5 else [])
        return (
            f"{where}: the directory exists and is not a checkpoint (it holds {shown}), so "
            f"saving would delete those files. {fix}"
        )
    return None


def _commit(
    path: Path, tmp: Path, per_rank: list[dict[str, dict[str, int]]], world: int, meta: dict
) -> None:
    files: dict[str, dict[str, int]] = {}
    for part in per_rank:
        files.update(part)
    for f in sorted(tmp.iterdir()):  # .metadata and anything no rank claimed
        if f.name not in files:
            files[f.name] = file_digest(f)
    marker = {
        "format": FORMAT,
        "world_size": world,
        "time": time.time(),
        "metadata": meta,
        "files": files,
    }
    staging = tmp / (MARKER + ".tmp")
    with open(staging, "w") as fh:
        json.dump(marker, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(staging, tmp / MARKER)
    _fsync_dir(tmp)
    _phase("committed")

    if path.exists() or path.is_symlink():
        os.rename(path, path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}")
        _phase("moved_aside")
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    _phase("renamed")
    # Leftovers of this save and of saves killed earlier: never a complete checkpoint now.
    for stale in path.parent.glob(f".{path.name}.*-*"):
        if stale.name.startswith((f".{path.name}.tmp-", f".{path.name}.old-")):
            shutil.rmtree(stale, ignore_errors=True)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a committed checkpoint (its marker exists; files not hashed)."""
    return (Path(path) / MARKER).is_file()


def resolve(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The committed directory for ``path`` and its marker, or a :class:`CheckpointError`.

    If ``path`` is absent because an overwrite was killed between its two renames, the
    previous checkpoint is found under its aside name ``.<name>.old-<id>``.
    """
    path = Path(os.path.abspath(path))
    where = f"checkpoint.load: {str(path)!r}"
    if not path.exists():
        aside = [p for p in path.parent.glob(f".{path.name}.old-*") if is_complete(p)]
        if aside:
            path = max(aside, key=lambda p: (p / MARKER).stat().st_mtime)
        else:
            raise CheckpointError(
                f"checkpoint.load: no checkpoint at {str(path)!r}: the directory does not "
                f"exist. Check the path (ff.checkpoint.CheckpointManager.latest_step() finds "
                f"the newest complete step)."
            )
    if not path.is_dir():
        raise CheckpointError(f"{where} is not a directory. Pass a checkpoint directory.")
    marker_path = path / MARKER
    if not marker_path.is_file():
        if (path / ".metadata").is_file():
            raise CheckpointError(
                f"{where} is incomplete: it has no commit marker {MARKER}. Its save did not "
                f"finish, or it was written by torch.distributed.checkpoint.save directly. "
                f"Load the previous checkpoint, or, if you know this one is whole, pass "
                f"verify=False."
            )
        raise CheckpointError(
            f"{where} is incomplete or not a checkpoint: it has neither a commit marker "
            f"{MARKER} nor DCP's .metadata (a save into it was killed). Load the previous "
            f"checkpoint."
        )
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        if marker.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"unknown format {marker.get('format')!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{where} is corrupt: its commit marker {MARKER} cannot be read ({e}). Load the "
            f"previous checkpoint."
        ) from None
    return path, marker


def _check_files(path: Path, files: dict[str, dict[str, int]], mine: list[str]) -> str | None:
    where = f"checkpoint.load: {str(path)!r} is corrupt"
    for name, want in files.items():
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            return f"{where}: the file {name} is missing. Load the previous checkpoint."
        if size != want["size"]:
            return (
                f"{where}: the file {name} has {size} bytes, but {want['size']} were written "
                f"(truncated or overwritten). Load the previous checkpoint."
            )
    for name in mine:
        got = file_digest(path / name)
        if got["crc32"] != files[name]["crc32"]:
            return (
                f"{where}: the file {name} does not match its recorded CRC-32 (its bytes "
                f"changed after the save). Load the previous checkpoint."
            )
    return None


def verify(path: str | os.PathLike[str], *, process_group: Any = None) -> Path:
    """Check the checkpoint at ``path`` before reading it; return the directory to read.

    Rank 0 resolves the directory and reads the marker; every rank checks the sizes of all
    files and hashes its share of them (``1/world`` of the bytes); all ranks agree on the
    outcome. Without a process group, one process checks everything.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete or corrupt (on every rank).

    Example:
        >>> verify("/nonexistent/ckpt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functional_fsdp.checkpoint._atomic.CheckpointError: checkpoint.load: no checkpoint at '/nonexistent/ckpt': ...
    """
    rank, world, _ = _group_info(process_group)
    found: tuple[Path, dict[str, Any]] | str | None = None
    if rank == 0:
        try:
            found = resolve(path)
        except CheckpointError as e:
            found = str(e)
    found = process.broadcast_object(found, process_group)
    if not isinstance(found, tuple):
        raise CheckpointError(str(found))
    directory, marker = found
    names = sorted(marker["files"])
    try:
        error = _check_files(directory, marker["files"], names[rank::world])
    except OSError as e:
        error = f"checkpoint.load: {str(directory)!r} cannot be read: {_describe(e)}"
    _agree(error, process_group)
    return directory


def describe_error(path: str | os.PathLike[str], exc: BaseException) -> CheckpointError:
    """DCP's exception (a ``BaseException``) while reading ``path`` as a CheckpointError."""
    return CheckpointError(
        f"checkpoint.load: reading {os.fspath(path)!r} failed: {_describe(exc)}. The "
        f"checkpoint is damaged or incomplete; load the previous checkpoint."
    )


def load_state_dict(path: str | os.PathLike[str], state_dict: dict[str, Any]) -> None:
    """``dcp.load`` into ``state_dict``; its failures raised as :class:`CheckpointError`."""
    try:
        with _single_process_quiet(process.is_initialized()):
            dcp.load(state_dict, checkpoint_id=os.fspath(path))
    except CheckpointException as e:  # a BaseException: `except Exception` would miss it
        raise describe_error(path, e) from None


@contextlib.contextmanager
def _single_process_quiet(distributed: bool) -> Iterator[None]:
    """Silence DCP's warning that one process without a process group works alone."""
    if distributed:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
