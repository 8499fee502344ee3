"""Differentiable collectives over named mesh axes. The only module that talks to c10d.

Each collective is an ``autograd.Function`` with ``setup_context`` built on the c10d
functional ops, so it works under plain autograd and inside ``torch.func.grad``,
``grad_and_value`` and ``vjp``. Transposes:

* :func:`all_gather` and :func:`reduce_scatter` are each other's transpose.
* :func:`all_reduce` (forward psum, backward identity) and :func:`all_reduce_grad`
  (forward identity, backward psum) are each other's transpose; these are Megatron's
  ``reduce_from`` and ``copy_to``.

Every call is recorded by the active :func:`count_comms` counters. A collective over an axis
of size 1 is skipped and not counted.

Failures are named. A collective that times out or loses a peer raises
:class:`CollectiveError`, which says which collective, over which mesh axis, with which shape
and dtype, what usually causes it and how to change the timeout. With
:func:`check_collectives` (or ``FUNCTIONAL_FSDP_CHECK=1``) every rank first checks that all
ranks of the group issue the same collective with the same shapes and dtypes, and
:func:`check_same_on_ranks` checks that values meant to be replicated are.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from .._tree import keystr
from ..spec import format_mesh
from .mesh import axis_sizes
from .simulate import check_alive, is_simulated

ReduceOp = Literal["sum", "mean"]


# --------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class CommRecord:
    """One collective issued by this rank.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        axis: the mesh axis it ran over.
        group_size: ranks in the group.
        bytes: bytes this rank sends in a ring implementation: ``(n-1)/n`` of the gathered
            (all-gather) or input (reduce-scatter) buffer, twice that for all-reduce.
        dtype: element type of the buffer.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 4}) as mesh:
        ...     with ff.count_comms() as comms:
        ...         _ = ff.all_reduce(torch.ones(8), mesh, "dp")
        ...     record = comms.records[0]
        ...     record.kind, record.axis, record.bytes  # ring all-reduce: 2 * 32 * 3/4
        ('all_reduce', 'dp', 48)
    """

    kind: str
    axis: str
    group_size: int
    bytes: int
    dtype: torch.dtype


@dataclass
class CommCounter:
    """Collectives recorded inside a :func:`count_comms` block.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = ff.shard(torch.ones(4, 4), mesh, ff.P("dp"))
        ...     with ff.count_comms() as comms:
        ...         _ = ff.gather(w)
        ...     comms.count("all_gather"), comms.bytes("all_gather")
        (1, 32)
    """

    records: list[CommRecord] = field(default_factory=list)

    def count(self, kind: str | None = None, axis: str | None = None) -> int:
        """Number of collectives, optionally of one kind and/or over one axis."""
        return sum(1 for r in self._select(kind, axis))

    def bytes(self, kind: str | None = None, axis: str | None = None) -> int:
        """Bytes sent per rank, optionally of one kind and/or over one axis."""
        return sum(r.bytes for r in self._select(kind, axis))

    def by_kind_and_axis(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(kind, axis): (count, bytes)}``."""
        out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            out[(r.kind, r.axis)][0] += 1
            out[(r.kind, r.axis)][1] += r.bytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def summary(self) -> str:
        """A small text table of counts and bytes by kind and axis."""
        lines = [f"{'kind':<16}{'axis':<12}{'count':>7}{'bytes':>14}"]
        for (kind, axis), (n, b) in sorted(self.by_kind_and_axis().items()):
            lines.append(f"{kind:<16}{axis:<12}{n:>7}{b:>14,}")
        return "\n".join(lines)

    def clear(self) -> None:
        self.records.clear()

    def _select(self, kind: str | None, axis: str | None) -> Iterator[CommRecord]:
        return (
            r
            for r in self.records
            if (kind is None or r.kind == kind) and (axis is None or r.axis == axis)
        )


_COUNTERS: contextvars.ContextVar[tuple[CommCounter, ...]] = contextvars.ContextVar(
    "functional_fsdp_comm_counters", default=()
)


