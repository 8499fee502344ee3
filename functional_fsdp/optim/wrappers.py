"""optax's wrappers: parameter groups (``multi_transform``), hyperparameters in the state
(``inject_hyperparams``) and gradient accumulation (``MultiSteps``).

Example:
    >>> import torch
    >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
    >>> opt = multi_transform({"fast": scale(2.0), "frozen": scale(0.0)}, {"w": "fast", "b": "frozen"})
    >>> opt.update({"w": torch.ones(2), "b": torch.ones(1)}, opt.init(params), params)[0]
    {'w': tensor([2., 2.]), 'b': tensor([0.])}
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from ._tree import check_dtype, leaves_like, local_leaves, zeros_like_tree
from .transforms import (
    GradientTransformation,
    GradientTransformationExtraArgs,
    MaskedState,
    OptState,
    Params,
    Updates,
    _takes_one,
    call_update,
    masked,
    scale,  # noqa: F401 (the module example)
    without,
)


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`: each group's :class:`MaskedState`, by label.

    Example:
        >>> import torch
        >>> opt = multi_transform({"a": scale(1.0)}, {"w": "a"})
        >>> opt.init({"w": torch.ones(1)})
        MultiTransformState(inner_states={'a': MaskedState(inner_state=EmptyState())})
    """

    inner_states: dict[Hashable, MaskedState]  # one per label, over that group's leaves


