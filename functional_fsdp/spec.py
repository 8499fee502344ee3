"""Partition specs and the layout algebra.

Everything here is pure: no process group, no communication. A :class:`P` says how each
tensor dim is split over mesh axes; a :class:`Layout` combines a spec with a global shape and
the mesh's axis sizes, and answers which slice of the global tensor each mesh coordinate
owns and how much padding its local block carries.

Layout rules:

* A dim split over ``("tp", "dp")`` is split hierarchically: first into ``size(tp)``
  contiguous blocks, then each block into ``size(dp)`` blocks (major axis first).
* Sizes that do not divide are padded at the end of each level (ceil division), so every
  coordinate holds a local block of the same padded shape.
* Gathering the minor axis of a dim returns exactly the major-axis block.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

SpecEntry = None | str | tuple[str, ...]


class P:
    """A partition spec: one entry per tensor dim.

    Each entry is ``None`` (not split), a mesh axis name, or a tuple of axis names ordered
    major to minor. Trailing dims without an entry are not split. A spec is immutable,
    hashable, validated when built, and a pytree leaf (it is not a tuple, so tree tools never
    mistake it for structure).

    Example:
        >>> P("dp", None)
        P('dp', None)
        >>> P(("tp", "dp"), None).axes
        ('tp', 'dp')
        >>> P("dp", "dp")
        Traceback (most recent call last):
        ...
        ValueError: P('dp', 'dp') uses mesh axis 'dp' twice (in dims 0 and 1). A mesh axis may split at most one dim; to split one dim over several axes write a tuple, e.g. P(('tp', 'dp')).
    """

    __slots__ = ("_entries",)
    _entries: tuple[SpecEntry, ...]

    def __init__(self, *entries: SpecEntry | Sequence[str]) -> None:
        normalized: list[SpecEntry] = []
        for dim, entry in enumerate(entries):
            normalized.append(_normalize_entry(entry, dim, entries))
        seen: dict[str, int] = {}
        for dim, entry in enumerate(normalized):
            for axis in _entry_axes(entry):
                if axis in seen:
                    shown = ", ".join(repr(e) for e in normalized)
                    where = (
                        f"in dims {seen[axis]} and {dim}"
                        if seen[axis] != dim
                        else f"in the tuple of dim {dim}"
                    )
                    raise ValueError(
                        f"P({shown}) uses mesh axis {axis!r} twice ({where}). A mesh axis may "
                        f"split at most one dim; to split one dim over several axes write a "
                        f"tuple, e.g. P(('tp', 'dp'))."
                    )
                seen[axis] = dim
        object.__setattr__(self, "_entries", tuple(normalized))

    def __init_subclass__(cls, **kwargs: object) -> None:
        raise TypeError("P cannot be subclassed.")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("P is immutable.")

    def __reduce__(self) -> tuple[type[P], tuple[SpecEntry, ...]]:
        return (P, self._entries)

    def __iter__(self) -> Iterator[SpecEntry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, dim: int) -> SpecEntry:
        return self._entries[dim]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash((P, self._entries))

    def __repr__(self) -> str:
        return f"P({', '.join(repr(e) for e in self._entries)})"

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec uses, in dim order, major to minor within a dim."""
        return tuple(axis for entry in self._entries for axis in _entry_axes(entry))

    def entry(self, dim: int) -> tuple[str, ...]:
        """The axes that split ``dim`` (major to minor); ``()`` when the dim is not split."""
        return _entry_axes(self._entries[dim]) if dim < len(self._entries) else ()

    def dim_of(self, axis: str) -> int | None:
        """The tensor dim that ``axis`` splits, or ``None`` if the spec does not use it."""
        for dim, entry in enumerate(self._entries):
            if axis in _entry_axes(entry):
                return dim
        return None

    def without(self, axis: str) -> P:
        """This spec with ``axis`` removed: the layout after gathering over ``axis``.

        Example:
            >>> P(("tp", "dp"), None).without("dp")
            P('tp', None)
        """
        return P(*(_remove_axis(entry, axis) for entry in self._entries))

    def padded(self, ndim: int) -> P:
        """This spec extended with ``None`` to ``ndim`` entries."""
        return P(*self._entries, *([None] * (ndim - len(self._entries))))

    def trimmed(self) -> P:
        """This spec without trailing ``None`` entries (the canonical form)."""
        entries = list(self._entries)
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)


