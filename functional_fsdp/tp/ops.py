"""Tensor-parallel operations: Megatron's conjugate pairs, the vocab-parallel lookup and loss.

Every op names the mesh axis it communicates over (``"tp"`` by default) and is
differentiable under plain autograd and ``torch.func``. The two conjugate pairs:

* :func:`copy_to` (identity forward, all-reduce backward) and :func:`reduce_from` (all-reduce
  forward, identity backward), the entry and exit of a colwise/rowwise linear pair: Megatron's
  names for :func:`functional_fsdp.all_reduce_grad` and :func:`functional_fsdp.all_reduce`
  over ``"tp"`` (aliases, one implementation each);
* :func:`scatter_to` (keep this rank's slice forward, all-gather backward) and
  :func:`gather_from` (all-gather forward, keep this rank's slice backward).

Their backward rules treat a value that is replicated over the axis as carrying its true
gradient on every rank, so a parameter replicated over ``tp`` needs no gradient reduction.
The sequence-parallel pair is plain :func:`functional_fsdp.all_gather` and
:func:`functional_fsdp.reduce_scatter` on the sequence dim (each other's transpose).

Per-rank slices and vocabulary offsets come from the rank's mesh coordinate as Python ints
on real processes (no index tensor, nothing copied to the device per call). On a simulated
mesh, where one process holds every rank, they are per-rank tensors built on the value's
device with :func:`~functional_fsdp.distributed.simulate.per_coordinate`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import collectives as C
from ..distributed.axes import axis_sizes, check_axes, local_coordinate
from ..distributed.simulate import is_simulated, per_coordinate


def _size(mesh: DeviceMesh, axis: str, what: str = "tensor parallelism") -> int:
    check_axes(
        mesh,
        (axis,),
        f"{what} over {axis!r}",
        f"name its tensor-parallel axis, one of {tuple(axis_sizes(mesh))} (e.g. axis='tp')",
    )
    return axis_sizes(mesh)[axis]


def _rank_offset(
    mesh: DeviceMesh, axis: str, scale: int, device: torch.device
) -> int | torch.Tensor:
    """``index(axis) * scale``: a Python int on real processes, per rank on a simulated mesh.

    A Python int needs no tensor at all (no host-to-device copy per call on a GPU). On a
    simulated mesh the value differs between the ranks of one process, so it is a 0-dim
    per-rank tensor made on ``device`` (a fill, not a copy from host data).
    """
    if not is_simulated():
        return local_coordinate(mesh)[axis] * scale
    return per_coordinate(
        mesh, lambda c: torch.full((), c[axis] * scale, dtype=torch.long, device=device)
    )


def _keep_block(blocks: torch.Tensor, index: int | torch.Tensor) -> torch.Tensor:
    """``blocks[index]`` of ``[n, ...]`` blocks, as a new contiguous tensor."""
    if isinstance(index, int):
        return blocks[index].clone(memory_format=torch.contiguous_format)
    return torch.index_select(blocks, 0, index.reshape(1)).squeeze(0)


def _check_divisible(x: torch.Tensor, dim: int, n: int, what: str, axis: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what} over {axis!r} (size {n}) needs dim {dim} of shape {tuple(x.shape)} to be "
            f"a multiple of {n}; choose sizes (e.g. the sequence length) that {n} divides."
        )


# --------------------------------------------------------------------------- conjugate ops


def copy_to(x: torch.Tensor, mesh: DeviceMesh, axis: str = "tp") -> torch.Tensor:
    """Megatron's name for :func:`~functional_fsdp.all_reduce_grad` over the tensor-parallel axis.

    An alias, not a second implementation: identity in forward, the gradient summed over
    ``axis`` in backward; only the axis defaults to ``"tp"``. Put it in front of a colwise
    linear (entering a tensor-parallel region): each rank's partial input gradient is summed.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     g = torch.func.grad(lambda x: copy_to(x, mesh).sum())(torch.ones(2))
        ...     g.tolist()
        [2.0, 2.0]
    """
    return C.all_reduce_grad(x, mesh, axis)


def reduce_from(x: torch.Tensor, mesh: DeviceMesh, axis: str = "tp") -> torch.Tensor:
    """Megatron's name for :func:`~functional_fsdp.all_reduce` (sum) over the tensor-parallel axis.

    An alias: the sum over ``axis`` in forward, identity in backward; only the axis defaults
    to ``"tp"``. Put it after a rowwise linear (leaving a tensor-parallel region): it adds
    the ranks' partial outputs.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     x = ff.shard(torch.tensor([1.0, 2.0]), mesh, ff.P("tp")).local
        ...     ff.rank_values(reduce_from(x, mesh))[1].tolist()
        [3.0]
    """
    return C.all_reduce(x, mesh, axis)


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, index: int | torch.Tensor, n: int, mesh: Any, axis: str, dim: int):  # type: ignore[override]
        return _keep_block(C._split_leading(x, n, dim), index)  # of [n, ..., len/n, ...]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, _, _, ctx.mesh, ctx.axis, ctx.dim = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        full = C._move_leading(C.wait(C.raw_all_gather(grad, ctx.mesh, ctx.axis)), ctx.dim)
        return full, None, None, None, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, index: int | torch.Tensor, n: int, mesh: Any, axis: str, dim: int):  # type: ignore[override]
        return C._move_leading(C.wait(C.raw_all_gather(x, mesh, axis)), dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.index, ctx.n, _, _, ctx.dim = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        blocks = C._split_leading(grad, ctx.n, ctx.dim)
        return _keep_block(blocks, ctx.index), None, None, None, None, None


def scatter_to(x: torch.Tensor, mesh: DeviceMesh, axis: str = "tp", dim: int = -1) -> torch.Tensor:
    """Keep this rank's block of ``dim`` (no communication); all-gather it in backward.

    ``x`` must be the same on every rank of ``axis`` and ``x.shape[dim]`` a multiple of its
    size. The transpose of :func:`gather_from`.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     [t.tolist() for t in ff.rank_values(scatter_to(torch.arange(4.0), mesh))]
        [[0.0, 1.0], [2.0, 3.0]]
    """
    n = _size(mesh, axis, "scatter_to")
    dim = dim % x.ndim
    _check_divisible(x, dim, n, "scatter_to", axis)
    if n == 1:
        return x
    return _ScatterTo.apply(x, _rank_offset(mesh, axis, 1, x.device), n, mesh, axis, dim)


def gather_from(x: torch.Tensor, mesh: DeviceMesh, axis: str = "tp", dim: int = -1) -> torch.Tensor:
    """All-gather the ranks' blocks along ``dim``; in backward keep this rank's block.

    The result is replicated over ``axis``; its gradient is taken to be the same on every
    rank, so backward only slices (no communication). The transpose of :func:`scatter_to`.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     x = ff.shard(torch.arange(4.0), mesh, ff.P("tp")).local
        ...     ff.rank_values(gather_from(x, mesh))[0].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    n = _size(mesh, axis, "gather_from")
    dim = dim % x.ndim
    if n == 1:
        return x
    return _GatherFrom.apply(x, _rank_offset(mesh, axis, 1, x.device), n, mesh, axis, dim)


