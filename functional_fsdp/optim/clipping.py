"""Mesh-aware global-norm clipping.

:func:`global_norm` is the one optimizer piece that communicates. Each rank squares and sums
its local blocks (padding is zero), grouped by mesh and by the mesh axes each value is split
over. A group's partial sum is then all-reduced over exactly those axes, and over none of the
axes where the value is replicated, so no copy is counted twice. All groups that need a
given mesh axis share one all-reduce of a small stacked vector: a 2-D mesh costs at most two
all-reduces of a few scalars, whatever the number of tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from .._tree import dotted
from ..distributed import collectives as C
from ..distributed import process
from ..distributed.mesh import axis_names, coordinate_of
from ..distributed.simulate import is_simulated, per_coordinate
from ..sharded import Sharded, unpad
from ..spec import Layout
from ._tree import check_real, map_foreach
from .transforms import (
    EmptyState,
    GradientTransformationExtraArgs,
    OptState,
    Params,
    Updates,
)


def norm_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype :func:`global_norm` computes in for values of ``dtypes``: float32, or
    float64 if any is float64 (narrower values are widened, exactly, before they are summed).

    Example:
        >>> norm_dtype([torch.bfloat16, torch.float32])
        torch.float32
    """
    acc = torch.float32
    for dtype in dtypes:
        acc = torch.promote_types(acc, dtype)
    return acc


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, in :func:`norm_dtype` of them all."""
    return list(torch._foreach_norm(tensors, 2, dtype=norm_dtype(t.dtype for t in tensors)))


def _padded_dims(layout: Layout) -> list[int]:
    """The dims where some coordinate's block has padding (a split that does not divide)."""
    sizes = layout.sizes
    out = []
    for dim in range(len(layout.global_shape)):
        lengths = layout.block_sizes(dim)
        axes = layout.spec.entry(dim)
        if any(lengths[i] * sizes[a] != lengths[i - 1] for i, a in enumerate(axes, start=1)):
            out.append(dim)
    return out


def _real_part(value: Sharded) -> torch.Tensor:
    """The local block without its padding, whatever the padding holds.

    Padding is zero after :func:`shard` and the collectives, but ``tree_map`` over local
    blocks (``t + 1``, ``t.exp()``) can make it non-zero, so reductions must not count it.
    On real processes this is a view; on a simulated mesh (where ranks' real lengths
    differ) the padding is masked out.
    """
    layout = value.layout
    dims = _padded_dims(layout)
    if not dims:
        return value.local
    if not is_simulated():
        return unpad(value.local, layout, coordinate_of(value.mesh, process.rank()))
    out = value.local
    for dim in dims:
        length = out.shape[dim]

        def keep(coord: dict[str, int], d: int = dim, n: int = length) -> torch.Tensor:
            pad = layout.owned(coord)[1][d]
            return torch.arange(n, device=value.local.device) < n - pad

        shape = [1] * out.ndim
        shape[dim] = length
        out = out * per_coordinate(value.mesh, keep).view(shape)
    return out


def global_norm(tree: Any) -> torch.Tensor:
    """The 2-norm of all values in ``tree`` taken together, correct across a mesh.

    A ``Sharded`` value contributes the squares of its local block (never its padding), summed
    over the mesh axes its spec splits it over; over the axes where it is replicated it
    counts once. Plain tensors are taken as replicated and count once. Values are grouped by
    mesh and sharded axes and each mesh axis is reduced once, for all groups together, so a
    2-D mesh costs at most two tiny all-reduces. Computed in float32 (float64 if any value is
    float64). Each rank counts its own copy of a replicated value, so the result is the same
    on every rank when replicas agree (as the gradient rule makes them).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     g = {"w": torch.full((3, 2), 2.0), "b": torch.ones(4)}
        ...     g = ff.shard(g, mesh, {"w": ff.P("dp"), "b": ff.P()})
        ...     [round(n.item(), 4) for n in ff.rank_values(global_norm(g))]
        [5.2915, 5.2915]
    """
    return _reduce("global_norm", tree, finite=False)[0]