def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: Any,
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformationExtraArgs:
    """Parameter groups, optax's way: each leaf gets the transformation of its label.

    Args:
        transforms: ``{label: transformation}``.
        param_labels: a tree of labels like the params (or a prefix), or ``fn(params)``
            returning one (``Sharded`` values are leaves of ``params``).
        mask_compatible_extra_args: accepted for optax's signature; extra arguments go to
            each group's transformation as :func:`masked` passes them.

    Example:
        >>> import torch
        >>> labels = lambda params: {k: "decay" if v.ndim > 1 else "none" for k, v in params.items()}
        >>> opt = multi_transform({"decay": scale(0.5), "none": scale(1.0)}, labels)
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> u, _ = opt.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, opt.init(params), params)
        >>> u["w"][0].tolist(), u["b"].tolist()
        ([0.5, 0.5], [1.0, 1.0])
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"multi_transform: transforms must be a non-empty dict {{label: transformation}}, "
            f"got {transforms!r}."
        )
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"multi_transform: transforms[{label!r}] is {t!r}, not a GradientTransformation."
            )

    def labels_of(params: Params) -> Any:
        labels = (
            param_labels(params)
            if callable(param_labels) and _takes_one(param_labels)
            else param_labels
        )
        missing = {x for x in optree.tree_leaves(labels)} - set(transforms)
        if missing:
            raise ValueError(
                f"multi_transform: labels {sorted(missing, key=repr)} have no transformation; "
                f"transforms has {sorted(transforms, key=repr)}. Add them to transforms."
            )
        return labels

    def group(label: Hashable) -> Callable[[Params], Any]:
        return lambda params: optree.tree_map(lambda x: x == label, labels_of(params))

    groups = {label: masked(t, group(label)) for label, t in transforms.items()}

    def init(params: Params) -> MultiTransformState:
        labels_of(params)
        return MultiTransformState({label: g.init(params) for label, g in groups.items()})

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        new_states = {}
        for label, g in groups.items():
            updates, new_states[label] = call_update(
                g, updates, state.inner_states[label], params, extra
            )
        return updates, MultiTransformState(new_states)

    return GradientTransformationExtraArgs(init, update)


class InjectHyperparamsState(NamedTuple):
    """State of :func:`inject_hyperparams`.

    Example:
        >>> import torch
        >>> from functional_fsdp.optim.transforms import sgd
        >>> opt = inject_hyperparams(sgd)(learning_rate=0.1)
        >>> opt.init({"w": torch.ones(1)}).hyperparams
        {'learning_rate': 0.1}
    """

    count: int | torch.Tensor  # updates so far: schedules are evaluated at it (an int64
    # scalar tensor under apply_if_finite or ff.jit)
    hyperparams: dict[str, float | torch.Tensor]  # the values the last update used: the
    # numbers as given (settable between steps), each scheduled one a float64 scalar tensor
    inner_state: Any  # the inner transformation's state


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., GradientTransformationExtraArgs]:
    """Make numeric arguments of ``inner_factory`` part of the state (optax's).

    ``inject_hyperparams(adamw)(learning_rate=schedule, weight_decay=0.01)`` is an optimizer
    whose state holds ``hyperparams``: each scheduled argument evaluated at the step count,
    and each number as given, which may be changed in the state between steps. Arguments
    named in ``static_args``, and those that are neither numbers nor callables, are passed
    as given. ``hyperparam_dtype`` is accepted for optax's signature: a scheduled value is
    recorded as a float64 scalar tensor (optax records an array), a number as the float it
    is.

    A step count held as a tensor (:func:`~functional_fsdp.apply_if_finite` makes counts
    tensors, ``ff.jit`` traces them as tensors) keeps everything on the device: each schedule
    is evaluated at the tensor count and its value, a float64 scalar tensor, is what the
    state records and what ``inner_factory`` receives, so nothing is read back to the host
    and a skipped step keeps the values it had. The library's optimizers take a tensor
    ``learning_rate``; a factory that refuses a tensor for another scheduled argument raises
    a ``TypeError`` naming the argument and the fix.

    Example:
        >>> import torch
        >>> from functional_fsdp.optim.transforms import sgd
        >>> opt = inject_hyperparams(sgd)(learning_rate=lambda step: 0.1 / (step + 1))
        >>> params = {"w": torch.ones(1)}
        >>> state = opt.init(params)
        >>> _, state = opt.update({"w": torch.ones(1)}, state, params)  # the rate at step 0
        >>> _, state = opt.update({"w": torch.ones(1)}, state, params)
        >>> state.hyperparams
        {'learning_rate': tensor(0.0500, dtype=torch.float64)}
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)

    def factory(*args: Any, **kwargs: Any) -> GradientTransformationExtraArgs:
        bound = signature.bind(*args, **kwargs).arguments
        fixed, numeric, scheduled = {}, {}, {}
        for name, value in bound.items():
            if name in static:
                fixed[name] = value
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                numeric[name] = float(value)
            elif callable(value) and not isinstance(value, GradientTransformation):
                scheduled[name] = value
            else:
                fixed[name] = value

        def values(
            count: int | torch.Tensor, current: dict[str, Any]
        ) -> tuple[dict[str, Any], dict[str, Any]]:
            """What the state records and what the factory gets: the numbers as they are,
            the scheduled values as float64 scalar tensors in the state (one type whatever
            the count, so a checkpoint's layout does not depend on it) and, for an int
            count, as floats to the factory; for a tensor count, computed on its device
            (no host read) and passed as they are."""
            if isinstance(count, torch.Tensor):
                now = {k: _on(fn(count), count) for k, fn in scheduled.items()}
                return {**current, **now}, {**current, **now}
            now = {k: float(fn(count)) for k, fn in scheduled.items()}
            recorded = {k: torch.tensor(v, dtype=torch.float64) for k, v in now.items()}
            return {**current, **recorded}, {**current, **now}

        def build(hyper: dict[str, Any]) -> GradientTransformation:
            try:
                return inner_factory(**fixed, **hyper)
            except TypeError as e:
                tensors = sorted(k for k, v in hyper.items() if isinstance(v, torch.Tensor))
                if not tensors:
                    raise
                raise TypeError(_refused_tensors(inner_factory, tensors, scheduled, e)) from e

        def init(params: Params) -> InjectHyperparamsState:
            recorded, hyper = values(0, numeric)
            return InjectHyperparamsState(0, recorded, build(hyper).init(params))

        def update(
            updates: Updates, state: OptState, params: Params | None = None, **extra: Any
        ) -> tuple[Updates, OptState]:
            recorded, hyper = values(state.count, state.hyperparams)
            inner = build(hyper)
            updates, inner_state = call_update(inner, updates, state.inner_state, params, extra)
            return updates, InjectHyperparamsState(state.count + 1, recorded, inner_state)

        return GradientTransformationExtraArgs(init, update)

    return factory