@contextlib.contextmanager
def count_comms() -> Iterator[CommCounter]:
    """Record every collective this library issues inside the block (nestable).

    Backward-pass collectives are recorded too, as long as backward runs inside the block.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = ff.shard(torch.ones(4, 4), mesh, ff.P("dp"))
        ...     with ff.count_comms() as comms:
        ...         _ = torch.func.grad(lambda w: ff.gather(w).sum())(w)
        ...     print(comms.summary())  # doctest: +NORMALIZE_WHITESPACE
        kind axis count bytes
        all_gather dp 1 32
        reduce_scatter dp 1 32
    """
    counter = CommCounter()
    token = _COUNTERS.set((*_COUNTERS.get(), counter))
    try:
        yield counter
    finally:
        _COUNTERS.reset(token)


def active_counters() -> tuple[CommCounter, ...]:
    """The counters of the enclosing :func:`count_comms` blocks.

    The FSDP engine reads them once when ``apply`` starts and hands them to every collective
    of that call, backward included (autograd's worker threads do not inherit context
    variables).
    """
    return _COUNTERS.get()


Counters = tuple[CommCounter, ...] | None


def _record(
    kind: str, axis: str, n: int, buffer_bytes: int, dtype: torch.dtype, counters: Counters
) -> None:
    if counters is None:
        counters = _COUNTERS.get()
    if counters:
        factor = 2 if kind == "all_reduce" else 1
        rec = CommRecord(kind, axis, n, factor * buffer_bytes * (n - 1) // n, dtype)
        for c in counters:
            c.records.append(rec)


# --------------------------------------------------------------------------- failures


class CollectiveError(dist.DistError):
    """A collective failed: it timed out waiting for the other ranks, or a peer went away.

    The message names the collective, the mesh axis (with the mesh's axis names and sizes),
    the buffer's shape and dtype, and this rank, then says what usually causes it (another
    rank raised, skipped a collective or died) and how to change the timeout. The backend's
    own error is chained as ``__cause__``. A ``torch.distributed.DistError``, so code that
    catches torch's distributed errors catches it too. Raised where the backend reports the
    failure to the waiting rank: always on gloo; on NCCL torch's watchdog ends the process
    instead, unless ``TORCH_NCCL_BLOCKING_WAIT=1``.

    Example:
        >>> raise CollectiveError("all_gather over mesh axis 'dp' ... failed")
        Traceback (most recent call last):
        ...
        functional_fsdp.distributed.collectives.CollectiveError: all_gather over mesh axis 'dp' ... failed
    """


# (kind, mesh, axis, shape, dtype): what a pending collective is, for its error message.
# Built per collective from values at hand, and formatted only when something fails.
_What = tuple[str, DeviceMesh, str, torch.Size, torch.dtype]

_CAUSES = (
    "The other ranks of this group did not take part in time. Usually one of them raised an "
    "exception (look for its traceback first), skipped a collective (a branch, a loop or an "
    "early return that differs between ranks), or its process died (out of memory, killed)."
)


def _timeout_of(group: Any, device_type: str) -> str:
    try:
        seconds = group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
    except Exception:  # pragma: no cover - backends without readable options
        return "unknown"
    return f"{seconds:g} s"


def _failure(what: _What | None, error: BaseException, phase: str = "") -> CollectiveError:
    """A :class:`CollectiveError` for ``what`` that failed with the backend's ``error``."""
    backend = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    rank = dist.get_rank() if dist.is_initialized() else 0
    if what is None:
        head = f"a collective failed on rank {rank}"
        limit = "unknown"
    else:
        kind, mesh, axis, shape, dtype = what
        group = mesh.get_group(axis)
        try:
            ranks = dist.get_process_group_ranks(group)
        except Exception:  # pragma: no cover
            ranks = []
        sizes = axis_sizes(mesh)
        head = (
            f"{kind}{phase} over mesh axis {axis!r} (size {sizes[axis]}) of the mesh "
            f"{format_mesh(sizes)} failed on rank {rank}, waiting for global ranks {ranks}: "
            f"this rank's buffer is {str(dtype).removeprefix('torch.')} of shape {tuple(shape)}"
        )
        limit = _timeout_of(group, mesh.device_type)
    return CollectiveError(
        f"{head}.\n  backend: {backend}\n{_CAUSES} If a rank is only slow (saving a "
        f"checkpoint, evaluating or loading data on one rank), raise the limit (now {limit}): "
        f"ff.init_distributed(timeout=datetime.timedelta(minutes=30)) before make_mesh, or "
        f"FUNCTIONAL_FSDP_TIMEOUT=1800 in the environment. To find a collective that differs "
        f"between ranks, run with FUNCTIONAL_FSDP_CHECK=1."
    )


def _tag(out: torch.Tensor, what: _What) -> torch.Tensor:
    """Remember what an async result is, so that :func:`wait` can name it if it fails."""
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out._ff_what = what  # type: ignore[attr-defined]
    return out


def _wait_tensor(t: torch.Tensor, what: _What, phase: str = "") -> torch.Tensor:
    try:
        return torch.ops._c10d_functional.wait_tensor(t)
    except RuntimeError as e:
        raise _failure(what, e, phase) from e


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# --------------------------------------------------------------------------- debug checks


def _env_check() -> bool:
    return os.environ.get("FUNCTIONAL_FSDP_CHECK", "").strip().lower() not in ("", "0", "false")


# The debug switch: read from the environment at import (and by init_distributed), set by
# check_collectives(). A plain module constant, not a context variable: the hot path reads
# one global, autograd's backward threads see it, and a compiled step treats it as a constant.
_CHECK = _env_check()
_SEQUENCE: dict[str, int] = {}  # group name -> collectives checked on it (debug mode only)
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "same_on_ranks")
_MAX_DIMS = 8


