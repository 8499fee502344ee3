"""Adafactor (Shazeer & Stern 2018), optax's, on sharded weights.

Adafactor keeps, for a matrix, the running mean of the squared gradient over its rows and over
its columns instead of a full second moment. On a weight split over a mesh those means run over
the whole weight: each rank sums its block (no padding) along the reduced dim and the partial
sums are all-reduced over exactly the mesh axes that split that dim. A row-sharded and a
column-sharded weight then get the numbers of the unsharded one. The block-RMS steps
(clipping, the parameter scale) reduce each whole leaf the same way.

The factored statistics are this rank's (the rows or columns of its block), kept as plain
tensors in the state.

Example:
    >>> import torch
    >>> opt = adafactor(1e-2, min_dim_size_to_factor=2)
    >>> params = {"w": torch.ones(3, 2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.full((3, 2), 0.5)}, state, params)
    >>> updates["w"][0]
    tensor([-0.0100, -0.0100])
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from ..distributed import collectives as C
from ..distributed import process
from ..distributed.mesh import coordinate_of
from ..distributed.simulate import is_simulated
from ..sharded import Sharded, unpad
from ._tree import check_dtype, check_real, require_params
from .clipping import _padded_dims, _real_part, leaf_norms
from .elementwise import ema
from .schedules import Schedule
from .transforms import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    Mask,
    OptState,
    Params,
    Updates,
    add_decayed_weights,
    chain,
    scale,
    scale_by_learning_rate,
)


class FactoredState(NamedTuple):
    """State of :func:`scale_by_factored_rms` (optax's fields).

    Example:
        >>> import torch
        >>> scale_by_factored_rms(min_dim_size_to_factor=2).init({"w": torch.ones(3, 2)})
        FactoredState(count=0, v_row={'w': tensor([0., 0.])}, v_col={'w': tensor([0., 0., 0.])}, v={'w': tensor([0.])})
    """

    count: int | torch.Tensor  # updates so far
    v_row: Any  # per leaf: a factored leaf's running mean over its largest dim (this rank's
    # part of it, a plain tensor), else a 1-element placeholder
    v_col: Any  # per leaf: the mean over its second-largest dim, else a placeholder
    v: Any  # per leaf: the full second moment of an unfactored leaf, else a placeholder


def _factored_dims(shape: tuple[int, ...], factored: bool, min_size: int) -> tuple[int, int] | None:
    """optax's choice: the two largest dims ``(d1, d0)``, if the smaller is >= ``min_size``."""
    if not factored or len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_size:
        return None
    return int(order[-2]), int(order[-1])


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.global_shape) if isinstance(leaf, Sharded) else tuple(leaf.shape)


def _local(leaf: Any) -> torch.Tensor:
    return leaf.local if isinstance(leaf, Sharded) else leaf


def _mask(leaf: Any) -> torch.Tensor | None:
    """1 on this rank's real elements, 0 on padding (``None`` when there is no padding)."""
    if not isinstance(leaf, Sharded) or not _padded_dims(leaf.layout):
        return None
    ones = Sharded(torch.ones_like(leaf.local), leaf.global_shape, leaf.spec, leaf.mesh)
    if is_simulated():
        return _real_part(ones)
    mask = torch.zeros_like(leaf.local)
    unpad(mask, leaf.layout, coordinate_of(leaf.mesh, process.rank())).fill_(1)
    return mask


def _sum(
    x: torch.Tensor, dim: int, leaf: Any, leaf_dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """``x.sum(dim)`` over the whole leaf: all-reduced over the mesh axes that split the
    leaf's dim ``leaf_dim`` (``dim`` unless ``x`` lacks some of the leaf's dims)."""
    out = x.sum(dim, keepdim=keepdim)
    if isinstance(leaf, Sharded):
        axes = leaf.spec.entry(dim if leaf_dim is None else leaf_dim)
        if axes:
            out = C.wait(C.raw_all_reduce(out, leaf.mesh, axes))
    return out


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
) -> GradientTransformation:
    """Adafactor's rescaling, optax's: divide by the root of factored (row and column)
    running means of ``g**2 + epsilon``, over the whole (sharded) leaf.

    Example:
        >>> import torch
        >>> t = scale_by_factored_rms()
        >>> g = {"b": torch.tensor([2.0, -4.0])}  # 1-D: unfactored, the first step is sign(g)
        >>> t.update(g, t.init(g), g)[0]
        {'b': tensor([ 1., -1.])}
    """
    decay_rate = check_real("scale_by_factored_rms", "decay_rate", decay_rate)
    epsilon = check_real("scale_by_factored_rms", "epsilon", epsilon, low=0.0)

    def init(params: Params) -> FactoredState:
        leaves, treedef = optree.tree_flatten(params)
        rows, cols, vs = [], [], []
        for leaf in leaves:
            x = _local(leaf)
            dims = _factored_dims(_shape(leaf), factored, min_dim_size_to_factor)
            one = torch.zeros(1, dtype=x.dtype, device=x.device)
            if dims is None:
                rows.append(one), cols.append(one.clone()), vs.append(torch.zeros_like(x))
            else:
                d1, d0 = dims
                rows.append(torch.zeros_like(x.sum(d0)))
                cols.append(torch.zeros_like(x.sum(d1)))
                vs.append(one)
        make = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return FactoredState(0, make(rows), make(cols), make(vs))

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        require_params("scale_by_factored_rms", params)
        leaves, treedef = optree.tree_flatten(updates)
        rows = treedef.flatten_up_to(state.v_row)
        cols = treedef.flatten_up_to(state.v_col)
        vs = treedef.flatten_up_to(state.v)
        step = state.count - step_offset + 1
        if isinstance(step, torch.Tensor):
            decay = 1.0 - step.to(torch.float64) ** (-decay_rate)
        else:
            decay = 1.0 - float(step) ** (-decay_rate)
        out, new_rows, new_cols, new_vs = [], [], [], []
        for leaf, v_row, v_col, v in zip(leaves, rows, cols, vs):
            g = _local(leaf)
            shape = _shape(leaf)
            mask = _mask(leaf)
            g2 = g * g + epsilon
            if mask is not None:
                g2 = g2 * mask
            dims = _factored_dims(shape, factored, min_dim_size_to_factor)
            if dims is None:
                v = (decay * v + (1.0 - decay) * g2).to(v.dtype)
                u = g * v**-0.5
            else:
                d1, d0 = dims
                v_row = decay * v_row + (1.0 - decay) * (_sum(g2, d0, leaf) / shape[d0])
                v_col = decay * v_col + (1.0 - decay) * (_sum(g2, d1, leaf) / shape[d1])
                v_row, v_col = v_row.to(g.dtype), v_col.to(g.dtype)
                reduced_d1 = d1 - 1 if d1 > d0 else d1
                # v_row's dim reduced_d1 is the leaf's d1: sum over the ranks that split it.
                row_mean = _sum(v_row, reduced_d1, leaf, d1, keepdim=True) / shape[d1]
                u = g * (v_row / row_mean).pow(-0.5).unsqueeze(d0) * v_col.pow(-0.5).unsqueeze(d1)
            if mask is not None:  # padding: 0 (its statistics are 0, its factors inf)
                u = torch.where(mask.bool(), u, torch.zeros((), dtype=u.dtype, device=u.device))
            out.append(_like(leaf, u))
            new_rows.append(v_row), new_cols.append(v_col), new_vs.append(v)
        make = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return make(out), FactoredState(
            state.count + 1, make(new_rows), make(new_cols), make(new_vs)
        )

    return GradientTransformationExtraArgs(init, update)


def _like(leaf: Any, local: torch.Tensor) -> Any:
    if isinstance(leaf, Sharded):
        return Sharded(local, leaf.global_shape, leaf.spec, leaf.mesh)
    return local


def _rms(norms: list[torch.Tensor], leaves: list[Any]) -> list[torch.Tensor]:
    return [n / math.sqrt(max(math.prod(_shape(x)), 1)) for n, x in zip(norms, leaves)]


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Divide each leaf by ``max(1, rms(leaf) / threshold)``, the RMS over the whole
    (sharded) leaf (optax's).

    Example:
        >>> import torch
        >>> clip_by_block_rms(1.0).update({"w": torch.tensor([3.0, 4.0])}, EmptyState())[0]["w"]
        tensor([0.8485, 1.1314])
    """
    threshold = check_real("clip_by_block_rms", "threshold", threshold, low=0.0)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        leaves, treedef = optree.tree_flatten(updates)
        rms = _rms(leaf_norms(updates), leaves)
        out = [
            _like(x, _local(x) / torch.clamp_min(r / threshold, 1.0).to(_local(x).dtype))
            for x, r in zip(leaves, rms)
        ]
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Multiply each leaf's update by ``max(rms(param), min_scale)``, the RMS over the whole
    (sharded) parameter (optax's).

    Example:
        >>> import torch
        >>> p = {"w": torch.full((4,), 2.0)}
        >>> scale_by_param_block_rms().update({"w": torch.ones(4)}, EmptyState(), p)[0]
        {'w': tensor([2., 2., 2., 2.])}
    """
    min_scale = check_real("scale_by_param_block_rms", "min_scale", min_scale, low=0.0)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        require_params("scale_by_param_block_rms", params)
        leaves, treedef = optree.tree_flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        rms = _rms(leaf_norms(params), p_leaves)
        out = [
            _like(x, _local(x) * torch.where(r <= min_scale, min_scale, r).to(_local(x).dtype))
            for x, r in zip(leaves, rms)
        ]
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def adafactor(
    learning_rate: float | Schedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    dtype_momentum: torch.dtype = torch.float32,
    weight_decay_rate: float | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Mask | None = None,
) -> GradientTransformation:
    """Adafactor, optax's: the same arguments, order and defaults, on sharded weights.

    Example:
        >>> import torch
        >>> opt = adafactor(0.1)
        >>> params = {"b": torch.ones(2)}
        >>> opt.update({"b": torch.tensor([1.0, -1.0])}, opt.init(params), params)[0]
        {'b': tensor([-0.1000,  0.1000])}
    """
    check_dtype("adafactor", "dtype_momentum", dtype_momentum)
    parts = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        parts.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        parts.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        parts.append(scale_by_param_block_rms())
    if momentum is not None:
        parts.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        parts.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    parts.append(scale(-1.0))
    return chain(*parts)
