"""optax's element-wise and per-leaf transformations: ``clip``, ``zero_nans``, ``ema``, Lion,
and LAMB's trust ratio.

The element-wise ones map over the local tensors of the tree, so a ``Sharded`` value needs
nothing more: an element's update depends on that element alone. The trust ratio reduces
over each whole leaf, across the mesh.

Example:
    >>> import torch
    >>> t = clip(1.0)
    >>> t.update({"w": torch.tensor([-3.0, 0.5, 2.0])}, t.init(None))[0]
    {'w': tensor([-1.0000,  0.5000,  1.0000])}
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ._tree import (
    SAME_PARAMS_HINT,
    check_dtype,
    check_real,
    check_tensor_tree,
    check_unit_interval,
    leaves_like,
    local_leaves,
    require_params,
    zeros_like_tree,
)
from .clipping import leaf_norms
from .schedules import Schedule
from .transforms import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    Mask,
    OptState,
    Params,
    Updates,
    _bias_correction,
    _rounded,
    add_decayed_weights,
    chain,
    scale_by_adam,
    scale_by_learning_rate,
)


def clip(max_delta: float) -> GradientTransformation:
    """Clamp each element of the updates to ``[-max_delta, max_delta]`` (optax's ``clip``).

    Example:
        >>> import torch
        >>> clip(0.5).update({"w": torch.tensor([-1.0, 0.25])}, EmptyState())[0]
        {'w': tensor([-0.5000,  0.2500])}
    """
    max_delta = check_real("clip", "max_delta", max_delta, low=0.0)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        leaves, treedef = local_leaves(updates)
        out = [torch.clamp(u, -max_delta, max_delta) for u in leaves]
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`.

    Example:
        >>> import torch
        >>> zero_nans().init({"w": torch.ones(2)})
        ZeroNansState(found_nan={'w': tensor(False)})
    """

    found_nan: Any  # like params, one bool scalar per leaf: whether this rank's block of the
    # leaf held a NaN in the last update (local: no collective)


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by zeros (optax's ``zero_nans``).

    ``found_nan`` records, per leaf, whether the local block held a NaN.

    Example:
        >>> import torch
        >>> t = zero_nans()
        >>> u, s = t.update({"w": torch.tensor([1.0, float("nan")])}, t.init({"w": torch.ones(2)}))
        >>> u, s.found_nan
        ({'w': tensor([1., 0.])}, {'w': tensor(True)})
    """

    def init(params: Params) -> ZeroNansState:
        leaves, treedef = local_leaves(params)
        flags = [torch.zeros((), dtype=torch.bool, device=p.device) for p in leaves]
        return ZeroNansState(optree.tree_unflatten(treedef, flags))

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        leaves, treedef = local_leaves(updates)
        nans = [torch.isnan(u) for u in leaves]
        out = [torch.where(n, torch.zeros((), dtype=u.dtype), u) for u, n in zip(leaves, nans)]
        found = [n.any() for n in nans]
        return optree.tree_unflatten(treedef, out), ZeroNansState(
            optree.tree_unflatten(treedef, found)
        )

    return GradientTransformationExtraArgs(init, update)


class EmaState(NamedTuple):
    """State of :func:`ema`.

    Example:
        >>> import torch
        >>> ema(0.9).init({"w": torch.ones(1)})
        EmaState(count=0, ema={'w': tensor([0.])})
    """

    count: int | torch.Tensor  # updates so far (a tensor under apply_if_finite)
    ema: Any  # like params (dtype: accumulator_dtype if given): the moving average


def ema(
    decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """An exponential moving average of the updates, optax's ``ema``.

    ``ema = decay * ema + (1 - decay) * g``; emits it, divided by ``1 - decay**t`` if
    ``debias``.

    Example:
        >>> import torch
        >>> t = ema(0.5)
        >>> t.update({"w": torch.tensor([2.0])}, t.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([2.])}
    """
    decay = check_unit_interval("ema", "decay", decay)
    acc = check_dtype("ema", "accumulator_dtype", accumulator_dtype)

    def init(params: Params) -> EmaState:
        check_tensor_tree(params, "ema.init")
        return EmaState(count=0, ema=zeros_like_tree(params, acc))

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        old = leaves_like("ema", "state.ema", state.ema, updates)
        g, treedef = local_leaves(updates)
        count = state.count + 1
        new = [(1.0 - decay) * x + _rounded(decay, e.dtype) * e for x, e in zip(g, old)]
        out = torch._foreach_div(new, _bias_correction(decay, count)) if debias and new else new
        stored = [n.to(e.dtype) for n, e in zip(new, old)]
        return optree.tree_unflatten(treedef, out), EmaState(
            count, optree.tree_unflatten(treedef, stored)
        )

    return GradientTransformationExtraArgs(init, update)


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`.

    Example:
        >>> import torch
        >>> scale_by_lion().init({"w": torch.ones(1)})
        ScaleByLionState(count=0, mu={'w': tensor([0.])})
    """

    count: int | torch.Tensor  # updates so far
    mu: Any  # like params (dtype: mu_dtype if given): the momentum


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Lion's rescaling (Chen et al. 2023), optax's: ``sign((1 - b1) * g + b1 * mu)``, then
    ``mu = (1 - b2) * g + b2 * mu``.

    Example:
        >>> import torch
        >>> t = scale_by_lion()
        >>> t.update({"w": torch.tensor([0.3, -2.0])}, t.init({"w": torch.zeros(2)}))[0]
        {'w': tensor([ 1., -1.])}
    """
    b1 = check_unit_interval("scale_by_lion", "b1", b1)
    b2 = check_unit_interval("scale_by_lion", "b2", b2)
    mu_dtype = check_dtype("scale_by_lion", "mu_dtype", mu_dtype)

    def init(params: Params) -> ScaleByLionState:
        check_tensor_tree(params, "scale_by_lion.init")
        return ScaleByLionState(count=0, mu=zeros_like_tree(params, mu_dtype))

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        mu = leaves_like("scale_by_lion", "state.mu", state.mu, updates)
        g, treedef = local_leaves(updates)
        out = [torch.sign((1.0 - b1) * x + _rounded(b1, m.dtype) * m) for x, m in zip(g, mu)]
        new_mu = [((1.0 - b2) * x + _rounded(b2, m.dtype) * m).to(m.dtype) for x, m in zip(g, mu)]
        return optree.tree_unflatten(treedef, out), ScaleByLionState(
            state.count + 1, optree.tree_unflatten(treedef, new_mu)
        )

    return GradientTransformationExtraArgs(init, update)


def lion(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float = 1e-3,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Lion, optax's: :func:`scale_by_lion`, decoupled weight decay, the learning rate.

    Example:
        >>> import torch
        >>> opt = lion(0.1, weight_decay=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(params), params)[0]
        {'w': tensor([-0.1000,  0.1000])}
    """
    return chain(
        scale_by_lion(b1, b2, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformation:
    """Scale each leaf's update by ``trust_coefficient * |param| / (|update| + eps)``, optax's
    (LARS/LAMB's layer-wise trust ratio); ``1`` where either norm is zero.

    The norms are over the whole leaf, however it is sharded
    (:func:`~functional_fsdp.optim.clipping.leaf_norms`: one all-reduce per mesh axis for all
    leaves), so every rank scales its block of a leaf by the same ratio. Norms under
    ``min_norm`` count as ``min_norm``. ``update`` needs ``params``.

    Example:
        >>> import torch
        >>> t = scale_by_trust_ratio()
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> t.update({"w": torch.tensor([0.0, 0.5])}, t.init(p), p)[0]
        {'w': tensor([0., 5.])}
    """
    min_norm = check_real("scale_by_trust_ratio", "min_norm", min_norm, low=0.0)
    trust_coefficient = check_real("scale_by_trust_ratio", "trust_coefficient", trust_coefficient)
    eps = check_real("scale_by_trust_ratio", "eps", eps, low=0.0)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        require_params("scale_by_trust_ratio", params)
        u, treedef = local_leaves(updates)
        leaves_like("scale_by_trust_ratio", "params", params, updates, SAME_PARAMS_HINT)
        n = len(u)
        norms = leaf_norms((params, updates))  # one set of collectives for both trees
        out = []
        for x, p_norm, u_norm in zip(u, norms[:n], norms[n:]):
            p_norm = torch.clamp_min(p_norm, min_norm) if min_norm else p_norm
            u_norm = torch.clamp_min(u_norm, min_norm) if min_norm else u_norm
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            ratio = torch.where((p_norm == 0) | (u_norm == 0), 1.0, ratio)
            out.append(x * ratio.to(x.dtype))
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def lamb(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mask: Mask | None = None,
) -> GradientTransformation:
    """LAMB (You et al. 2020), optax's: Adam, decoupled weight decay, the per-leaf trust
    ratio over the whole (sharded) leaf, the learning rate.

    Example:
        >>> import torch
        >>> opt = lamb(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> opt.update({"w": torch.tensor([1.0, 1.0])}, opt.init(params), params)[0]["w"]
        tensor([-0.3536, -0.3536])
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )
