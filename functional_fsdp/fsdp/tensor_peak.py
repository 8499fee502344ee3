"""The peak of tensor memory a call allocates, read from torch's profiler.

A CPU has no ``torch.cuda.max_memory_allocated``. torch's profiler records every allocation
and free of its allocators instead (``profile_memory=True``); replaying them gives the peak of
live tensor bytes a call adds above what was live before it, and the tensors live at that peak
with the operator that allocated each: where a step's memory goes. Exact and deterministic for
a given order of events, unlike resident memory; a collective library's own staging buffers
(gloo's) and Python objects are not tensors and are not counted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class TensorPeak:
    """The peak of live tensor bytes a call added, and what was live then.

    Attributes:
        added_bytes: the highest total of live tensor bytes above the total at the start
            (frees of tensors that existed before the call count: a step that replaces its
            parameters frees the old ones).
        live_at_peak: the tensors the call allocated that were live at the peak, grouped by
            the operator (innermost profiler scope) that allocated them: ``(bytes, count,
            scope)``, largest first.
        device: the device whose memory was followed.

    Example:
        >>> TensorPeak(4096, [(4096, 1, "aten::mm")], "cpu").added_mib
        0.00390625
    """

    added_bytes: int
    live_at_peak: list[tuple[int, int, str]]
    device: str = "cpu"

    @property
    def added_mib(self) -> float:
        return self.added_bytes / 2**20

    def describe(self, top: int = 8) -> str:
        """The tensors live at the peak, by the operator that allocated them, one per line."""
        return "".join(
            f"  {nbytes / 2**20:8.2f} MiB  {count:4d} tensors  {scope}\n"
            for nbytes, count, scope in self.live_at_peak[:top]
        )


def tensor_peak(call: Callable[[], object], device: str = "cpu") -> TensorPeak:
    """Run ``call`` under torch's memory profiler; return the peak of tensor memory it added.

    Follows the allocations on ``device`` (``"cpu"``, or ``"cuda"``). A free is reported
    after its memory is returned, so another thread (a collective's) can allocate the same
    address and report first: such an allocation ends the old one, whose late report is then
    skipped. The profiler does not record a free made on a thread it does not follow (gloo's
    worker drops a finished collective's buffers there), so such a tensor counts as live until
    its address is used again: a peak can be overstated, never understated. Of several runs of
    the same call, the least is the closest.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> def step():
        ...     a = torch.ones(1024, 256)  # 1 MiB
        ...     b = a * 2                  # 1 MiB more
        ...     del a                      # 1 MiB less
        ...     c = torch.cat([b, b])      # 2 MiB more: the peak, 3 MiB
        ...     return c.sum()
        >>> found = ff.tensor_peak(step)
        >>> round(found.added_mib, 3), found.live_at_peak[:2]
        (3.0, [(2097152, 1, 'aten::cat'), (1048576, 1, 'aten::mul')])
    """
    with _quiet_stderr(), profile(activities=_activities(device), profile_memory=True) as prof:
        call()
    events: list[tuple[int, int, int, str]] = []

    def walk(node: object, scope: str) -> None:
        if node.tag == _EventType.Allocation:  # type: ignore[attr-defined]
            extra = node.extra_fields  # type: ignore[attr-defined]
            if extra.device.type == device:
                start = node.start_time_ns  # type: ignore[attr-defined]
                events.append((start, extra.ptr, extra.alloc_size, scope))
            return
        name = node.name  # type: ignore[attr-defined]
        inner = scope if name in _ALLOCATORS else name  # the op that asked for the memory
        for child in node.children:  # type: ignore[attr-defined]
            walk(child, inner)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "(no operator)")
    events.sort(key=lambda e: e[0])
    live = peak = 0
    owners: dict[int, tuple[int, str]] = {}
    at_peak: dict[int, tuple[int, str]] = {}
    late: dict[int, list[int]] = {}
    for _, ptr, size, scope in events:
        if size > 0:
            if ptr in owners:  # its free is reported late (see above)
                old = owners[ptr][0]
                live -= old
                late.setdefault(ptr, []).append(old)
            owners[ptr] = (size, scope)
            live += size
        elif -size in late.get(ptr, ()):
            late[ptr].remove(-size)
            continue
        else:
            owners.pop(ptr, None)
            live += size
        if live > peak:
            peak, at_peak = live, dict(owners)
    groups: dict[str, list[int]] = {}
    for size, scope in at_peak.values():
        entry = groups.setdefault(scope, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(((b, n, s) for s, (b, n) in groups.items()), reverse=True)
    return TensorPeak(peak, ranked, device)


# Operators that only allocate: memory is attributed to the operator that called them.
_ALLOCATORS = frozenset(
    {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::resize_"}
)


def _activities(device: str) -> list[ProfilerActivity]:
    if device == "cpu":
        return [ProfilerActivity.CPU]
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA]


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """kineto prints its start and stop on the process's stderr (file descriptor 2)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