def fill_padding(
    x: torch.Tensor, total: int, mesh: DeviceMesh, axis: str = "tp", value: float = float("-inf")
) -> torch.Tensor:
    """``x``'s last-dim features past ``total`` (the padding of an uneven split) set to ``value``.

    ``x`` is this rank's block of a last dim of ``total`` features split over ``axis`` with
    the last block padded (ceil division), as :class:`~functional_fsdp.P` pads.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     x = ff.shard(torch.arange(3.0), mesh, ff.P("tp")).local
        ...     ff.rank_values(fill_padding(x, 3, mesh))[1].tolist()
        [2.0, -inf]
    """
    n = x.shape[-1]
    index = torch.arange(n, device=x.device) + _rank_offset(mesh, axis, n, x.device)
    return torch.where(index < total, x, torch.full_like(x, value))


# --------------------------------------------------------------------------- vocab parallel


def _local_ids(
    ids: torch.Tensor, rows: int, mesh: DeviceMesh, axis: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids shifted into this rank's vocabulary block, and the mask of ids it owns."""
    local = ids - _rank_offset(mesh, axis, rows, ids.device)
    inside = (local >= 0) & (local < rows)
    return torch.where(inside, local, torch.zeros_like(local)), inside


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    mesh: DeviceMesh,
    axis: str = "tp",
    *,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """Look ``ids`` up in an embedding table split by rows (the vocabulary) over ``axis``.

    Each rank looks up the ids in its block (others give zero) and the partial results are
    all-reduced; with ``sequence_dim`` they are reduce-scattered along that dim instead, so
    the output enters a sequence-parallel region.

    Args:
        ids: token ids into the full vocabulary, the same on every rank of ``axis``.
        weight: this rank's block of rows, ``[vocab / size(axis), dim]``.
        mesh: the mesh.
        axis: the tensor-parallel axis.
        sequence_dim: reduce-scatter the output along this dim (sequence parallelism).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> table = torch.arange(8.0).reshape(4, 2)
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     w = ff.shard(table, mesh, ff.P("tp")).local
        ...     out = vocab_parallel_embedding(torch.tensor([3, 0]), w, mesh)
        ...     ff.rank_values(out)[1].tolist()
        [[6.0, 7.0], [0.0, 1.0]]
    """
    _size(mesh, axis, "vocab_parallel_embedding")
    local, inside = _local_ids(ids, weight.shape[0], mesh, axis)
    out = F.embedding(local, weight) * inside.unsqueeze(-1).to(weight.dtype)
    if sequence_dim is None:
        return C.all_reduce(out, mesh, axis)
    return C.reduce_scatter(out, mesh, axis, sequence_dim)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mesh: DeviceMesh,
    axis: str = "tp",
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """Mean cross entropy over logits split along the vocabulary (last dim) over ``axis``.

    The full vocabulary is never gathered: each rank reduces its block, and three small
    collectives over ``axis`` combine the rows' max (an all-gather of one value per row), the
    sum of exponentials and the target logit (all-reduces). Computed in float32. The result
    equals ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten())`` (``0`` when
    every target is ignored) and is the same on every rank of ``axis``.

    Args:
        logits: this rank's block of the logits, ``[..., vocab / size(axis)]``.
        targets: ids into the full vocabulary, ``[...]``, the same on every rank of ``axis``.
        mesh: the mesh.
        axis: the tensor-parallel axis.
        ignore_index: targets with this value do not count.
        reduction: ``"mean"`` over the counted targets, or ``"sum"`` (as
            ``F.cross_entropy``'s): with the count ``(targets != ignore_index).sum()``, the
            ``(sum, count)`` loss of ``train_step``, whose step divides by the global count;
            or ``"none"``: each target's loss, in ``targets``' shape (``0`` where ignored).

    Example:
        >>> import torch, torch.nn.functional as F, functional_fsdp as ff
        >>> full, tgt = torch.randn(3, 8), torch.tensor([1, 7, 4])
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     local = ff.shard(full, mesh, ff.P(None, "tp")).local
        ...     loss = vocab_parallel_cross_entropy(local, tgt, mesh)
        ...     torch.allclose(ff.rank_values(loss)[0], F.cross_entropy(full, tgt))
        True
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got "
            f"{reduction!r}."
        )
    _size(mesh, axis, "vocab_parallel_cross_entropy")
    vocab, shape = logits.shape[-1], targets.shape
    logits = logits.reshape(-1, vocab).float()
    targets = targets.reshape(-1)
    with torch.no_grad():
        row_max = logits.detach().amax(-1)
        row_max = C.all_gather(row_max.unsqueeze(0), mesh, axis, 0).amax(0)
    shifted = logits - row_max.unsqueeze(-1)
    sum_exp = C.all_reduce(shifted.exp().sum(-1), mesh, axis)
    local, inside = _local_ids(targets, vocab, mesh, axis)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    target_logit = C.all_reduce(torch.where(inside, picked, torch.zeros_like(picked)), mesh, axis)
    losses = sum_exp.log() - target_logit
    valid = targets != ignore_index
    losses = torch.where(valid, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses.reshape(shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().clamp(min=1)