def _normalize_entry(entry: object, dim: int, entries: Sequence[object]) -> SpecEntry:
    if entry is None:
        return entry
    if isinstance(entry, str):
        return str.__str__(entry)  # a plain str, also for str enums such as Axis.DP
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        if len(entry) == 0:
            return None
        if len(entry) == 1:
            return str.__str__(entry[0])
        return tuple(str.__str__(a) for a in entry)
    raise TypeError(
        f"P entry {dim} is {entry!r} ({type(entry).__name__}); each entry must be None, a mesh "
        f"axis name, or a tuple of axis names ordered major to minor, e.g. P('dp', None) or "
        f"P(('tp', 'dp'), None)."
    )


def _entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def _remove_axis(entry: SpecEntry, axis: str) -> SpecEntry:
    rest = tuple(a for a in _entry_axes(entry) if a != axis)
    return None if not rest else rest[0] if len(rest) == 1 else rest


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """A spec applied to a global shape on a mesh with the given axis sizes.

    Attributes:
        global_shape: the shape of the full (unsharded) tensor.
        spec: the partition spec, padded with ``None`` to ``len(global_shape)`` entries.
        axis_sizes: the mesh's axes and their sizes, in mesh order.

    Example:
        >>> layout = Layout.make((5, 3), P("dp"), {"dp": 2})
        >>> layout.local_shape
        (3, 3)
        >>> layout.owned({"dp": 1})
        ((slice(3, 5, None), slice(0, 3, None)), (1, 0))
    """

    global_shape: tuple[int, ...]
    spec: P
    axis_sizes: tuple[tuple[str, int], ...]

    @staticmethod
    def make(shape: Sequence[int], spec: P, axis_sizes: Mapping[str, int]) -> Layout:
        """Build a layout; raises ``ValueError`` if ``spec`` does not fit the shape or mesh."""
        shape = tuple(int(s) for s in shape)
        problem = spec_problem(shape, spec, axis_sizes)
        if problem:
            raise ValueError(
                f"cannot lay out shape {shape} with {spec} on {format_mesh(axis_sizes)}: {problem}."
            )
        return Layout(shape, spec.padded(len(shape)), tuple(axis_sizes.items()))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axis_sizes)

    def block_sizes(self, dim: int) -> list[int]:
        """Padded block length of ``dim`` at each level: ``[n, ceil(n/s1), ...]``."""
        sizes = self.sizes
        lengths = [self.global_shape[dim]]
        for axis in self.spec.entry(dim):
            lengths.append(_ceil_div(lengths[-1], sizes[axis]))
        return lengths

    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The padded shape of every coordinate's local block (the same on all of them;
        worked out once per layout: the planner asks for it thousands of times)."""
        return tuple(self.block_sizes(d)[-1] for d in range(len(self.global_shape)))

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def owned(self, coord: Mapping[str, int]) -> tuple[tuple[slice, ...], tuple[int, ...]]:
        """The global slice a mesh coordinate owns, and the padding per dim of its block.

        The owned slice may be empty on some coordinates of a small dim; its local block is
        then all padding.
        """
        slices, pads = [], []
        for dim in range(len(self.global_shape)):
            lengths = self.block_sizes(dim)
            start, stop = 0, self.global_shape[dim]
            for level, axis in enumerate(self.spec.entry(dim), start=1):
                start = start + coord[axis] * lengths[level]
                stop = min(stop, start + lengths[level])
                start = min(start, stop)
            slices.append(slice(start, stop))
            pads.append(lengths[-1] - (stop - start))
        return tuple(slices), tuple(pads)

    def gathered(self, axis: str) -> Layout:
        """The layout after gathering over ``axis`` (which must be minor in its dim)."""
        return Layout(self.global_shape, self.spec.without(axis), self.axis_sizes)


def gather_schedule(
    layouts: Sequence[Layout], wanted: Sequence[Collection[str]]
) -> list[tuple[str, list[int]]]:
    """In which order to gather ``wanted[i]`` axes out of ``layouts[i]``, bucketing across them.

    Each step ``(axis, indices)`` gathers ``axis`` out of the listed layouts, in each of which
    it is the minor-most axis of its dim (gathering a major axis first would not give a
    contiguous block). An axis waits until every layout still wanting it has it minor-most, so
    that each axis takes one step wherever the specs allow; ties go to the axis serving more
    layouts, then to mesh order.

    Example:
        >>> a = Layout.make((8,), P(("tp", "dp")), {"dp": 2, "tp": 2})
        >>> b = Layout.make((8,), P("tp"), {"dp": 2, "tp": 2})
        >>> gather_schedule([a, b], [{"dp", "tp"}, {"tp"}])
        [('dp', [0]), ('tp', [0, 1])]
    """
    current = list(layouts)
    remaining = [set(w) for w in wanted]
    names = [a for a, _ in current[0].axis_sizes] if current else []
    steps: list[tuple[str, list[int]]] = []
    while True:
        ready: dict[str, list[int]] = {}
        for i, lay in enumerate(current):
            for dim in range(len(lay.global_shape)):
                entry = lay.spec.entry(dim)
                if entry and entry[-1] in remaining[i]:
                    ready.setdefault(entry[-1], []).append(i)
        if not ready:
            return steps
        blocked = {a for i, r in enumerate(remaining) for a in r if i not in ready.get(a, ())}
        choices = [a for a in ready if a not in blocked] or list(ready)
        axis = max(choices, key=lambda a: (len(ready[a]), -names.index(a)))
        steps.append((axis, ready[axis]))
        for i in ready[axis]:
            current[i] = current[i].gathered(axis)
            remaining[i].discard(axis)


def spec_problem(shape: Sequence[int], spec: P, axis_sizes: Mapping[str, int]) -> str | None:
    """Why ``spec`` cannot lay out a tensor of ``shape`` on a mesh, or ``None`` if it can."""
    if not isinstance(spec, P):
        return f"expected a P, got {spec!r} ({type(spec).__name__})"
    if len(shape) == 0 and len(spec.trimmed()) > 0:
        return (
            f"{spec} splits dim 0, but the tensor is 0-dim (a scalar has no dims to split); "
            f"use P() to replicate it"
        )
    if len(spec) > len(shape):
        return (
            f"{spec} has {len(spec)} entries but the tensor has only {len(shape)} dims; "
            f"give at most one entry per dim"
        )
    unknown = [a for a in spec.axes if a not in axis_sizes]
    if unknown:
        return (
            f"{spec} names mesh axis {unknown[0]!r}, which the mesh does not have "
            f"(its axes are {tuple(axis_sizes)}); use one of those names"
            f"{did_you_mean(unknown[0], axis_sizes)}"
        )
    return None


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'dp'?)`` for the choice closest to a misspelled ``name``, else ``""``.

    Example:
        >>> did_you_mean("pd", ["dp", "tp"]), did_you_mean("DP", ["dp"]), did_you_mean("zz", ["dp"])
        (" (did you mean 'dp'?)", " (did you mean 'dp'?)", '')
    """
    choices = [c for c in choices if isinstance(c, str)]
    if not isinstance(name, str) or not choices:
        return ""
    by_lower = {c.lower(): c for c in choices}
    if name.lower() in by_lower:
        return f" (did you mean {by_lower[name.lower()]!r}?)"
    low = name.lower()
    # Transposed letters first ('pd' for 'dp'). Axis names are short: a one-letter slip in a
    # two-letter name ('db' for 'dp') keeps half the letters, so a ratio of 0.5 counts when
    # the first letter is right ('pp' is another axis, not a slip of 'dp' or 'tp').
    close = [c for c in by_lower if len(c) > 1 and sorted(c) == sorted(low)]
    if not close:
        scored = [(difflib.SequenceMatcher(None, low, c).ratio(), c) for c in by_lower]
        close = [
            c
            for ratio, c in sorted(scored, key=lambda rc: -rc[0])
            if ratio >= 0.75 or (ratio >= 0.5 and c[:1] == low[:1])
        ]
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def format_mesh(axis_sizes: Mapping[str, int]) -> str:
    """``{'dp': 2, 'tp': 2}`` rendered for error messages."""
    return "Mesh(" + ", ".join(f"{a}={s}" for a, s in axis_sizes.items()) + ")"
