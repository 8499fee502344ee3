"""Debug mode: every rank checks that the others issue the same collective (``check_collectives``).

With :func:`check_collectives` (or ``FUNCTIONAL_FSDP_CHECK=1``) each collective of
:mod:`.collectives` first all-gathers a small signature of itself and raises ``ValueError``
naming the ranks that disagree, and :func:`check_same_on_ranks` compares checksums of values
meant to be the same on every rank. Off by default: the hot path reads one module global,
:data:`_CHECK`, and imports nothing else from here.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._tree import keystr
from ..spec import format_mesh
from .axes import axis_sizes, mesh_device
from .failures import What, wait_tensor
from .simulate import is_simulated


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
    mine: torch.Tensor, mesh: DeviceMesh, axis: str, what: What, phase: str
) -> torch.Tensor:
    """All-gather ``mine`` over ``axis`` at once (blocking; for checks, never on the hot path)."""
    group = mesh.get_group(axis)
    n = group.size()
    with torch.no_grad(), torch._C._DisableFuncTorch():
        out = torch.ops._c10d_functional.all_gather_into_tensor(
            mine.contiguous(), n, group.group_name
        )
        return wait_tensor(out, what, phase).view(n, *mine.shape)


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


def check_collective(
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
    mine = torch.tensor(sig, dtype=torch.int64, device=mesh_device(mesh))
    what: What = (kind, mesh, axis, x.shape, dtype)
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
    device = mesh_device(mesh)
    prints = [_fingerprint(t) for _, t in named]
    checksums = torch.tensor([int(c) for c, _ in prints], dtype=torch.int64, device=device)
    sums = torch.tensor([float(s) for _, s in prints], dtype=torch.float64, device=device)
    mine = torch.stack([checksums, sums.view(torch.int64)], dim=1)  # [leaves, 2]
    layout = [(keystr(p), tuple(t.shape), _dtype_name(t.dtype)) for p, t in named]
    for axis in axes:
        what: What = ("same_on_ranks", mesh, axis, mine.shape, mine.dtype)
        check_collective("same_on_ranks", mesh, axis, mine, meta=layout)
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
