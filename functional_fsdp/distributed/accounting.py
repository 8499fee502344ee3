"""What ``count_comms`` records: one :class:`CommRecord` per collective, per active counter.

The collectives of :mod:`.collectives` call :func:`record` as they are issued; nothing
here talks to a process group. The counters of the enclosing ``count_comms`` blocks live in
a context variable, and the FSDP engine hands them to the collectives of backward
explicitly (autograd's worker threads do not inherit context variables).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CommRecord:
    """One collective issued by this rank.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``.
        axis: the mesh axis it ran over.
        group_size: ranks in the group.
        bytes: bytes this rank sends in a ring implementation: ``(n-1)/n`` of the gathered
            (all-gather) or input (reduce-scatter) buffer, twice that for all-reduce; for
            all-to-all, what it sends to the other ranks.
        dtype: element type of the buffer.
        label: what issued it, where the issuer names itself (:func:`labelled`):
            ``"cp"`` for context-parallel attention's keys and values and their gradients;
            ``None`` otherwise.

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
    label: str | None = None


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
_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "functional_fsdp_comm_label", default=None
)


@contextlib.contextmanager
def labelled(label: str | None) -> Iterator[None]:
    """Collectives issued inside the block are recorded with ``label`` (see
    :attr:`CommRecord.label`); the differentiable collectives keep their forward's label
    for the collectives of their backward.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh, ff.count_comms() as comms:
        ...     with labelled("cp"):
        ...         _ = ff.all_reduce(torch.ones(2), mesh, "dp")
        ...     _ = ff.all_reduce(torch.ones(2), mesh, "dp")
        >>> [r.label for r in comms.records]
        ['cp', None]
    """
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def current_label() -> str | None:
    """The label of the enclosing :func:`labelled` block, if any."""
    return _LABEL.get()


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


@contextlib.contextmanager
def isolated() -> Iterator[CommCounter]:
    """Record into a fresh counter alone: the enclosing :func:`count_comms` blocks see
    nothing of the block (``ff.jit`` traces a step this way, then records its collectives
    into the caller's counters at every call)."""
    counter = CommCounter()
    token = _COUNTERS.set((counter,))
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


def record(
    kind: str, axis: str, n: int, buffer_bytes: int, dtype: torch.dtype, counters: Counters
) -> None:
    if counters is None:
        counters = _COUNTERS.get()
    if counters:
        if kind == "all_to_all":  # the caller counts what it sends to the others
            sent = buffer_bytes
        else:
            sent = (2 if kind == "all_reduce" else 1) * buffer_bytes * (n - 1) // n
        rec = CommRecord(kind, axis, n, sent, dtype, _LABEL.get())
        for c in counters:
            c.records.append(rec)
