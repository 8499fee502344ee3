"""Muon's exchange: each matrix's momentum from its layout to the ranks that orthogonalize
it, and the results back to the layout, in one all-to-all each way per dtype; and the same
exchange priced from shapes alone (bytes sent, memory held), which the planner reports.

Each matrix has a **region** per rank: the part of it that rank orthogonalizes.

- Whole (the default): its owner's region is the whole matrix, the others' none. Owners are
  balanced by Newton–Schulz flops (:func:`owners`).
- Split (a matrix over ``matrix_budget_bytes``): every rank of the mesh holds one block of
  the matrix's longer side (:func:`~functional_fsdp.optim._muon_shapes.split_dim`), as if
  that dim were laid out over all the mesh's axes, and the ranks orthogonalize it together.

Out: each region is filled from the blocks of the value's layout that overlap it (over an
axis the value is replicated on, the rank at the region holder's coordinate sends). Back:
each rank's block of the result from the regions that overlap it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..distributed import collectives as C
from ..sharded import unpad
from ..spec import Layout, P
from ._muon_shapes import MuonDimensionNumbers, assign_owners, coordinates, ns_flops, split_dim

Region = tuple[slice, ...]

COMM_LABEL = "muon"
"""The label of a split matrix's all-reduces (its Gram matrix, its norm) in the accounting."""


class Matrix(NamedTuple):
    """A Muon leaf as the exchange sees it (what :func:`recording_exchanges` records)."""

    shape: tuple[int, ...]  # global shape
    spec: Any  # the momentum's P
    dims: MuonDimensionNumbers
    dtype: torch.dtype = torch.float32  # the momentum's dtype
    split: bool = False  # orthogonalized by all ranks together (over the budget)


class Route(NamedTuple):
    """Where each part of one matrix goes: ``out`` and ``back`` hold ``(from, to, part)``
    with ranks in the mesh's row-major order and ``part`` a global region."""

    regions: list[Region | None]  # per rank: the part it orthogonalizes
    out: list[tuple[int, int, Region]]  # blocks of the layout to the regions
    back: list[tuple[int, int, Region]]  # parts of the results to the blocks


def _matrix(m: Sequence[Any]) -> Matrix:
    return m if isinstance(m, Matrix) else Matrix(tuple(m[0]), *m[1:])


def owners(matrices: Sequence[Matrix], n: int) -> list[int | None]:
    """The owner of each whole matrix (``None`` for split ones), balancing flops."""
    whole = [i for i, m in enumerate(matrices) if not m.split]
    chosen = assign_owners([ns_flops(matrices[i].shape, matrices[i].dims, 1) for i in whole], n)
    out: list[int | None] = [None] * len(matrices)
    for i, o in zip(whole, chosen):
        out[i] = o
    return out


def _intersect(a: Region, b: Region) -> Region | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _within(part: Region, origin: Region) -> Region:
    """``part`` (global) relative to the block that starts at ``origin``."""
    return tuple(slice(p.start - o.start, p.stop - o.start) for p, o in zip(part, origin))


def _numel(part: Region) -> int:
    return math.prod(s.stop - s.start for s in part)


def route(
    m: Matrix, owner: int | None, axis_sizes: dict[str, int], coords: list[dict[str, int]]
) -> Route:
    """The regions and the parts each rank sends, for one matrix (pure: from shapes)."""
    layout = Layout.make(m.shape, m.spec, axis_sizes)
    if m.split:
        d = split_dim(m.shape, m.dims)
        entries = [tuple(axis_sizes) if i == d else None for i in range(len(m.shape))]
        target = Layout.make(m.shape, P(*entries), axis_sizes)
        regions: list[Region | None] = [target.owned(c)[0] for c in coords]
    else:
        whole = tuple(slice(0, s) for s in m.shape)
        regions = [whole if k == owner else None for k in range(len(coords))]
    held = set(layout.spec.axes)
    owned = [layout.owned(c)[0] for c in coords]
    out, back = [], []
    for j, region in enumerate(regions):
        if region is None:
            continue
        for k, c in enumerate(coords):
            # One copy of each block: over an axis the value is replicated on, the rank at
            # the region holder's coordinate sends it.
            if all(c[a] == coords[j][a] for a in c if a not in held):
                part = _intersect(owned[k], region)
                if part is not None:
                    out.append((k, j, part))
        for k in range(len(coords)):
            part = _intersect(region, owned[k])
            if part is not None:
                back.append((j, k, part))
    return Route(regions, out, back)


def routes(matrices: Sequence[Matrix], axis_sizes: dict[str, int]) -> list[Route]:
    coords = coordinates(axis_sizes)
    chosen = owners(matrices, len(coords))
    return [route(m, o, axis_sizes, coords) for m, o in zip(matrices, chosen)]