def _refused_tensors(
    factory: Callable[..., Any], tensors: list[str], scheduled: dict[str, Any], error: Exception
) -> str:
    """Why ``factory`` got 0-dim tensors for ``tensors`` under inject_hyperparams, and fixes."""
    name = getattr(factory, "__name__", repr(factory))
    tensors = [k for k in tensors if k != "learning_rate"] or tensors  # the rate is taken
    why = []
    if any(k in scheduled for k in tensors):
        why.append(
            f"the step count is a tensor, so the schedules of "
            f"{[k for k in tensors if k in scheduled]} are evaluated on the device "
            f"(apply_if_finite makes counts tensors, so that a skipped step keeps them "
            f"without a device read; ff.jit traces them as tensors)"
        )
    if any(k not in scheduled for k in tensors):
        why.append(
            f"the state's numbers {[k for k in tensors if k not in scheduled]} are tensors "
            f"(ff.jit traces a state's Python numbers as tensors)"
        )
    return (
        f"inject_hyperparams({name}): {' and '.join(why)}, and {name} refused a tensor: "
        f"{error} Every optimizer here takes learning_rate as a tensor; for the others, "
        f"pass them as static_args=({', '.join(repr(k) for k in tensors)},) to keep them "
        f"numbers outside the state, or drop their schedules."
    )


