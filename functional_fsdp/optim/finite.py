"""Skip updates whose gradients (or loss) are not finite: optax's ``apply_if_finite``.

The decision is a tensor, never a Python ``if`` on a device value: the inner optimizer runs
every step, and its results are selected with ``torch.where`` against the previous state.
So a step costs no host sync, a compiled step can trace it, and a skipped step leaves the
parameters and the inner optimizer state bitwise as they were. For that, the inner state's
step counts become 0-dim tensors (a Python int cannot be selected on the device): bias
corrections and schedules then run on the device.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import optree
import torch

from .._tree import NAMESPACE
from ._tree import local_leaves
from .clipping import global_norm_and_finite
from .records import is_record
from .transforms import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    OptState,
    Params,
    Updates,
    call_update,
)


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite` (optax's fields).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> state = ff.apply_if_finite(ff.sgd(0.1), 3).init({"w": torch.ones(2)})
        >>> state.notfinite_count, state.total_notfinite, state.last_finite
        (tensor(0), tensor(0), tensor(True))
    """

    notfinite_count: (
        torch.Tensor
    )  # int64 scalar: non-finite updates in a row (0 after a finite one)
    last_finite: torch.Tensor  # bool scalar: whether the last update was finite
    total_notfinite: torch.Tensor  # int64 scalar: non-finite updates so far
    inner_state: Any  # the inner optimizer's state; its step counts are int64 scalar tensors
    last_skipped: torch.Tensor  # bool scalar: whether the last update was skipped (not
    # finite, and no more than max_consecutive_errors in a row)

    # train_step's metrics["skipped"] and ["nonfinite_steps"] (see optim/records.py)
    METRICS = (("skipped", "last_skipped"), ("nonfinite_steps", "total_notfinite"))


def _device_of(params: Params) -> torch.device:
    leaves = [t for t in local_leaves(params)[0] if isinstance(t, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def _tensor_counts(state: OptState, device: torch.device) -> OptState:
    """``state`` with its Python int leaves (step counts) as int64 scalar tensors, and the
    numbers it records (a learning rate) as float64 ones: what updates from tensor counts
    make of them, so a skipped step can select between the old and the new."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(state, namespace=NAMESPACE)
    out = []
    for accessor, x in zip(accessors, leaves):
        if isinstance(x, numbers.Integral) and not isinstance(x, bool):
            x = torch.tensor(int(x), dtype=torch.int64, device=device)
        elif isinstance(x, numbers.Real) and len(accessor) and is_record(accessor[-1]):
            x = torch.tensor(float(x), dtype=torch.float64, device=device)
        out.append(x)
    return optree.tree_unflatten(treedef, out)


def _select(keep_new: torch.Tensor, new: Any, old: Any, in_place: bool) -> Any:
    """``new`` where ``keep_new``, else ``old``, leaf by leaf; into ``old``'s buffers if asked."""
    accessors, new_leaves, treedef = optree.tree_flatten_with_accessor(new, namespace=NAMESPACE)
    old_leaves = treedef.flatten_up_to(old)
    out = []
    for accessor, n, o in zip(accessors, new_leaves, old_leaves):
        if isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor):
            if n is o:
                out.append(o)
            elif in_place:
                out.append(torch.where(keep_new, n, o, out=o))
            else:
                out.append(torch.where(keep_new, n, o))
        elif n is o or (type(n) is type(o) and n == o):
            out.append(n)
        else:
            fix = (
                "Create the state with apply_if_finite(...).init(params), which makes step "
                "counts tensors."
                if isinstance(o, numbers.Integral)
                else "Keep that number in the state as a 0-dim tensor (computed on the device "
                "from the state's tensors), so that a skipped step can keep the old one."
            )
            raise TypeError(
                f"apply_if_finite: the inner optimizer state holds {o!r} "
                f"({type(o).__name__}) at {_path(accessor)}, which changed to {n!r}; "
                f"a skipped step could not keep it without reading a device value. {fix}"
            )
    return optree.tree_unflatten(treedef, out)


def _path(accessor: optree.PyTreeAccessor) -> str:
    """A leaf's path with NamedTuple fields by name, e.g. ``inner_state.0.count``."""
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.NamedTupleEntry):
            parts.append(str(entry.field))
        elif isinstance(entry, (optree.GetAttrEntry, optree.DataclassEntry)):
            parts.append(str(entry.name))
        else:
            parts.append(str(entry.entry))
    return "inner_state." + ".".join(parts) if parts else "inner_state"


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformationExtraArgs:
    """Apply ``inner`` only when the updates are finite; otherwise leave everything as it was.

    optax's ``apply_if_finite``: a non-finite step (a NaN or Inf in the gradients, or in the
    loss under :func:`~functional_fsdp.train_step`) gives updates that change no parameter
    (``-0.0``, which adding leaves every value bitwise the same) and keeps the inner state
    bitwise as it was; ``notfinite_count``, ``last_finite`` and ``total_notfinite`` in the state
    say what happened. After more than ``max_consecutive_errors`` non-finite steps in a row
    the update is applied anyway, so that a run that only produces NaNs shows them instead
    of silently standing still.

    Finiteness is decided element by element, as optax does: a finite gradient of ``1e20``,
    whose float32 norm overflows to ``inf``, is applied. The decision is the same on every
    rank: it comes from :func:`~functional_fsdp.optim.clipping.global_norm_and_finite` of the
    updates (whose counts ride on the norm's all-reduces), or from the ``finite=`` that
    ``train_step`` passes (the global loss's finiteness and the same per-element count, taken
    with the gradient norm it computes anyway, so no extra collective). That flag describes
    the step's gradients, so it reaches ``apply_if_finite`` only where they arrive unchanged
    (outermost, first in a :func:`~functional_fsdp.chain`); inside
    :class:`~functional_fsdp.MultiSteps`, :func:`~functional_fsdp.masked` or
    :func:`~functional_fsdp.multi_transform` the decision is taken on the updates received
    (the mean of a round's gradients, a subset), as optax takes it. It is a tensor, never read on the host: no sync, and traceable. The inner
    optimizer runs every step; its step counts are kept as 0-dim tensors, so a skipped step
    does not advance them. Under ``train_step(donate=True)`` the inner optimizer runs out of
    place (the size of its state in temporary memory) and the results are selected into the
    donated buffers, which are never written with non-finite values.

    Args:
        inner: the optimizer to guard, e.g. ``chain(clip_by_global_norm(1.0), adamw(3e-4))``.
        max_consecutive_errors: how many non-finite steps in a row to skip before applying
            one anyway.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> opt = ff.apply_if_finite(ff.sgd(0.1), max_consecutive_errors=3)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, float("nan")])}, state, params)
        >>> ff.apply_updates(params, updates), state.total_notfinite
        ({'w': tensor([1., 1.])}, tensor(1))
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"apply_if_finite: inner must be a GradientTransformation, got {inner!r} "
            f"({type(inner).__name__}); e.g. apply_if_finite(ff.adamw(1e-3), 5)."
        )
    if (
        isinstance(max_consecutive_errors, bool)
        or not isinstance(max_consecutive_errors, numbers.Integral)
        or max_consecutive_errors < 0
    ):
        raise ValueError(
            f"apply_if_finite: max_consecutive_errors must be an int >= 0, got "
            f"{max_consecutive_errors!r}; e.g. 5 skips up to 5 non-finite steps in a row."
        )
    limit = int(max_consecutive_errors)

    def init(params: Params) -> ApplyIfFiniteState:
        device = _device_of(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return ApplyIfFiniteState(
            notfinite_count=zero,
            last_finite=torch.ones((), dtype=torch.bool, device=device),
            total_notfinite=zero.clone(),
            inner_state=_tensor_counts(inner.init(params), device),
            last_skipped=torch.zeros((), dtype=torch.bool, device=device),
        )

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        finite: torch.Tensor | None = None,
        grad_norm: torch.Tensor | None = None,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, ApplyIfFiniteState]:
        if not isinstance(state, ApplyIfFiniteState):
            raise TypeError(
                f"apply_if_finite: got a state of type {type(state).__name__}; pass the "
                f"state that this transformation's init() returned."
            )
        if finite is None:  # element by element (a norm can overflow where no element is)
            finite = global_norm_and_finite(updates)[1]
        notfinite_count = torch.where(finite, 0, state.notfinite_count + 1)
        apply = finite | (notfinite_count > limit)
        # The inner optimizer runs out of place (donate=False): the old state must survive a
        # skip. The updates it gets are these: their norm is still grad_norm.
        inner_extra = {**extra, "donate": False}
        if grad_norm is not None:
            inner_extra["grad_norm"] = grad_norm
        new_updates, new_inner = call_update(inner, updates, state.inner_state, params, inner_extra)
        new_inner = _select(apply, new_inner, state.inner_state, donate)
        leaves, treedef = local_leaves(new_updates)
        new_updates = optree.tree_unflatten(treedef, [torch.where(apply, u, -0.0) for u in leaves])
        return new_updates, ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            total_notfinite=torch.where(finite, state.total_notfinite, state.total_notfinite + 1),
            inner_state=new_inner,
            last_skipped=~apply,
        )

    return GradientTransformationExtraArgs(init, update)