# --------------------------------------------------------------------------- from shapes


def exchange_bytes(
    matrices: Sequence[Sequence[Any]], axis_sizes: dict[str, int], itemsize: int = 4
) -> list[int]:
    """Bytes each rank sends per step in Muon's two all-to-alls, from shapes alone: the
    blocks it sends towards the regions, plus the parts of its regions it sends back.

    Args:
        matrices: ``(global shape, spec, dimension numbers[, dtype, split])`` of each Muon
            leaf sharded on the mesh, in the order of the params tree (see :class:`Matrix`).
        axis_sizes: the mesh's axes and sizes, in mesh order.
        itemsize: bytes per element of the momentum (4 for float32).

    Example:
        >>> from functional_fsdp.spec import P
        >>> exchange_bytes([((8, 4), P("dp"), MuonDimensionNumbers())] * 2, {"dp": 2})
        [128, 128]
    """
    ms = [_matrix(m) for m in matrices]
    sent = [0] * math.prod(axis_sizes.values())
    for r in routes(ms, axis_sizes):
        for k, j, part in r.out + r.back:
            if k != j:
                sent[k] += _numel(part) * itemsize
    return sent


def exchange_memory(matrices: Sequence[Sequence[Any]], axis_sizes: dict[str, int]) -> list[int]:
    """The most bytes each rank holds at once in Muon's exchange, from shapes alone.

    Per dtype of momentum (in order of first appearance), a rank holds: in the first
    all-to-all its send buffer ``S1`` (its blocks for the others' regions) and its receive
    buffer ``R1`` (the others' blocks of its regions); then ``R1`` and its regions ``W``
    (each orthogonalized in place of its input); in the second all-to-all ``W``, its send
    buffer ``S2`` (the others' parts of its results) and its receive buffer ``R2`` (its parts
    of the others' results); and at the end ``W``, ``R2`` and the blocks it returns ``O``
    (its padded shards of the update). The peak is the largest of ``S1 + R1``, ``R1 + W``,
    ``W + S2 + R2`` and ``W + R2 + O``, on top of the blocks returned for the dtypes before.
    Newton–Schulz's own temporaries (a few matrices of the size of the region being
    orthogonalized, and a split matrix's ``X Xᵀ``) are not included.

    Args:
        matrices: ``(global shape, spec, dimension numbers, momentum dtype[, split])`` of
            each Muon leaf sharded on the mesh, in the order of the params tree.
        axis_sizes: the mesh's axes and sizes, in mesh order.

    Example:
        >>> import torch
        >>> from functional_fsdp.spec import P
        >>> m = ((8, 4), P("dp"), MuonDimensionNumbers(), torch.float32)
        >>> exchange_memory([m, m], {"dp": 2})  # each rank: one matrix whole (128 B)
        [320, 320]
        >>> exchange_memory([(*m, True)], {"dp": 2})  # split: its half (64 B), the result's
        [128, 128]
    """
    ms = [_matrix(m) for m in matrices]
    n = math.prod(axis_sizes.values())
    all_routes = routes(ms, axis_sizes)
    peaks, returned = [0] * n, [0] * n
    groups: dict[torch.dtype, list[int]] = {}
    for i, m in enumerate(ms):
        groups.setdefault(m.dtype, []).append(i)
    for dtype, chosen in groups.items():
        size = dtype.itemsize
        s1, r1, whole, s2, r2, blocks = ([0] * n for _ in range(6))
        for i in chosen:
            r = all_routes[i]
            for k, j, part in r.out:
                if k != j:
                    s1[k] += _numel(part) * size
                    r1[j] += _numel(part) * size
            for j, region in enumerate(r.regions):
                if region is not None:
                    whole[j] += _numel(region) * size
            for j, k, part in r.back:
                if j != k:
                    s2[j] += _numel(part) * size
                    r2[k] += _numel(part) * size
            local = Layout.make(ms[i].shape, ms[i].spec, axis_sizes).local_numel * size
            blocks = [b + local for b in blocks]
        for k in range(n):
            peak = max(
                s1[k] + r1[k],
                r1[k] + whole[k],
                whole[k] + s2[k] + r2[k],
                whole[k] + r2[k] + blocks[k],
            )
            peaks[k] = max(peaks[k], returned[k] + peak)
            returned[k] += blocks[k]
    return peaks


# Open recorders of recording_exchanges(): each gets (axis sizes, matrices) per exchange.
_RECORDERS: list[list[tuple[dict[str, int], list[Matrix]]]] = []


