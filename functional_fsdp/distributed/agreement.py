"""Do the ranks agree? Cheap checks that run by default, one small all-gather per call.

:func:`~functional_fsdp.shard` needs the same full values on every rank, and a standalone
:func:`~functional_fsdp.gather` or :func:`~functional_fsdp.reshard` needs the same global
shapes, specs and dtypes on every rank; otherwise the result is blocks that no rank had, or
bytes reinterpreted, on every rank and without an error. Each check here summarises the whole
tree in one short row of int64s (a count, a hash of the layout, and a position-weighted
checksum of the values), all-gathers that row once per mesh axis (one collective on a 1-D
mesh, whatever the number of leaves), and compares. Only when the rows differ does a second
exchange (of Python objects, on the error path only) bring every rank's per-leaf details, so
that the message can name the leaves and the ranks.

On a simulated mesh the ranks are one program: a plain tensor is the same on every simulated
rank by construction, and only a per-rank value (a ``LocalTensor``, e.g. drawn from an
explicit ``torch.Generator`` inside the simulation) can differ; it is compared locally, with
no collective. The per-collective signature checks of debug mode (``check_collectives``)
are separate and stay off by default.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .collectives import CollectiveError
from .mesh import axis_sizes, local_coordinate, mesh_grid
from .simulate import rank_values

_ROW = 4096  # int64 words per checksum row (32 KiB): the unit of position in a checksum

# One rank's details of one leaf, for the error path: (key path, shape, dtype, spec, digest).
Detail = tuple[str, tuple[int, ...], str, str, tuple[int, int] | None]


SAMPLE = 8  # a large tensor's checksum reads one row in SAMPLE
SMALL = 32  # tensors of up to SMALL rows (1 MiB) are read whole


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return (flat.to(torch.uint8) if flat.dtype == torch.bool else flat).view(torch.uint8)


def _rows(raw: torch.Tensor) -> torch.Tensor | None:
    """The bytes as rows of ``_ROW`` int64 words (a view), if they fill more than ``SMALL``
    whole rows and are aligned; ``None`` otherwise (read them whole)."""
    if raw.numel() <= SMALL * _ROW * 8 or raw.storage_offset() % 8:
        return None
    return raw[: raw.numel() // (8 * _ROW) * 8 * _ROW].view(torch.int64).view(-1, _ROW)


def _whole_rows(raw: torch.Tensor) -> torch.Tensor:
    """Bytes as rows of ``_ROW`` int64 words, zero-padded (a copy: for small tensors)."""
    pad = -raw.numel() % (8 * _ROW)
    padded = torch.nn.functional.pad(raw, (0, pad)) if pad or raw.storage_offset() % 8 else raw
    return padded.view(torch.int64).view(-1, _ROW)


def _row_sums(raw: torch.Tensor, sample: int) -> torch.Tensor:
    """One int64 per row read: sampled rows of a large tensor (and its rest), or all rows."""
    grid = _rows(raw)
    if grid is None:
        return _whole_rows(raw).sum(1)
    rest = _whole_rows(raw[grid.numel() * 8 :]).sum(1)
    return torch.cat([grid[::sample].sum(1), rest])


def _combine(sums: torch.Tensor) -> torch.Tensor:
    weights = torch.arange(1, sums.numel() + 1, device=sums.device)
    return torch.stack([sums.sum(), (sums * weights).sum()])


def digest(t: torch.Tensor, sample: int = SAMPLE) -> torch.Tensor:
    """Two int64s that summarise ``t``'s bytes: their sum and a position-weighted sum.

    The bytes are read as int64 words in rows of 32 KiB (wrapping sums: exact, and the same
    whatever the order of summation); rows moved around change the second sum. A tensor of
    up to 1 MiB is read whole; a larger one one row in ``sample`` (and its last partial row),
    which costs a small fraction of copying it and still tells apart values drawn from other
    seeds or loaded from other files, which differ everywhere. ``sample=1`` reads every byte.

    Example:
        >>> a = torch.arange(6.0)
        >>> same = bool((digest(a) == digest(a.clone())).all())
        >>> moved = bool((digest(a) == digest(a.flip(0))).all())
        >>> same, moved
        (True, False)
    """
    return _combine(_row_sums(_bytes(t), sample))


def tree_digest(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """:func:`digest` of several tensors at once, reading what it reads of each.

    The small tensors are read together (one copy of their bytes, a few kernels in all), so
    a tree of many small tensors costs about as much as one; which tensor a row belongs to is
    left to the layouts, which the checks compare as well.
    """
    small, sums = [], []
    for t in tensors:
        raw = _bytes(t)
        grid = _rows(raw)
        if grid is None:
            small.append(raw.to(device))
            continue
        sums.append(grid[::SAMPLE].sum(1).to(device))
        if grid.numel() * 8 < raw.numel():
            sums.append(_whole_rows(raw[grid.numel() * 8 :]).sum(1).to(device))
    if small:
        sums.append(_whole_rows(torch.cat(small)).sum(1))
    if not sums:
        return torch.zeros(2, dtype=torch.int64, device=device)
    return _combine(torch.cat(sums))


def layout_hash(items: Sequence[Any]) -> int:
    """A 31-bit hash of ``repr(items)`` (shapes, dtypes and specs, as the check compares)."""
    return zlib.crc32(repr(tuple(items)).encode()) & 0x7FFFFFFF


def device(mesh: DeviceMesh) -> torch.device:
    """Where the mesh's collectives take their buffers (the current GPU on a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _all_gather(row: torch.Tensor, mesh: DeviceMesh, axis: str, where: str) -> torch.Tensor:
    """All-gather ``row`` over ``axis``: ``[size, *row.shape]``, blocking."""
    group = mesh.get_group(axis)
    n = group.size()
    with torch.no_grad(), torch._C._DisableFuncTorch():
        out = torch.ops._c10d_functional.all_gather_into_tensor(
            row.contiguous(), n, group.group_name
        )
        try:
            out = torch.ops._c10d_functional.wait_tensor(out)
        except RuntimeError as e:
            raise CollectiveError(
                f"{where}'s check that the ranks agree (one small all_gather over mesh axis "
                f"{axis!r} of {_mesh(mesh)}) failed on rank {dist.get_rank()}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. "
                f"Another rank raised, died or did not call {where}; look for its traceback "
                f"first."
            ) from e
    return out.view(n, *row.shape)


