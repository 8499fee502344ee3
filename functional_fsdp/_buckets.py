"""Bucketed all-gathers and their transposes, the reduce-scatters (private; the one copy).

Gathering many tensors takes one collective per mesh axis and dtype (or per size-capped
bucket) over a flat buffer, never one per tensor. :func:`plan_rounds` works out those
*rounds* from layouts alone (pure data, cached by callers that repeat it); the helpers below
pack a round's blocks into one buffer and unpack the result, both ways:

* forward, :func:`issue_gather` then :func:`unpack_gathered`;
* backward, :func:`pack_grads` then :func:`unpack_reduced` around a reduce-scatter.

Both users run them: :func:`functional_fsdp.gather`/``reshard`` (one differentiable round at
a time) and the FSDP engine (:mod:`functional_fsdp.fsdp.units`: per unit, with prefetch,
in-place regathers and deferred reductions).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .distributed import collectives as C
from .spec import Layout, gather_schedule


@dataclass(frozen=True)
class Piece:
    """One tensor's part in a round: its block before the gather, and the dim it joins."""

    index: int  # position in the list of tensors the rounds were planned for
    local_shape: tuple[int, ...]
    dim: int
    gathered_len: int  # length of ``dim`` after the gather, padding cut
    chunked: bool  # dim 0, laid out as torch.chunk pads it: one fused copy in and out

    def padded_shape(self, n: int) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.dim] *= n
        return tuple(shape)


@dataclass(frozen=True)
class Round:
    """One bucketed all-gather: ``axis`` out of the listed tensors, all of one dtype."""

    axis: str
    size: int  # of the axis
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    first: bool  # every input is a shard (not the output of an earlier round): prefetchable


def plan_rounds(
    layouts: Sequence[Layout],
    sizes: Mapping[str, int],
    wanted: Sequence[Collection[str]],
    dtypes: Sequence[torch.dtype],
    *,
    bucket_bytes: int | None = None,
    skip_size_one: bool = True,
) -> tuple[Round, ...]:
    """The all-gather rounds that gather ``wanted[i]`` axes out of ``layouts[i]``.

    Axes come in :func:`~functional_fsdp.spec.gather_schedule`'s order (minor axes first,
    each axis once wherever the specs allow); each round is bucketed by ``dtypes[i]``, in
    first-appearance order, and split where a bucket's local bytes would pass
    ``bucket_bytes``. ``skip_size_one``: an axis of size 1 moves nothing, so it takes no
    round (otherwise it takes one that copies).
    """
    current = list(layouts)
    want = [set(w) for w in wanted]
    if skip_size_one:
        for i, lay in enumerate(current):
            for a in lay.spec.axes:
                if a in want[i] and sizes[a] == 1:
                    current[i] = current[i].gathered(a)
                    want[i].discard(a)
    touched = [False] * len(current)
    rounds: list[Round] = []
    for axis, ready in gather_schedule(current, want):
        n = sizes[axis]
        groups: dict[torch.dtype, list[list[int]]] = {}
        used: dict[torch.dtype, int] = {}
        for i in ready:
            lay, dtype = current[i], dtypes[i]
            nbytes = math.prod(lay.local_shape) * dtype.itemsize
            buckets = groups.setdefault(dtype, [[]])
            if bucket_bytes is not None and buckets[-1] and used[dtype] + nbytes > bucket_bytes:
                buckets.append([])
                used[dtype] = 0
            buckets[-1].append(i)
            used[dtype] = used.get(dtype, 0) + nbytes
        for dtype, buckets in groups.items():
            for idx in buckets:
                pieces = []
                for i in idx:
                    lay = current[i]
                    dim = lay.spec.dim_of(axis)
                    if dim is None:  # pragma: no cover - the schedule only lists sharded dims
                        raise RuntimeError(f"internal: {axis!r} shards no dim of {lay}")
                    length = lay.block_sizes(dim)[-2]
                    chunked = dim == 0 and -(-length // n) == lay.local_shape[0]
                    pieces.append(Piece(i, lay.local_shape, dim, length, chunked))
                first = not any(touched[i] for i in idx)
                rounds.append(Round(axis, n, dtype, tuple(pieces), first))
        for i in ready:
            current[i] = current[i].gathered(axis)
            touched[i] = True
    return tuple(rounds)


def as_leading(t: torch.Tensor, piece: Piece, n: int) -> torch.Tensor:
    """View a padded full tensor as ``[n, *local_shape]``: rank ``r``'s block at index ``r``."""
    d, shape = piece.dim, piece.local_shape
    return t.view(*shape[:d], n, shape[d], *shape[d + 1 :]).movedim(d, 0)


def issue_gather(
    inputs: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    rnd: Round,
    *,
    counters: Any = None,
    meta: Any = None,
) -> torch.Tensor:
    """Issue ``rnd``'s all-gather of ``inputs`` (its pieces' blocks, in order); no wait."""
    # A real host tensor goes through the parts' path even alone: on gloo, it gathers in place.
    if len(inputs) == 1 and not C.releasable(inputs[0]):
        return C.raw_all_gather(inputs[0].reshape(-1), mesh, rnd.axis, counters=counters, meta=meta)
    return C.raw_all_gather_parts(inputs, mesh, rnd.axis, counters=counters, meta=meta)


def unpack_gathered(gathered: torch.Tensor, rnd: Round, outs: Sequence[torch.Tensor]) -> None:
    """Copy an all-gather's ``[n, total]`` output into each piece's padded full tensor."""
    n = rnd.size
    if all(p.dim == 0 for p in rnd.pieces):
        sizes = [math.prod(p.local_shape) for p in rnd.pieces]
        torch.split_with_sizes_copy(gathered, sizes, dim=1, out=[o.view(n, -1) for o in outs])
        return
    offset = 0
    for p, out in zip(rnd.pieces, outs):
        numel = math.prod(p.local_shape)
        as_leading(out, p, n).copy_(gathered[:, offset : offset + numel].view(n, *p.local_shape))
        offset += numel


def pack_grads(
    grads: Sequence[torch.Tensor], pieces: Sequence[Piece], n: int, *, fused: bool = True
) -> torch.Tensor:
    """The gradients of ``pieces`` (full, padding cut) as one ``[n, total]`` buffer whose row
    ``r`` holds rank ``r``'s blocks, zero-padded: what a reduce-scatter takes.

    ``fused``: pieces all laid out as ``torch.chunk`` pads them go through one fused copy
    (``torch._chunk_cat``; the engine, on plain tensors). Otherwise, and always with
    ``fused=False`` (inside ``torch.func`` transforms), padding and layout are plain
    differentiable ops. The same buffer either way.
    """
    if fused and all(p.chunked for p in pieces):
        return torch._chunk_cat(list(grads), dim=0, num_chunks=n)  # pads, one copy
    rows = []
    for p, g in zip(pieces, grads):
        pad = n * p.local_shape[p.dim] - p.gathered_len
        if pad:
            g = torch.nn.functional.pad(g, [0, 0] * (g.ndim - 1 - p.dim) + [0, pad])
        rows.append(C._split_leading(g, n, p.dim).reshape(n, -1))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def unpack_reduced(reduced: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """A reduce-scatter's flat output as one block per piece (views)."""
    out, offset = [], 0
    for p in pieces:
        numel = math.prod(p.local_shape)
        out.append(reduced[offset : offset + numel].view(p.local_shape))
        offset += numel
    return out