def global_norm_and_finite(tree: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_norm` of ``tree``, and whether every element of ``tree`` is finite.

    The finiteness is decided element by element (optax's ``apply_if_finite`` does so): a
    finite gradient of ``1e20`` overflows the float32 norm to ``inf`` but is finite. Each
    rank reads its local blocks once more (a max-abs per tensor, no padding) and counts its
    non-finite tensors; the counts travel in the norm's own all-reduces, one more number
    beside each partial sum of squares, so the flag costs no collective of its own and is
    the same on every rank.

    Returns:
        ``(norm, finite)``: the norm as :func:`global_norm` gives it (bitwise), and a 0-dim
        bool tensor.

    Example:
        >>> import torch
        >>> norm, finite = global_norm_and_finite({"w": torch.tensor([1e20, 1.0])})
        >>> norm, finite
        (tensor(inf), tensor(True))
    """
    norm, finite = _reduce("global_norm_and_finite", tree, finite=True)
    return norm, torch.ones((), dtype=torch.bool) if finite is None else finite


def _reduce(where: str, tree: Any, *, finite: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global norm of ``tree`` and, if ``finite``, whether all its elements are finite."""
    keys: list[tuple[DeviceMesh, tuple[str, ...]] | None] = []
    tensors: list[torch.Tensor] = []
    for path, leaf in zip(*optree.tree_flatten_with_path(tree)[:2]):
        if isinstance(leaf, Sharded):
            axes = tuple(a for a in axis_names(leaf.mesh) if a in leaf.spec.axes)
            keys.append((leaf.mesh, axes) if axes else None)
            tensors.append(_real_part(leaf))
        elif isinstance(leaf, torch.Tensor):
            keys.append(None)
            tensors.append(leaf)
        else:
            raise TypeError(
                f"{where}: {dotted(path) or '<root>'} is {leaf!r} "
                f"({type(leaf).__name__}); expected a tree of tensors or Sharded values."
            )
    if not tensors:
        zero = torch.zeros((), dtype=torch.float32)
        return zero, (torch.ones((), dtype=torch.bool) if finite else None)
    norms = _norms(tensors)
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    partial = {
        key: torch.stack([norms[i] for i in idx]).square().sum() for key, idx in groups.items()
    }
    # Non-finite tensors per group: a max-abs is not finite (it cannot overflow, unlike the
    # sum of squares). Counted beside the sums of squares, in the same all-reduces.
    bad: dict[Any, torch.Tensor] = {}
    if finite:
        dtype = partial[keys[0]].dtype
        full = [i for i, t in enumerate(tensors) if t.numel()]  # a block may be all padding
        amax = (
            dict(zip(full, torch._foreach_norm([tensors[i] for i in full], math.inf)))
            if full
            else {}
        )
        zero = torch.zeros((), dtype=dtype, device=norms[0].device)
        flags = torch.stack(
            [
                (~torch.isfinite(amax[i])).to(dtype) if i in amax else zero
                for i in range(len(tensors))
            ]
        )
        bad = {key: flags[idx].sum() for key, idx in groups.items()}
    meshes: dict[DeviceMesh, None] = {k[0]: None for k in partial if k is not None}
    for mesh in meshes:
        for axis in axis_names(mesh):
            idx = [k for k in partial if k is not None and k[0] == mesh and axis in k[1]]
            if idx:
                sent = [partial[k] for k in idx] + [bad[k] for k in idx if finite]
                summed = C.wait(C.raw_all_reduce(torch.stack(sent), mesh, axis)).unbind(0)
                partial.update(zip(idx, summed[: len(idx)]))
                bad.update(zip(idx, summed[len(idx) :]))
    norm = torch.stack(list(partial.values())).sum().sqrt()
    if not finite:
        return norm, None
    return norm, torch.stack(list(bad.values())).sum() == 0


def leaf_norms(tree: Any) -> list[torch.Tensor]:
    """Each leaf's 2-norm over the whole value, correct across a mesh (a list in the order of
    ``optree.tree_leaves(tree)``, ``Sharded`` values as leaves).

    A ``Sharded`` leaf's local sum of squares (no padding) is summed over the axes its spec
    splits it over, as in :func:`global_norm`: leaves split over the same axis share one
    all-reduce of a stacked vector, so a 1-D mesh costs one all-reduce whatever the number of
    leaves. Each norm is in the leaf's dtype widened to at least float32.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     g = ff.shard({"w": torch.full((3, 4), 0.5), "b": torch.ones(4)}, mesh, ff.P("dp"))
        ...     [[round(x.item(), 4) for x in ff.rank_values(n)] for n in leaf_norms(g)]
        [[2.0, 2.0], [1.7321, 1.7321]]
    """
    leaves = optree.tree_leaves(tree, none_is_leaf=False)
    sums: list[torch.Tensor] = []
    keys: list[tuple[DeviceMesh, tuple[str, ...]] | None] = []
    for leaf in leaves:
        if isinstance(leaf, Sharded):
            t = _real_part(leaf)
            axes = tuple(a for a in axis_names(leaf.mesh) if a in leaf.spec.axes)
            keys.append((leaf.mesh, axes) if axes else None)
        elif isinstance(leaf, torch.Tensor):
            t = leaf
            keys.append(None)
        else:
            raise TypeError(
                f"leaf_norms: a leaf is {leaf!r} ({type(leaf).__name__}); expected a tree of "
                f"tensors or Sharded values."
            )
        sums.append(torch.linalg.vector_norm(t, dtype=norm_dtype([t.dtype])).square())
    meshes: dict[DeviceMesh, None] = {k[0]: None for k in keys if k is not None}
    for mesh in meshes:
        for axis in axis_names(mesh):
            idx = [i for i, k in enumerate(keys) if k is not None and k[0] == mesh and axis in k[1]]
            if idx:
                dtype = norm_dtype(sums[i].dtype for i in idx)
                stacked = torch.stack([sums[i].to(dtype) for i in idx])
                summed = C.wait(C.raw_all_reduce(stacked, mesh, axis)).unbind(0)
                for i, v in zip(idx, summed):
                    sums[i] = v.to(sums[i].dtype)
    return [x.sqrt() for x in sums]


def clip_by_global_norm(max_norm: float, *, eps: float = 0.0) -> GradientTransformationExtraArgs:
    """Scale updates by ``max_norm / global_norm`` when the norm exceeds ``max_norm`` (optax).

    Updates whose norm is under ``max_norm`` pass unchanged (bitwise). ``eps=1e-6`` gives
    torch's ``clip_grad_norm_`` instead: a scale of ``min(1, max_norm / (norm + eps))``, which
    also shrinks updates just under the limit (by ``1 - eps / norm``).

    The norm is :func:`global_norm`, so it is right for any mix of sharded and replicated
    values on any mesh, and every rank applies the same scale. No host sync. Given
    ``grad_norm=`` (the :func:`global_norm` of these updates, which ``train_step`` computes
    for its metrics anyway), ``update`` uses it instead of computing the norm again: one
    all-reduce per step fewer.

    Args:
        max_norm: the largest global norm updates keep (positive).
        eps: keyword-only; ``0.0`` is optax's rule, ``1e-6`` torch's ``clip_grad_norm_``.

    Example:
        >>> import torch
        >>> t = clip_by_global_norm(1.0)
        >>> t.update({"w": torch.tensor([3.0, 4.0])}, t.init(None))[0]
        {'w': tensor([0.6000, 0.8000])}
        >>> t.update({"w": torch.tensor([0.6, 0.8])}, t.init(None))[0]  # at the limit: as given
        {'w': tensor([0.6000, 0.8000])}
    """
    max_norm = check_real("clip_by_global_norm", "max_norm", max_norm, low=0.0)
    eps = check_real("clip_by_global_norm", "eps", eps, low=0.0)
    if max_norm == 0.0:
        raise ValueError("clip_by_global_norm: max_norm must be positive, got 0.0.")

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        grad_norm: torch.Tensor | None = None,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        norm = global_norm(updates) if grad_norm is None else grad_norm
        if eps:  # torch's clip_grad_norm_
            coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        else:  # optax's: only a norm over the limit scales
            coef = torch.where(norm < max_norm, 1.0, max_norm / norm)
        return map_foreach(torch._foreach_mul, updates, coef, donate=donate), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)