@contextlib.contextmanager
def check_collectives(enabled: bool = True) -> Iterator[None]:
    """Debug mode: check, before each collective, that every rank issues the same one.

    Inside the block (or in a whole run with ``FUNCTIONAL_FSDP_CHECK=1`` in the environment),
    every collective of this library first all-gathers a small signature (kind, mesh axis,
    shape, dtype, reduction, a hash of the values' description, and its position in the
    sequence of collectives on that axis) and raises ``ValueError`` naming the ranks and the
    values that disagree, instead of reinterpreting bytes or hanging. The FSDP engine's
    buckets are described by each parameter's name, global shape and spec, so ranks running
    differently-shaped models are caught even where their buckets have the same size, and
    the message names the first parameter that differs. :func:`shard
    <functional_fsdp.shard>` also checks that it got the same values on every rank.

    It costs one extra small all-gather and one host sync per collective: a debugging aid,
    off by default. Enter it on every rank at the same point (it changes the collectives
    issued). Simulated meshes run one program for all ranks and are not checked.

    Args:
        enabled: turn checking on (``False`` turns it off inside the block).

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.check_collectives():
        ...     pass  # mesh = ff.make_mesh({"dp": 2}); ... every collective is checked
    """
    global _CHECK
    previous, _CHECK = _CHECK, enabled
    try:
        yield
    finally:
        _CHECK = previous


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_call(
    kind: str,
    axis: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    op: str | None,
    meta: Any,
    seq: int,
    skip: int = 0,
) -> str:
    """One rank's collective, for a mismatch message; ``skip`` leading items of a sequence
    ``meta`` that agree on every rank are counted, not shown (the difference shows)."""
    text = f"{kind} #{seq} over {axis!r} of {_dtype_name(dtype)} {tuple(shape)}"
    if op is not None:
        text += f" ({op})"
    if meta is not None:
        extra = repr(meta)
        if skip and isinstance(meta, (tuple, list)):
            extra = f"{skip} matching item{'s' if skip > 1 else ''}, then {tuple(meta[skip:])!r}"
        text += f" holding {extra if len(extra) <= 300 else extra[:295] + ' ...'}"
    return text