@contextlib.contextmanager
def recording_exchanges() -> Iterator[list[tuple[dict[str, int], list[Matrix]]]]:
    """Record the exchanges Muon runs inside the block: for each, the mesh's axis sizes and
    its :class:`Matrix` list (the arguments of :func:`exchange_memory`). The planner prices
    the exchange's memory this way.

    Example:
        >>> import torch
        >>> from functional_fsdp.optim.muon import scale_by_muon
        >>> t, g = scale_by_muon(), {"w": torch.ones(2, 2)}
        >>> with recording_exchanges() as book:
        ...     _ = t.update(g, t.init(g))
        >>> book  # one process: nothing to exchange
        []
    """
    book: list[tuple[dict[str, int], list[Matrix]]] = []
    _RECORDERS.append(book)
    try:
        yield book
    finally:
        _RECORDERS.remove(book)


def record(axis_sizes: dict[str, int], matrices: list[Matrix]) -> None:
    for book in _RECORDERS:
        book.append((dict(axis_sizes), list(matrices)))


# --------------------------------------------------------------------------- on ranks


class Item(NamedTuple):
    """One matrix in a running exchange."""

    layout: Layout  # the momentum's layout
    local: torch.Tensor  # this rank's (padded) block of it
    route: Route


def run(
    mesh: Any,
    coords: list[dict[str, int]],
    me: int,
    items: list[Item],
    orthogonalize: Callable[[int, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """The two all-to-alls of one dtype's matrices around ``orthogonalize(i, region)``,
    called on every rank for each item ``i`` in order where this rank holds a region of it
    (every rank holds one of each split matrix, possibly empty). Returns each item's padded
    block of the result. What a rank holds is what :func:`exchange_memory` prices."""
    n = len(coords)
    owned = [x.layout.owned(coords[me])[0] for x in items]
    mine = [unpad(x.local, x.layout, coords[me]) for x in items]
    send: list[list[torch.Tensor]] = [[] for _ in range(n)]
    sizes = [0] * n
    for x, own, block in zip(items, owned, mine):
        for k, j, part in x.route.out:
            if k == me and j != me:
                send[j].append(block[_within(part, own)])
            elif j == me and k != me:
                sizes[k] += _numel(part)
    received = _all_to_all(mesh, send, sizes, items[0].local)
    at = _offsets(sizes)
    regions: dict[int, torch.Tensor] = {}
    for i, (x, own, block) in enumerate(zip(items, owned, mine)):
        region = x.route.regions[me]
        if region is None:
            continue
        held = x.local.new_empty([s.stop - s.start for s in region])
        for k, j, part in x.route.out:
            if j != me:
                continue
            if k == me:
                held[_within(part, region)] = block[_within(part, own)]
            else:
                size = _numel(part)
                piece = held[_within(part, region)]
                piece.copy_(received[at[k] : at[k] + size].view(piece.shape))
                at[k] += size
        regions[i] = held
        del held
    C.release(received)
    del received
    for i in range(len(items)):
        if i in regions:
            regions[i] = orthogonalize(i, regions[i])
    send = [[] for _ in range(n)]
    sizes = [0] * n
    for i, x in enumerate(items):
        for j, k, part in x.route.back:
            if j == me and k != me:
                send[k].append(regions[i][_within(part, x.route.regions[me])])
            elif k == me and j != me:
                sizes[j] += _numel(part)
    received = _all_to_all(mesh, send, sizes, items[0].local)
    at = _offsets(sizes)
    out = []
    for i, (x, own) in enumerate(zip(items, owned)):
        result = torch.zeros_like(x.local)
        real = unpad(result, x.layout, coords[me])
        for j, k, part in x.route.back:
            if k != me:
                continue
            piece = real[_within(part, own)]
            if j == me:
                piece.copy_(regions[i][_within(part, x.route.regions[me])])
            else:
                size = _numel(part)
                piece.copy_(received[at[j] : at[j] + size].view(piece.shape))
                at[j] += size
        out.append(result)
    C.release(received)
    return out


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def _all_to_all(
    mesh: Any, send: list[list[torch.Tensor]], recv_sizes: list[int], like: torch.Tensor
) -> torch.Tensor:
    """Copy the blocks (views, any strides) into one flat buffer, send it, free it."""
    sizes = [sum(p.numel() for p in chunk) for chunk in send]
    flat = like.new_empty(sum(sizes))
    at = 0
    for chunk in send:
        for p in chunk:
            flat[at : at + p.numel()].view(p.shape).copy_(p)
            at += p.numel()
    send.clear()
    received = C.raw_all_to_all(flat, mesh, sizes, recv_sizes)
    C.release(flat)
    return received
