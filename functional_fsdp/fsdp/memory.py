"""Accounting of gathered-parameter memory: which units' full parameters are alive, and when.

:func:`track_memory` records, for every :meth:`FSDP.apply <functional_fsdp.FSDP.apply>` (and
its backward) run inside the block, each unit's gather, prefetch and free, and the moment each
unit starts to compute. Bytes are those of the gathered (full, padded) parameters in their
gather dtype; shards, activations and gradients are not counted. The events are the points
where the library allocates and releases that storage, so on real processes they match the
storage sizes (tests check this); on a simulated mesh the same events are recorded, although
nothing is released there.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

EventKind = Literal["prefetch", "gather", "free", "compute"]
Phase = Literal["forward", "backward"]


@dataclass(frozen=True)
class MemoryEvent:
    """One change of gathered-parameter memory, or a unit starting to compute.

    Attributes:
        kind: ``"prefetch"`` (an all-gather issued ahead; its output buffer is alive),
            ``"gather"`` (the unit's full parameters are materialised), ``"free"`` (they are
            released) or ``"compute"`` (the unit's forward, or its backward, starts).
        unit: the unit's module path (``""`` is the root unit).
        phase: ``"forward"`` or ``"backward"``.
        bytes: the unit's gathered-parameter bytes (0 for ``"compute"``).
        live_bytes: gathered-parameter bytes alive after the event, over all units.
        live_units: the units alive after the event, in the order they became alive.

    Example:
        >>> MemoryEvent("gather", "blocks.0", "forward", 4096, 6144, ("", "blocks.0"))
        MemoryEvent(kind='gather', unit='blocks.0', phase='forward', bytes=4096, live_bytes=6144, live_units=('', 'blocks.0'))
    """

    kind: EventKind
    unit: str
    phase: Phase
    bytes: int
    live_bytes: int
    live_units: tuple[str, ...]


@dataclass
class MemoryTracker:
    """Gathered-parameter memory recorded inside a :func:`track_memory` block.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from functional_fsdp.fsdp.memory import track_memory
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sharded_model = ff.fsdp(model, mesh)
        ...     params = sharded_model.shard()
        ...     with track_memory() as memory:
        ...         _ = sharded_model.apply(params, torch.randn(3, 4))
        ...     memory.peak_bytes, memory.live_bytes  # Linear(4, 8) is 160 bytes, (8, 2) 72
        (232, 0)
        >>> [(e.kind, e.unit, e.live_units) for e in memory.events]  # doctest: +NORMALIZE_WHITESPACE
        [('prefetch', '0', ('0',)), ('gather', '0', ('0',)), ('prefetch', '1', ('0', '1')),
         ('compute', '0', ('0', '1')), ('free', '0', ('1',)), ('gather', '1', ('1',)),
         ('compute', '1', ('1',)), ('free', '1', ())]
    """

    events: list[MemoryEvent] = field(default_factory=list)
    peak_bytes: int = 0
    _live: dict[int, tuple[str, int]] = field(default_factory=dict, repr=False)

    @property
    def live_bytes(self) -> int:
        """Gathered-parameter bytes alive now."""
        return sum(b for _, b in self._live.values())

    @property
    def live_units(self) -> tuple[str, ...]:
        """The units whose full parameters are alive now (a unit twice if gathered twice)."""
        return tuple(u for u, _ in self._live.values())

    def peak_units(self, phase: Phase | None = None, *, exclude: tuple[str, ...] = ()) -> int:
        """Most units alive at once (optionally in one phase, not counting ``exclude``)."""
        return max(
            (
                len([u for u in e.live_units if u not in exclude])
                for e in self.events
                if phase is None or e.phase == phase
            ),
            default=0,
        )

    def alive_during(self, unit: str, phase: Phase = "forward") -> list[tuple[str, ...]]:
        """The units alive each time ``unit`` starts to compute in ``phase``."""
        return [
            e.live_units
            for e in self.events
            if e.kind == "compute" and e.unit == unit and e.phase == phase
        ]

    def summary(self) -> str:
        """A text table with one line per event."""
        lines = [
            f"{'phase':<10}{'event':<10}{'unit':<14}{'bytes':>12}{'live bytes':>13}  live units"
        ]
        for e in self.events:
            units = ", ".join(u or "<root>" for u in e.live_units)
            lines.append(
                f"{e.phase:<10}{e.kind:<10}{e.unit or '<root>':<14}{e.bytes:>12,}"
                f"{e.live_bytes:>13,}  {units}"
            )
        return "\n".join(lines)

    def clear(self) -> None:
        """Forget the events and the peak (units alive now stay alive)."""
        self.events.clear()
        self.peak_bytes = self.live_bytes

    def _record(
        self,
        kind: EventKind,
        unit: str,
        phase: Phase,
        nbytes: int,
        key: int,
        replaces: int | None = None,
    ) -> None:
        """Apply one event; ``key`` names the holder of the memory (a call, or a prefetch)."""
        if kind == "gather" and replaces is not None and replaces in self._live:
            self._live[key] = self._live.pop(replaces)  # the prefetched buffer, now in use
        elif kind in ("prefetch", "gather"):
            self._live[key] = (unit, nbytes)
        elif kind == "free":
            self._live.pop(key, None)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        shown = 0 if kind == "compute" else nbytes
        self.events.append(MemoryEvent(kind, unit, phase, shown, self.live_bytes, self.live_units))


_TRACKERS: contextvars.ContextVar[tuple[MemoryTracker, ...]] = contextvars.ContextVar(
    "functional_fsdp_memory_trackers", default=()
)


@contextlib.contextmanager
def track_memory() -> Iterator[MemoryTracker]:
    """Record gathered-parameter memory of every ``FSDP.apply`` started inside the block.

    The backward of those calls is recorded too, wherever it runs. Blocks nest.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from functional_fsdp.fsdp.memory import track_memory
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sharded_model = ff.fsdp(model, mesh)  # three units, prefetch 1
        ...     params = sharded_model.shard()
        ...     with track_memory() as memory:
        ...         _ = sharded_model.apply(params, torch.randn(2, 4))
        ...     memory.alive_during("1"), memory.peak_units()
        ([('1', '2')], 2)
    """
    tracker = MemoryTracker()
    token = _TRACKERS.set((*_TRACKERS.get(), tracker))
    try:
        yield tracker
    finally:
        _TRACKERS.reset(token)


def active_trackers() -> tuple[MemoryTracker, ...]:
    """The trackers of the enclosing :func:`track_memory` blocks (innermost last)."""
    return _TRACKERS.get()