def _agreeing(metas: Sequence[Any]) -> int:
    """How many leading items the ranks' ``meta`` sequences share (0 unless all are sequences)."""
    if not all(isinstance(m, (tuple, list)) for m in metas):
        return 0
    n = min(len(m) for m in metas)
    return next((i for i in range(n) if any(m[i] != metas[0][i] for m in metas)), n)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _signature(
    kind: str,
    axis: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    op: str | None,
    meta: Any,
    seq: int,
) -> list[int]:
    dims = list(shape)[:_MAX_DIMS]
    rest = _crc(repr(tuple(shape)[_MAX_DIMS:])) if len(shape) > _MAX_DIMS else 0
    return [
        seq,
        _KINDS.index(kind),
        _crc(axis),
        _crc(str(dtype)),
        _crc(op or ""),
        0 if meta is None else _crc(repr(meta)),
        len(shape),
        rest,
        *dims,
        *([-1] * (_MAX_DIMS - len(dims))),
    ]


def _exchange(
    mine: torch.Tensor, mesh: DeviceMesh, axis: str, what: _What, phase: str
) -> torch.Tensor:
    """All-gather ``mine`` over ``axis`` at once (blocking; for checks, never on the hot path)."""
    group = mesh.get_group(axis)
    n = group.size()
    with torch.no_grad(), torch._C._DisableFuncTorch():
        out = torch.ops._c10d_functional.all_gather_into_tensor(
            mine.contiguous(), n, group.group_name
        )
        return _wait_tensor(out, what, phase).view(n, *mine.shape)


def _group_ranks(mesh: DeviceMesh, axis: str) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group(axis))


def _by_value(ranks: list[int], values: list[str]) -> str:
    """``  ranks [0, 2]: value`` lines, one per distinct value, in order of first rank."""
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    return "\n".join(
        f"  rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {v}"
        for v, rs in groups.items()
    )


def _check_collective(
    kind: str,
    mesh: DeviceMesh,
    axis: str,
    x: torch.Tensor,
    op: str | None = None,
    meta: Any = None,
) -> None:
    """Debug mode: raise unless every rank of ``axis``'s group issues this same collective."""
    if is_simulated() or torch.compiler.is_compiling():
        return
    group = mesh.get_group(axis)
    seq = _SEQUENCE[group.group_name] = _SEQUENCE.get(group.group_name, 0) + 1
    shape, dtype = tuple(x.shape), x.dtype
    sig = _signature(kind, axis, shape, dtype, op, meta, seq)
    mine = torch.tensor(sig, dtype=torch.int64, device=_mesh_device(mesh))
    what: _What = (kind, mesh, axis, x.shape, dtype)
    rows = _exchange(mine, mesh, axis, what, " (its debug check)").tolist()
    if all(row == rows[0] for row in rows):
        return
    calls: list[Any] = [None] * len(rows)  # every rank's (kind, axis, ..., meta, seq)
    dist.all_gather_object(calls, (kind, axis, shape, dtype, op, meta, seq), group=group)
    skip = _agreeing([call[5] for call in calls])
    descriptions = [_describe_call(*call, skip=skip) for call in calls]
    sizes = axis_sizes(mesh)
    raise ValueError(
        f"collective mismatch over mesh axis {axis!r} of the mesh {format_mesh(sizes)}: the "
        f"ranks of this group issue different collectives (found by FUNCTIONAL_FSDP_CHECK / "
        f"ff.check_collectives()).\n{_by_value(_group_ranks(mesh, axis), descriptions)}\n"
        f"Every rank of a mesh axis must issue the same collectives, in the same order, with "
        f"the same shapes and dtypes. Look for code that differs between ranks: a branch on "
        f"the rank, a data-dependent shape or number of steps, or values that differ per rank."
    )