def _mesh(mesh: DeviceMesh) -> str:
    from ..spec import format_mesh

    return format_mesh(axis_sizes(mesh))


def _axes(mesh: DeviceMesh, axes: Sequence[str] | None) -> list[str]:
    sizes = axis_sizes(mesh)
    return [a for a in (sizes if axes is None else axes) if sizes[a] > 1]


def rows_agree(mesh: DeviceMesh, row: torch.Tensor, where: str, axes: Sequence[str] | None) -> bool:
    """Whether every rank of ``mesh`` spanned by ``axes`` (all by default) has this ``row``.

    One all-gather of the row per axis (of size > 1), nested: after the last, every rank has
    the same verdict, so all of them return together or go on to :func:`details` together.
    """
    agree = True
    for axis in _axes(mesh, axes):
        # The row itself and whether this rank's groups so far agreed: a group that agreed
        # has one row, compared with the other groups' rows over the next axis.
        rows = _all_gather(torch.cat([row, row.new_tensor([int(agree)])]), mesh, axis, where)
        host = rows.tolist()
        agree = all(r == host[0] for r in host) and bool(host[0][-1])
    return agree


def differences(
    mesh: DeviceMesh, named: Sequence[tuple[str, torch.Tensor, str]], where: str
) -> dict[int, list[Detail]] | None:
    """``None`` if every rank of ``mesh`` holds the same ``(path, tensor, spec)`` leaves (one
    row of checksums, all-gathered once per axis); else every rank's :func:`details` of them,
    each tensor with its own checksum (the error path)."""
    dev = device(mesh)
    layout = [(p, tuple(t.shape), t.dtype, s) for p, t, s in named]
    head = torch.tensor([len(named), layout_hash(layout)], device=dev)
    row = torch.cat([head, tree_digest([t for _, t, _ in named], dev)])
    if rows_agree(mesh, row, where, None):
        return None
    mine: list[Detail] = [
        (p, tuple(t.shape), _dtype(t.dtype), s, tuple(digest(t).tolist()))  # type: ignore[misc]
        for p, t, s in named
    ]
    return details(mesh, mine, None)


def details(
    mesh: DeviceMesh, mine: list[Detail], axes: Sequence[str] | None
) -> dict[int, list[Detail]]:
    """Every rank's ``mine`` by global rank (the error path: objects, one exchange per axis)."""
    table: dict[tuple[tuple[str, int], ...], list[Detail]] = {(): mine}
    names = _axes(mesh, axes)
    coord = local_coordinate(mesh)
    for axis in names:
        gathered: list[Any] = [None] * mesh.get_group(axis).size()
        dist.all_gather_object(gathered, table, group=mesh.get_group(axis))
        table = {
            ((axis, i), *key): value for i, t in enumerate(gathered) for key, value in t.items()
        }
    grid = mesh_grid(mesh)
    return {grid.rank({**coord, **dict(key)}): value for key, value in sorted(table.items())}


def simulated_details(leaves: Sequence[tuple[str, torch.Tensor, str]]) -> dict[int, list[Detail]]:
    """Each simulated rank's details of ``(path, tensor, spec)``: digests of per-rank values.

    Empty if no value differs between the simulated ranks (plain tensors never do).
    """
    per_rank = [rank_values(t) for _, t, _ in leaves]
    n = max((len(v) for v in per_rank), default=1)
    if n == 1:
        return {}
    out: dict[int, list[Detail]] = {r: [] for r in range(n)}
    differs = False
    for (path, t, spec), values in zip(leaves, per_rank):
        if len(values) == 1:
            sums: list[tuple[int, int] | None] = [None] * n
        else:
            sums = [tuple(digest(v).tolist()) for v in values]  # type: ignore[misc]
            differs = differs or any(s != sums[0] for s in sums)
        for r in range(n):
            out[r].append((path, tuple(t.shape), _dtype(t.dtype), spec, sums[r]))
    return out if differs else {}


def short(sums: tuple[int, int]) -> str:
    """A digest as 8 hex digits, for messages."""
    return f"{zlib.crc32(repr(tuple(sums)).encode()):08x}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def by_rank(values: dict[int, str]) -> str:
    """``  ranks [0, 2]: value`` lines, one per distinct value, in order of first rank."""
    groups: dict[str, list[int]] = {}
    for r, v in sorted(values.items()):
        groups.setdefault(v, []).append(r)
    return "\n".join(
        f"  rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {v}"
        for v, rs in groups.items()
    )


def first_difference(per_rank: dict[int, list[Detail]]) -> tuple[int | None, list[int]]:
    """``(index of the first leaf that differs between ranks, indices of all that do)``;
    ``(None, [])`` when only the number of leaves differs (or nothing does)."""
    tables = list(per_rank.values())
    n = min(len(t) for t in tables)
    differ = [i for i in range(n) if any(t[i] != tables[0][i] for t in tables)]
    return (differ[0] if differ else None), differ
