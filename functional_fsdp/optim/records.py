"""What an optimizer state records about its last update: the learning rate, skipped steps.

A transformation that has something to report per step (the learning rate it applied,
whether it skipped the update) keeps it in its state, as optax's ``inject_hyperparams``
keeps hyperparameters: a field that ``update`` computes inside the step (the rate from the
step count, never from the field itself) and that nothing else in the update depends on.
Its state class says which fields these are, as ``(metric name, field)`` pairs in a
``METRICS`` class attribute::

    class ScaleByLearningRateState(NamedTuple):
        count: int | torch.Tensor
        learning_rate: float | torch.Tensor  # the rate of the last update

        METRICS = (("lr", "learning_rate"),)

:func:`metrics_of` reads them from a whole state tree (a ``chain``'s tuple, the inner state
of ``masked``, ``apply_if_finite`` or ``master_weights``: the first record of a name wins),
and :func:`learning_rate_of` the learning rate alone. ``train_step`` adds
``metrics_of(new_opt_state)`` to its metrics: nothing passes between an optimizer and the
step except its arguments and its state.
"""

from __future__ import annotations

import warnings
from typing import Any

import optree
import torch

from .._tree import NAMESPACE


def metric_fields(node: Any) -> tuple[tuple[str, str], ...]:
    """The ``(metric, field)`` pairs a state node records (``()`` for most nodes)."""
    pairs = getattr(type(node), "METRICS", ())
    return pairs if isinstance(pairs, tuple) else ()


def is_record(entry: Any) -> bool:
    """Whether a path entry (optree's, the last of a leaf's accessor) names a recorded field.

    Such a field is a report: no parameter and no other part of the state depends on it. A
    checkpoint written before the field existed lacks it, and
    :func:`functional_fsdp.checkpoint.load` then keeps the template's value.
    """
    field = getattr(entry, "field", None) if isinstance(entry, optree.NamedTupleEntry) else None
    if field is None and isinstance(entry, optree.DataclassEntry):
        field = entry.name
    if field is None:
        return False
    return any(f == field for _, f in getattr(entry.type, "METRICS", ()))


def metrics_of(opt_state: Any) -> dict[str, Any]:
    """Every metric the state tree ``opt_state`` records, ``{name: value}``, in tree order
    (the first record of a name wins, as in a ``chain`` the first member's).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> opt = ff.apply_if_finite(ff.sgd(0.1), max_consecutive_errors=3)
        >>> state = opt.init({"w": torch.ones(1)})
        >>> _, state = opt.update({"w": torch.tensor([float("nan")])}, state)
        >>> {k: v.tolist() for k, v in sorted(metrics_of(state).items())}
        {'lr': 0.1, 'nonfinite_steps': 1, 'skipped': True}
    """
    out: dict[str, Any] = {}
    _collect(opt_state, out)
    return out


def _collect(node: Any, out: dict[str, Any]) -> None:
    for metric, field in metric_fields(node):
        out.setdefault(metric, getattr(node, field))
    if optree.tree_is_leaf(node, none_is_leaf=True, namespace=NAMESPACE):
        return
    children, *_ = optree.tree_flatten_one_level(node, none_is_leaf=True, namespace=NAMESPACE)
    for child in children:
        _collect(child, out)


def learning_rate_of(opt_state: Any, *deprecated: Any) -> float | torch.Tensor:
    """The learning rate an optimizer state records: the rate of its last update.

    Transformations that apply a learning rate (:func:`~functional_fsdp.scale_by_learning_rate`
    and every optimizer built on it) keep it in their state, computed from their step count
    by ``update``; this reads it from anywhere in the state tree (the first one). A Python
    float while step counts are Python ints, a 0-dim tensor on their device when they are
    tensors (under :func:`~functional_fsdp.apply_if_finite`). ``nan`` for a scheduled rate
    before the first update, and if no transformation of the state applies a rate (a custom
    transformation, say). ``train_step`` reports it as ``metrics["lr"]``.

    ``learning_rate_of(optimizer, state)``, the form of earlier versions (which returned the
    rate of the *next* update), still works and warns: pass the state alone.

    Example:
        >>> import functional_fsdp as ff, torch
        >>> opt = ff.adamw(ff.linear_schedule(1.0, 0.0, transition_steps=4))
        >>> params = {"w": torch.ones(1)}
        >>> state = opt.init(params)
        >>> ff.learning_rate_of(state)  # no update yet
        nan
        >>> for _ in range(2):
        ...     _, state = opt.update({"w": torch.ones(1)}, state, params)
        >>> ff.learning_rate_of(state)  # the rate of the second update
        0.75
    """
    if deprecated:
        if len(deprecated) != 1 or not callable(getattr(opt_state, "update", None)):
            raise TypeError(
                f"learning_rate_of takes one optimizer state, got {1 + len(deprecated)} "
                f"arguments: call ff.learning_rate_of(state.opt_state)."
            )
        warnings.warn(
            "learning_rate_of(optimizer, state) is deprecated: the learning rate lives in the "
            "optimizer state now. Call learning_rate_of(state), which returns the rate of the "
            "state's last update (the old form returned the next update's).",
            DeprecationWarning,
            stacklevel=2,
        )
        opt_state = deprecated[0]
    return metrics_of(opt_state).get("lr", float("nan"))