def _fingerprint(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A position-weighted checksum of ``t``'s bytes (int64) and its sum (float64)."""
    flat = t.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    checksum = torch.zeros((), dtype=torch.int64, device=t.device)
    chunk = 1 << 22
    for start in range(0, raw.numel(), chunk):
        part = raw[start : start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=t.device) % 65521 + 1
        checksum = checksum + (part * weights).sum()
    total = flat.to(torch.complex128).real.sum() if flat.is_complex() else flat.double().sum()
    return checksum, total


def check_same_on_ranks(
    mesh: DeviceMesh, paths: Sequence[tuple[Any, ...]], leaves: Sequence[Any], where: str
) -> None:
    """Debug mode: raise unless every tensor in ``leaves`` is bitwise the same on all ranks.

    A hook for functions that take values every rank must hold identically, such as
    :func:`~functional_fsdp.shard`. Does nothing unless :func:`check_collectives` (or
    ``FUNCTIONAL_FSDP_CHECK=1``) is on, on a simulated mesh, or for meta tensors. Otherwise
    it compares a checksum of each tensor's bytes over every mesh axis (one small all-gather
    per axis) and raises ``ValueError`` naming the key path, the shape and the ranks.

    Args:
        mesh: the mesh whose ranks must agree.
        paths: key paths (tuples of keys) of ``leaves``, for the message.
        leaves: the values; non-tensors are skipped.
        where: the caller, e.g. ``"shard()"``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:  # simulated: nothing to compare
        ...     check_same_on_ranks(mesh, [("w",)], [torch.ones(2)], "shard()")
    """
    if not _CHECK or is_simulated():
        return
    named = [
        (path, t)
        for path, t in zip(paths, leaves)
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    ]
    sizes = axis_sizes(mesh)
    axes = [a for a, n in sizes.items() if n > 1]
    if not axes:
        return
    device = _mesh_device(mesh)
    prints = [_fingerprint(t) for _, t in named]
    checksums = torch.tensor([int(c) for c, _ in prints], dtype=torch.int64, device=device)
    sums = torch.tensor([float(s) for _, s in prints], dtype=torch.float64, device=device)
    mine = torch.stack([checksums, sums.view(torch.int64)], dim=1)  # [leaves, 2]
    layout = [(keystr(p), tuple(t.shape), _dtype_name(t.dtype)) for p, t in named]
    for axis in axes:
        what: _What = ("same_on_ranks", mesh, axis, mine.shape, mine.dtype)
        _check_collective("same_on_ranks", mesh, axis, mine, meta=layout)
        rows = _exchange(mine, mesh, axis, what, f" (the {where} check)")  # [n, leaves, 2]
        differs = (rows[:, :, 0] != rows[:1, :, 0]).any(0).nonzero().flatten().tolist()
        if differs:
            i = differs[0]
            ranks = _group_ranks(mesh, axis)
            values = [
                f"checksum {int(c):#x}, sum {float(s):.9g}"
                for c, s in zip(rows[:, i, 0].tolist(), rows[:, i, 1].view(torch.float64).tolist())
            ]
            path, shape, dtype = layout[i]
            more = f" ({len(differs) - 1} more leaves differ too)" if len(differs) > 1 else ""
            raise ValueError(
                f"{where}: {path} ({dtype} {shape}) differs between the ranks of mesh axis "
                f"{axis!r} of {format_mesh(sizes)}{more}, but {where} takes the full value, the "
                f"same on every rank:\n{_by_value(ranks, values)}\nCreate it from the same seed "
                f"on every rank (torch.manual_seed before building the model), or load it from "
                f"the same file; for per-rank data, pass each rank's block to "
                f"ff.Sharded(local, global_shape, spec, mesh) instead."
            )


# --------------------------------------------------------------------------- raw ops


def _group(mesh: DeviceMesh, axis: str) -> Any:
    try:
        return mesh.get_group(axis)
    except RuntimeError:  # a mesh whose simulation has ended: say so, and how to fix it
        check_alive(mesh, f"a collective over {axis!r}")
        raise


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    # A simulated LocalTensor's .contiguous() is an autograd.Function that torch.func
    # transforms refuse, even when there is nothing to do: skip it when already contiguous.
    return x if x.is_contiguous() else x.contiguous()


def _group_name(mesh: DeviceMesh, axis: str) -> str:
    return _group(mesh, axis).group_name


def _issued(out: torch.Tensor, what: _What) -> torch.Tensor:
    """Wrap a c10d functional op's result so that it waits on first use (or in :func:`wait`).

    Under ``torch.func`` transforms the result is a functorch wrapper, and an
    ``AsyncCollectiveTensor`` inside it would never be unwrapped: it would leak into the
    gradients that ``torch.func.grad`` returns (hiding a simulated value's per-rank tensors).
    There the collective is waited on at once.
    """
    if torch._C._functorch.is_functorch_wrapped_tensor(out):
        return _wait_tensor(out, what)
    return _tag(funcol._maybe_wrap_tensor(out), what)


def raw_all_gather(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """All-gather ``x`` over ``axis`` along a new leading dim: ``[size(axis), *x.shape]``.

    Not differentiable; returns an async tensor that waits on first use. ``meta`` describes
    the values packed in ``x`` (e.g. their shapes and specs) for the debug check of
    :func:`check_collectives`; it is not read otherwise.
    """
    n = axis_sizes(mesh)[axis]
    if n == 1:
        return x.unsqueeze(0)
    if _CHECK:
        _check_collective("all_gather", mesh, axis, x, None, meta)
    x = _contiguous(x)
    _record("all_gather", axis, n, _nbytes(x) * n, x.dtype, counters)
    what: _What = ("all_gather", mesh, axis, x.shape, x.dtype)
    with torch.no_grad():
        out = _issued(
            torch.ops._c10d_functional.all_gather_into_tensor(
                x.reshape(-1), n, _group_name(mesh, axis)
            ),
            what,
        )
    return _tag(out.view(n, *x.shape), what)


def raw_reduce_scatter(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    op: ReduceOp = "sum",
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """Reduce ``x`` (shape ``[size(axis), *rest]``) over ``axis`` and keep row ``index(axis)``.

    Not differentiable; the result may be an async tensor that waits on first use. ``meta``
    as for :func:`raw_all_gather`.
    """
    n = axis_sizes(mesh)[axis]
    if x.shape[0] != n:
        raise ValueError(f"reduce_scatter over {axis!r} needs a leading dim of {n}, got {x.shape}")
    if n == 1:
        out = x[0]
    else:
        if _CHECK:
            _check_collective("reduce_scatter", mesh, axis, x, op, meta)
        x = _contiguous(x)
        _record("reduce_scatter", axis, n, _nbytes(x), x.dtype, counters)
        what: _What = ("reduce_scatter", mesh, axis, x.shape, x.dtype)
        ops, group = torch.ops._c10d_functional, _group_name(mesh, axis)
        with torch.no_grad():
            if _direct_reduce_scatter(mesh, axis):  # see raw_reduce_scatter_start
                rows = [x[0].numel()] * n
                received = ops.all_to_all_single(x.reshape(-1), rows, rows, group)
                out = wait(_issued(received, what)).view(x.shape).sum(0)
            else:
                out = _issued(ops.reduce_scatter_tensor(x.reshape(-1), "sum", n, group), what)
                out = _tag(out.view(x.shape[1:]), what)
    return wait(out) / n if op == "mean" else out


def raw_reduce_scatter_start(
    x: torch.Tensor, mesh: DeviceMesh, axis: str, *, counters: Counters = None, meta: Any = None
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Start a sum reduce-scatter of ``x`` (``[size(axis), *rest]``); return ``(out, finish)``.

    ``out`` holds the result only after ``finish()`` (call it exactly once; it blocks until
    the collective is done, and raises :class:`CollectiveError` if it failed). For callers
    that overlap the collective with other work and hand ``out`` on before it is ready. Not
    differentiable; pass plain tensors. ``meta`` as for :func:`raw_all_gather`.
    """
    n = axis_sizes(mesh)[axis]
    if x.shape[0] != n:
        raise ValueError(f"reduce_scatter over {axis!r} needs a leading dim of {n}, got {x.shape}")
    if n == 1:
        return x[0], lambda: None
    if _CHECK:
        _check_collective("reduce_scatter", mesh, axis, x, "sum", meta)
    x = _contiguous(x)
    _record("reduce_scatter", axis, n, _nbytes(x), x.dtype, counters)
    what: _What = ("reduce_scatter", mesh, axis, x.shape, x.dtype)
    ops, group = torch.ops._c10d_functional, _group_name(mesh, axis)
    with torch.no_grad():
        if not _direct_reduce_scatter(mesh, axis):
            raw = ops.reduce_scatter_tensor(x.reshape(-1), "sum", n, group)

            def wait_raw() -> None:
                _wait_tensor(raw, what)

            return raw.view(x.shape[1:]), wait_raw
        # gloo has no reduce-scatter of its own: it all-reduces a copy of the whole input
        # (twice the traffic). An all-to-all and a local sum send (n-1)/n of it once.
        rows = [x[0].numel()] * n
        received = ops.all_to_all_single(x.reshape(-1), rows, rows, group)
        out = x.new_empty(x.shape[1:])

    def finish() -> None:
        with torch.no_grad():
            _wait_tensor(received, what)
            torch.sum(received.view(n, -1), dim=0, out=out.view(-1))

    return out, finish


def _direct_reduce_scatter(mesh: DeviceMesh, axis: str) -> bool:
    """gloo lacks a reduce-scatter of its own (see :func:`raw_reduce_scatter_start`)."""
    return dist.get_backend(_group(mesh, axis)) == "gloo"


def raw_all_reduce(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str | tuple[str, ...],
    op: ReduceOp = "sum",
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """Sum (or average) ``x`` over one or several axes. Not differentiable.

    ``meta`` as for :func:`raw_all_gather`.
    """
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    sizes = axis_sizes(mesh)
    total, issued = 1, 0
    for a in axes:
        n = sizes[a]
        total *= n
        if n == 1:
            continue
        if issued:  # the next axis reduces this one's result: wait here, where it has a name
            x = wait(x)
        if _CHECK:
            _check_collective("all_reduce", mesh, a, x, op, meta)
        _record("all_reduce", a, n, _nbytes(x), x.dtype, counters)
        what: _What = ("all_reduce", mesh, a, x.shape, x.dtype)
        with torch.no_grad():
            x = _issued(
                torch.ops._c10d_functional.all_reduce(_contiguous(x), "sum", _group_name(mesh, a)),
                what,
            )
        issued += 1
    return wait(x) / total if op == "mean" else x


def wait(x: torch.Tensor) -> torch.Tensor:
    """Block until an async collective result is ready, and unwrap it (plain tensors pass).

    The result is never an ``AsyncCollectiveTensor``: such wrappers must not leak into
    user-visible values (simulated per-rank values would be hidden behind them).

    Raises:
        CollectiveError: if the collective failed (timed out, or a peer went away), naming
            the collective, its mesh axis, shape and dtype.
    """
    if isinstance(x, funcol.AsyncCollectiveTensor):
        try:
            return x.wait()
        except RuntimeError as e:
            raise _failure(getattr(x, "_ff_what", None), e) from e
    return x


# --------------------------------------------------------------------------- differentiable


def _move_leading(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``[n, d0, .., dk, ..] -> [d0, .., n*dk, ..]``: merge the group dim into ``dim``."""
    if dim == 0:
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    x = x.movedim(0, dim)
    return x.reshape(*x.shape[:dim], x.shape[dim] * x.shape[dim + 1], *x.shape[dim + 2 :])


def _split_leading(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`_move_leading`: ``[.., n*dk, ..] -> [n, .., dk, ..]``."""
    x = x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :])
    return x.movedim(dim, 0)


def _check_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> None:
    sizes = axis_sizes(mesh)
    for axis in axes:
        if axis not in sizes:
            raise ValueError(
                f"{name} over {axis!r}: the mesh {format_mesh(sizes)} has no axis {axis!r}; "
                f"name one of its axes {tuple(sizes)}."
            )


def _check_dim(x: torch.Tensor, dim: int, n: int, name: str, axis: str) -> None:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{name}: dim {dim} is out of range for a tensor of shape {x.shape}")
    if name == "reduce_scatter" and x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter over {axis!r} (size {n}) needs dim {dim} of shape "
            f"{tuple(x.shape)} to divide by {n}; pad it first"
        )


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int) -> torch.Tensor:  # type: ignore[override]
        return _move_leading(wait(raw_all_gather(x, mesh, axis)), dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axis, ctx.dim = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        n = axis_sizes(ctx.mesh)[ctx.axis]
        out = raw_reduce_scatter(_split_leading(grad, n, ctx.dim), ctx.mesh, ctx.axis)
        return wait(out), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int, op: str) -> torch.Tensor:  # type: ignore[override]
        n = axis_sizes(mesh)[axis]
        return wait(raw_reduce_scatter(_split_leading(x, n, dim), mesh, axis, op))  # type: ignore[arg-type]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axis, ctx.dim, ctx.op = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        n = axis_sizes(ctx.mesh)[ctx.axis]
        out = _move_leading(wait(raw_all_gather(grad, ctx.mesh, ctx.axis)), ctx.dim)
        return (out / n if ctx.op == "mean" else out), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str) -> torch.Tensor:  # type: ignore[override]
        return wait(raw_all_reduce(x, mesh, axes, op))  # type: ignore[arg-type]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axes, ctx.op = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.op == "mean":
            sizes = axis_sizes(ctx.mesh)
            for a in ctx.axes:
                grad = grad / sizes[a]
        return grad, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axes, ctx.op = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return wait(raw_all_reduce(grad, ctx.mesh, ctx.axes, ctx.op)), None, None, None


def _axes(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def all_gather(x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, over the mesh axis ``axis``.

    The gradient is the reduce-scatter (sum) of the incoming gradient.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = ff.shard(torch.arange(4.0), mesh, ff.P("dp")).local
        ...     ff.rank_values(ff.all_gather(x, mesh, "dp"))[1].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    _check_axes(mesh, (axis,), "all_gather")
    _check_dim(x, dim, axis_sizes(mesh)[axis], "all_gather", axis)
    return _AllGather.apply(x, mesh, axis, dim % x.ndim)


def reduce_scatter(
    x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int = 0, op: ReduceOp = "sum"
) -> torch.Tensor:
    """Sum (or average) ``x`` over ``axis`` and keep this rank's block of ``dim``.

    The gradient is the all-gather of the incoming gradient.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = torch.arange(4.0)  # the same on both ranks
        ...     [t.tolist() for t in ff.rank_values(ff.reduce_scatter(x, mesh, "dp"))]
        [[0.0, 2.0], [4.0, 6.0]]
    """
    _check_axes(mesh, (axis,), "reduce_scatter")
    _check_dim(x, dim, axis_sizes(mesh)[axis], "reduce_scatter", axis)
    return _ReduceScatter.apply(x, mesh, axis, dim % x.ndim, op)


def all_reduce(
    x: torch.Tensor, mesh: DeviceMesh, axis: str | tuple[str, ...], op: ReduceOp = "sum"
) -> torch.Tensor:
    """Sum (or average) ``x`` over one or more mesh axes (psum).

    Its transpose is the identity: the gradient passes through unchanged (divided by the
    group size for ``op="mean"``). This is Megatron's ``reduce_from``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = ff.shard(torch.tensor([1.0, 2.0]), mesh, ff.P("dp")).local
        ...     ff.rank_values(ff.all_reduce(x, mesh, "dp"))[0].tolist()
        [3.0]
    """
    _check_axes(mesh, _axes(axis), "all_reduce")
    return _AllReduce.apply(x, mesh, _axes(axis), op)


def all_reduce_grad(
    x: torch.Tensor, mesh: DeviceMesh, axis: str | tuple[str, ...], op: ReduceOp = "sum"
) -> torch.Tensor:
    """Identity in forward; the gradient is summed (or averaged) over ``axis`` in backward.

    The transpose of :func:`all_reduce`, Megatron's ``copy_to``. Data-parallel training uses
    it on parameters replicated over a data axis, so their gradients are reduced.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = torch.ones(2)
        ...     g = torch.func.grad(lambda w: ff.all_reduce_grad(w, mesh, "dp").sum())(w)
        ...     g.tolist()
        [2.0, 2.0]
    """
    _check_axes(mesh, _axes(axis), "all_reduce_grad")
    return _AllReduceGrad.apply(x, mesh, _axes(axis), op)