def _on(value: Any, count: torch.Tensor) -> torch.Tensor:
    """A schedule's value at a tensor ``count`` as a float64 scalar tensor on its device."""
    return torch.as_tensor(value, dtype=torch.float64, device=count.device)


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps` (optax's fields).

    Example:
        >>> import torch
        >>> from functional_fsdp.optim.transforms import sgd
        >>> MultiSteps(sgd(0.1), 2).init({"w": torch.ones(1)}).mini_step
        0
    """

    mini_step: int  # micro-steps accumulated since the last update
    gradient_step: int  # updates applied (schedules of every_k_schedule read it)
    inner_opt_state: Any  # the inner optimizer's state
    acc_grads: Any  # like params (layouts kept; dtype accumulator_dtype): the running sum
    # or mean of this round's gradients
    skip_state: Any = ()  # optax's field; always () here


class MultiSteps:
    """Apply ``opt`` every ``k`` calls, to the mean (or sum) of the ``k`` gradients (optax's).

    The other ``k - 1`` calls return zero updates and leave the inner state as it was. The
    accumulator has the layouts of the params (a ``Sharded`` leaf's accumulator is sharded
    the same way), in ``accumulator_dtype``. The counters are Python ints, so which calls
    update is decided on the host with no device read.

    Args:
        opt: the optimizer to apply.
        every_k_schedule: ``k``, or ``fn(gradient_step) -> k``.
        use_grad_mean: average the gradients (``acc + (g - acc) / (n + 1)``, optax's
            arithmetic); ``False`` sums them.
        should_skip_update_fn: must be ``None`` here (skip non-finite steps with
            :func:`~functional_fsdp.apply_if_finite` around the inner optimizer instead).
        accumulator_dtype: the accumulator's dtype (float32 by default, as optax's).

    Example:
        >>> import torch
        >>> from functional_fsdp.optim.transforms import sgd
        >>> opt = MultiSteps(sgd(1.0), every_k_schedule=2)
        >>> params = {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> u, state = opt.update({"w": torch.ones(1)}, state, params)
        >>> u, state = opt.update({"w": torch.full((1,), 3.0)}, state, params)
        >>> u, state.gradient_step
        ({'w': tensor([-2.])}, 1)
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int | Callable[[int], int],
        use_grad_mean: bool = True,
        should_skip_update_fn: Any = None,
        accumulator_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(opt, GradientTransformation):
            raise TypeError(f"MultiSteps: opt must be a GradientTransformation, got {opt!r}.")
        if should_skip_update_fn is not None:
            raise TypeError(
                "MultiSteps: should_skip_update_fn is not supported; wrap the inner optimizer "
                "in ff.apply_if_finite(opt, max_consecutive_errors) to skip non-finite steps."
            )
        if isinstance(every_k_schedule, numbers.Integral):
            if isinstance(every_k_schedule, bool) or every_k_schedule < 1:
                raise ValueError(
                    f"MultiSteps: every_k_schedule must be an int >= 1 or a schedule, got "
                    f"{every_k_schedule!r}."
                )
            k = int(every_k_schedule)
            self._every_k: Callable[[int], int] = lambda step: k
        elif callable(every_k_schedule):
            self._every_k = every_k_schedule
        else:
            raise TypeError(
                f"MultiSteps: every_k_schedule must be an int or fn(step) -> int, got "
                f"{every_k_schedule!r}."
            )
        self._opt = opt
        self._mean = bool(use_grad_mean)
        self._dtype = check_dtype("MultiSteps", "accumulator_dtype", accumulator_dtype)

    @property
    def inner_opt(self) -> GradientTransformation:
        """The optimizer applied every ``k`` calls."""
        return self._opt

    def init(self, params: Params) -> MultiStepsState:
        """The state: counters at 0, the inner state, a zero accumulator like ``params``."""
        return MultiStepsState(0, 0, self._opt.init(params), zeros_like_tree(params, self._dtype))

    def update(
        self, updates: Updates, state: MultiStepsState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MultiStepsState]:
        """Accumulate ``updates``; every ``k``-th call, apply the inner optimizer."""
        if isinstance(state.mini_step, torch.Tensor):
            raise TypeError(
                "MultiSteps: the state's counters are tensors, and which calls update is "
                "decided on the host from them. Two things make them tensors: apply_if_finite "
                "around MultiSteps (put it inside instead: MultiSteps(ff.apply_if_finite(opt, "
                "5), k)), and ff.jit, which traces a state's ints as tensors (accumulate in "
                "the step instead: ff.train_step(..., accumulate=k), which ff.jit compiles, "
                "or call the step without ff.jit)."
            )
        k = int(self._every_k(state.gradient_step))
        acc = leaves_like("MultiSteps", "state.acc_grads", state.acc_grads, updates)
        g, treedef = local_leaves(updates)
        n = state.mini_step
        if self._mean:
            new_acc = [a + (x - a) / (n + 1) for x, a in zip(g, acc)]
        else:
            new_acc = [x + a for x, a in zip(g, acc)]
        new_acc = [a.to(self._dtype) for a in new_acc]
        if n + 1 < k:  # a micro-step: zero updates, the inner state kept
            zeros = optree.tree_unflatten(treedef, [torch.zeros_like(x) for x in g])
            return zeros, state._replace(
                mini_step=n + 1, acc_grads=optree.tree_unflatten(treedef, new_acc)
            )
        mean = optree.tree_unflatten(treedef, [a.to(x.dtype) for a, x in zip(new_acc, g)])
        out, inner = call_update(self._opt, mean, state.inner_opt_state, params, without(extra))
        zeros = optree.tree_unflatten(treedef, [torch.zeros_like(a) for a in new_acc])
        return out, MultiStepsState(0, state.gradient_step + 1, inner, zeros, state.skip_state)

    def has_updated(self, state: MultiStepsState) -> bool:
        """Whether the last call applied the inner optimizer."""
        return state.mini_step == 0 and state.gradient_step > 0

    def gradient_transformation(self) -> GradientTransformationExtraArgs:
        """This as a :class:`GradientTransformationExtraArgs` (for :func:`chain`)."""
        return GradientTransformationExtraArgs(self.init, self.update)
