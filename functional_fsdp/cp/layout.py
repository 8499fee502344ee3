"""Where each token lives when a mesh axis splits the sequence (context parallelism).

The sequence of ``T`` tokens is cut into ``2 · cp`` equal chunks; rank ``i`` of the ``cp``
axis holds chunks ``i`` and ``2 · cp − 1 − i`` (the load balance of torchtitan, Megatron-LM
and the Llama 3 paper): under a causal mask the early chunks attend to few keys and the late
ones to many, so each rank gets one of each and no rank idles. These are pure functions of
the sizes; :func:`split_sequence` and :func:`sequence_positions` apply them to this rank.

Example:
    >>> chunk_layout(8, 2)
    [[0, 1, 6, 7], [2, 3, 4, 5]]
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.axes import axis_sizes, describe_mesh
from ..distributed.simulate import per_coordinate


def check_divides(length: int, cp: int, what: str, mesh: DeviceMesh, axis: str) -> None:
    """Raise unless a sequence of ``length`` tokens splits into ``2 · cp`` equal chunks."""
    if length % (2 * cp):
        multiple = 2 * cp
        raise ValueError(
            f"{what} has a sequence of {length} tokens (dim 1), which does not split into "
            f"2·cp = {multiple} equal chunks over the {axis!r} axis of {describe_mesh(mesh)} "
            f"(each rank holds two chunks, one early and one late, so that causal attention "
            f"costs every rank the same). Pad the global batch to {-(-length // multiple) * multiple} "
            f"tokens (a multiple of {multiple}): input_ids with the pad id, labels with -100, "
            f"position_ids continuing (ff.cp.pad_sequence does this)."
        )


@functools.lru_cache(maxsize=256)
def _layout(length: int, cp: int) -> tuple[tuple[int, ...], ...]:
    chunk = length // (2 * cp)
    ranks = []
    for i in range(cp):
        first, last = i * chunk, (2 * cp - 1 - i) * chunk
        ranks.append(tuple(range(first, first + chunk)) + tuple(range(last, last + chunk)))
    return tuple(ranks)


def chunk_layout(length: int, cp: int) -> list[list[int]]:
    """The global token indices each rank of a ``cp``-way split holds, in rank order.

    Args:
        length: the global sequence length, a multiple of ``2 · cp``.
        cp: the size of the axis that splits the sequence.

    Example:
        >>> chunk_layout(12, 3)
        [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    """
    if cp < 1 or length % (2 * cp):
        raise ValueError(
            f"chunk_layout({length}, {cp}): the length must be a multiple of 2·cp = {2 * cp}."
        )
    return [list(r) for r in _layout(length, cp)]


def local_index(local_length: int, cp: int, rank: int, device: torch.device | None = None):
    """The global indices of the ``local_length`` tokens that ``rank`` holds (a tensor)."""
    return torch.tensor(_layout(local_length * cp, cp)[rank], dtype=torch.long, device=device)


def gathered_index(local_length: int, cp: int, device: torch.device | None = None):
    """The global index of each token of an all-gather over the axis (rank order)."""
    flat = [g for r in _layout(local_length * cp, cp) for g in r]
    return torch.tensor(flat, dtype=torch.long, device=device)


def sequence_positions(
    mesh: DeviceMesh, axis: str, local_length: int, device: torch.device | None = None
) -> torch.Tensor:
    """This rank's global token indices (a per-rank tensor on a simulated mesh)."""
    cp = axis_sizes(mesh)[axis]
    return per_coordinate(mesh, lambda c: local_index(local_length, cp, c[axis], device))


def split_sequence(t: torch.Tensor, mesh: DeviceMesh, axis: str, what: str = "a tensor"):
    """This rank's two chunks of ``t`` along dim 1 (the sequence), load-balanced."""
    cp = axis_sizes(mesh)[axis]
    if cp == 1:
        return t
    check_divides(t.shape[1], cp, f"{what} (shape {tuple(t.shape)})", mesh, axis)
    index = sequence_positions(mesh, axis, t.shape[1] // cp, t.device)
    return t.index_select(1, index)


_FILL = {"labels": -100, "shift_labels": -100, "attention_mask": 0}


def pad_sequence(batch: Any, multiple: int, *, pad_id: int = 0) -> Any:
    """Pad every sequence of a batch (dim 1 of each tensor of 2 or more dims) to a multiple.

    For a context-parallel split (``2 · cp`` chunks) of sequences of any length. By key:
    ``labels`` and ``shift_labels`` are padded with -100 (no loss), ``attention_mask`` with
    0, ``position_ids`` go on counting (the padding is a continuation of the last document,
    which no real token attends to), every other tensor with ``pad_id``. Pure: a new tree.

    Args:
        batch: a tensor, or a pytree (dicts keyed as above) of tensors.
        multiple: the length to round up to a multiple of (``2 · cp``).
        pad_id: the filler of ``input_ids`` and other unnamed tensors.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> out = ff.cp.pad_sequence({"input_ids": torch.tensor([[5, 6, 7]]),
        ...                           "position_ids": torch.tensor([[0, 1, 2]])}, 4)
        >>> out["input_ids"].tolist(), out["position_ids"].tolist()
        ([[5, 6, 7, 0]], [[0, 1, 2, 3]])
    """
    if multiple < 1:
        raise ValueError(f"pad_sequence(multiple={multiple}): a positive length multiple.")

    def pad(path: tuple[Any, ...], t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.ndim < 2:
            return t
        extra = -t.shape[1] % multiple
        if not extra:
            return t
        name = str(path[-1]) if path else ""
        if name == "position_ids":
            last = t[:, -1:]
            steps = torch.arange(1, extra + 1, device=t.device, dtype=t.dtype)
            tail = (last + steps).expand(t.shape[0], extra, *t.shape[2:]) if t.ndim == 2 else None
            if tail is None:
                raise ValueError(
                    f"pad_sequence: position_ids of shape {tuple(t.shape)} must be 2D."
                )
            return torch.cat([t, tail], dim=1)
        fill = _FILL.get(name, pad_id)
        shape = (t.shape[0], extra, *t.shape[2:])
        return torch.cat([t, t.new_full(shape, fill)], dim=1)

    return optree.tree_map_with_path(pad, batch, none_is_leaf=True)
