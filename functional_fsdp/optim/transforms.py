"""Optimizers in the optax style: pure gradient transformations over pytrees.

A :class:`GradientTransformation` is a pair of pure functions, ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``. They map over the local tensors
of the tree (``Sharded`` values are seen through), so an optimizer needs no sharding logic:
it updates each rank's shards with multi-tensor ``torch._foreach_*`` kernels. Inputs are never
written unless the caller donates them: every transformation here is a
:class:`GradientTransformationExtraArgs` whose ``update`` takes ``donate=True`` (the caller
owns the updates and gives up the state, as ``train_step(donate=True)`` does) and then
writes the updates and its state in place, bitwise as out of place.

Step counts are Python ints in the state by default. Schedules, bias corrections and momentum
factors are then computed on the host in double precision, like ``torch.optim``'s default
(non-capturable) path, so no step forces a device sync. The price: a count is not a tensor
leaf, so code that maps over optimizer states must let ints through. A count may also be a
0-dim integer tensor (:func:`~functional_fsdp.optim.finite.apply_if_finite` makes them so, to
leave a skipped step's counts unchanged without reading a device value): the same quantities
are then computed on its device in float64, and nothing is read back to the host.

The one mesh-aware piece, global-norm clipping, lives in :mod:`functional_fsdp.optim.clipping`.

Example:
    >>> import torch
    >>> params = {"w": torch.ones(2), "b": torch.zeros(2)}
    >>> opt = chain(scale(0.5), adamw(1e-2, weight_decay=0.1))
    >>> state = opt.init(params)
    >>> grads = {"w": torch.ones(2), "b": torch.ones(2)}
    >>> updates, state = opt.update(grads, state, params)
    >>> apply_updates(params, updates)["w"]
    tensor([0.9890, 0.9890])
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import optree
import torch

from .._partition import prefix_mask_flags
from .._tree import dotted
from ._tree import (
    SAME_PARAMS_HINT,
    check_dtype,
    check_real,
    check_tensor_tree,
    check_unit_interval,
    leaves_like,
    local_leaves,
    map_foreach,
    mismatch_error,
    require_params,
    zeros_like_tree,
)
from .schedules import Schedule

Params = Any  # a pytree of tensors and Sharded values
Updates = Any  # a pytree like Params: gradients, or updates to add to Params
OptState = Any  # a pytree of NamedTuple states
Mask = Any  # a pytree of bools matching Params (or a prefix), fn(params) returning one, or a
# predicate fn(path, leaf)


class TransformInitFn(Protocol):
    """``init(params) -> state``.

    Example:
        >>> import torch
        >>> state = scale_by_adam().init({"w": torch.zeros(2)})  # a TransformInitFn call
        >>> state.count
        0
    """

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None) -> (new_updates, new_state)``.

    The built-in transformations also take keyword arguments (``donate=``, ``grad_norm=``,
    ``finite=``; see :class:`GradientTransformationExtraArgs`).

    Example:
        >>> import torch
        >>> updates, state = scale(2.0).update({"w": torch.ones(1)}, EmptyState())
        >>> updates
        {'w': tensor([2.])}
    """

    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and ``update(updates, state,
    params=None) -> (updates, state)``. Neither mutates its inputs.

    Example:
        >>> import torch
        >>> def init(params):
        ...     return EmptyState()
        >>> def update(updates, state, params=None):
        ...     return {k: -0.1 * g for k, g in updates.items()}, state
        >>> my_sgd = GradientTransformation(init, update)
        >>> my_sgd.update({"w": torch.ones(1)}, my_sgd.init(None))[0]
        {'w': tensor([-0.1000])}
    """

    init: TransformInitFn
    update: TransformUpdateFn


class GradientTransformationExtraArgs(GradientTransformation):
    """A :class:`GradientTransformation` whose ``update`` also takes keyword arguments.

    optax's name for the same thing. An ``update`` of this type ignores the keywords it does
    not use. :func:`chain` forwards keyword arguments to the members that take them, and
    :func:`~functional_fsdp.train_step` passes to an optimizer of this type (every one built
    here is):

    * ``donate``: ``True`` when the updates and the state may be overwritten (the step owns
      the gradients and its state is donated); the result is bitwise the same.
    * ``grad_norm``: the :func:`~functional_fsdp.global_norm` of the updates as given, which
      the step computes for its metrics anyway: :func:`~functional_fsdp.clip_by_global_norm`
      uses it instead of another all-reduce. It describes the updates a transformation
      receives, so :func:`chain` gives it to its first member only.
    * ``finite``: whether this step's loss and every gradient element are finite, the same
      on every rank (read by :func:`~functional_fsdp.apply_if_finite`). It too describes the
      updates as given, so it reaches only a transformation that receives them unchanged:
      :func:`chain`'s first member, the inner optimizer of
      :func:`~functional_fsdp.apply_if_finite` and :func:`inject_hyperparams`, and that of
      :func:`~functional_fsdp.master_weights` when the cast is exact. :func:`masked`,
      :func:`~functional_fsdp.multi_transform` and :class:`~functional_fsdp.MultiSteps` (whose
      inner optimizer receives the mean of several steps' gradients) drop it, and an
      ``apply_if_finite`` there decides from the updates it receives, as optax's does.

    Example:
        >>> import torch
        >>> def update(updates, state, params=None, *, factor=1.0):
        ...     return {k: factor * g for k, g in updates.items()}, state
        >>> t = GradientTransformationExtraArgs(lambda params: EmptyState(), update)
        >>> chain(t, identity()).update({"w": torch.ones(1)}, (EmptyState(),) * 2, factor=3.0)[0]
        {'w': tensor([3.])}
    """

    __slots__ = ()


# Keyword arguments that describe the updates a transformation receives: valid for a
# chain's first member only (the others receive what earlier members made of them), and
# dropped by every wrapper whose inner transformation receives other updates (a masked
# subset, MultiSteps' mean of several steps, an inexact cast to master weights).
ABOUT_UPDATES = ("grad_norm", "finite")


def call_update(
    t: GradientTransformation,
    updates: Updates,
    state: OptState,
    params: Params | None,
    extra: dict[str, Any],
) -> tuple[Updates, OptState]:
    """``t.update`` with the keyword arguments of ``extra`` that it takes: all of them for a
    :class:`GradientTransformationExtraArgs` whose ``update`` has ``**kwargs``, those it
    names otherwise (one written for ``finite=`` only), none for a plain one."""
    if not extra or not isinstance(t, GradientTransformationExtraArgs):
        return t.update(updates, state, params)
    named = _keywords(t.update)
    if named is not None:
        extra = {k: v for k, v in extra.items() if k in named}
    return t.update(updates, state, params, **extra)


@functools.lru_cache(maxsize=256)
def _keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments ``fn`` names, or ``None`` if it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass everything, as optax does
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


def without(extra: dict[str, Any], names: tuple[str, ...] = ABOUT_UPDATES) -> dict[str, Any]:
    """``extra`` less ``names`` (by default what no longer describes transformed updates)."""
    return {k: v for k, v in extra.items() if k not in names}


class EmptyState(NamedTuple):
    """The state of a stateless transformation.

    Example:
        >>> scale(2.0).init(None)
        EmptyState()
    """


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`.

    Example:
        >>> scale_by_schedule(lambda step: 0.1).init(None)
        ScaleByScheduleState(count=0)
    """

    count: int | torch.Tensor  # updates applied so far: a Python int (schedules run on the
    # host), or an int64 scalar tensor (schedules run on its device)


class ScaleByLearningRateState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule.

    Example:
        >>> scale_by_learning_rate(lambda step: 0.1).init(None)
        ScaleByLearningRateState(count=0, learning_rate=nan)
    """

    count: int | torch.Tensor  # updates applied so far: a Python int (the schedule runs on
    # the host), or an int64 scalar tensor (it runs on the count's device)
    learning_rate: float | torch.Tensor  # the rate of the last update (nan before the
    # first), from the schedule: a float, or a float64 scalar tensor for a tensor count

    METRICS = (("lr", "learning_rate"),)  # read by learning_rate_of and train_step's metrics


class ConstantLearningRateState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a constant rate: the rate, recorded.

    Example:
        >>> scale_by_learning_rate(0.1).init(None)
        ConstantLearningRateState(learning_rate=0.1)
    """

    learning_rate: float | torch.Tensor  # the rate every update applies (a float64 scalar
    # tensor once apply_if_finite has made the state's numbers tensors)

    METRICS = (("lr", "learning_rate"),)  # read by learning_rate_of and train_step's metrics


class TraceState(NamedTuple):
    """State of :func:`trace` (momentum).

    Example:
        >>> import torch
        >>> trace(0.9).init({"w": torch.ones(2)})
        TraceState(trace={'w': tensor([0., 0.])})
    """

    trace: Any  # like params (same shapes, dtypes, specs): the momentum buffer


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Example:
        >>> import torch
        >>> scale_by_adam().init({"w": torch.ones(1)})
        ScaleByAdamState(count=0, mu={'w': tensor([0.])}, nu={'w': tensor([0.])})
    """

    count: int | torch.Tensor  # updates applied so far: a Python int (bias corrections run on
    # the host), or an int64 scalar tensor (they run on its device, in float64)
    mu: Any  # like params (same shapes, dtypes, specs): first moment, torch's exp_avg
    nu: Any  # like params: second moment, torch's exp_avg_sq


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner state over the selected leaves only.

    Example:
        >>> import torch
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> masked(trace(0.9), {"w": True, "b": False}).init(params)
        MaskedState(inner_state=TraceState(trace={'w': tensor([0., 0.]), 'b': None}))
    """

    inner_state: Any  # the inner transformation's state over the masked leaves only


# --------------------------------------------------------------------------- combinators


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states.

    The chain is a :class:`GradientTransformationExtraArgs`: keyword arguments given to its
    ``update`` go to the members that take them (``grad_norm``, which describes the chain's
    input, to the first member only).

    Example:
        >>> import torch
        >>> opt = chain(scale(2.0), scale_by_learning_rate(0.1))
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init({"w": torch.zeros(2)}))
        >>> updates
        {'w': tensor([-0.2000, -0.2000])}
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {t!r} ({type(t).__name__}), not a "
                f"GradientTransformation. Pass transformations such as scale_by_adam() or "
                f"sgd(0.1); call factory functions (adam(1e-3), not adam)."
            )

    def init(params: Params) -> OptState:
        return tuple(t.init(params) for t in transforms)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **kwargs: Any
    ) -> tuple[Updates, OptState]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"{len(state)} entries" if isinstance(state, tuple) else type(state).__name__
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state with {got}. Pass the "
                f"state that this chain's init() returned."
            )
        new_state = []
        for i, (t, s) in enumerate(zip(transforms, state)):
            updates, s = call_update(t, updates, s, params, kwargs if i == 0 else without(kwargs))
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformationExtraArgs(init, update)


def identity() -> GradientTransformation:
    """Leave updates unchanged.

    Example:
        >>> import torch
        >>> identity().update({"w": torch.ones(1)}, EmptyState())[0]
        {'w': tensor([1.])}
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        return updates, state

    return GradientTransformationExtraArgs(init, update)


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by a constant ``factor``.

    Example:
        >>> import torch
        >>> scale(0.5).update({"w": torch.ones(2)}, EmptyState())[0]
        {'w': tensor([0.5000, 0.5000])}
    """
    factor = check_real("scale", "factor", factor)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        return map_foreach(torch._foreach_mul, updates, factor, donate=donate), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def _check_schedule(where: str, name: str, fn: object) -> None:
    if not callable(fn):
        raise TypeError(
            f"{where}: {name} must be a schedule, a function fn(step: int) -> float, got "
            f"{fn!r} ({type(fn).__name__}). Build one with e.g. "
            f"cosine_decay_schedule(1e-3, decay_steps=1000)."
        )


def _scheduled(
    where: str, fn: Schedule, count: int | torch.Tensor, *, low: float | None = None
) -> float | torch.Tensor:
    value = fn(count)
    if isinstance(count, torch.Tensor) and isinstance(value, torch.Tensor):
        # A count on the device: checking the value would read it back (a sync every step).
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: the schedule returned {value!r} ({type(value).__name__}) at step "
            f"{count}; schedules must return a Python float (a tensor would force a device "
            f"sync every step)."
        )
    if not math.isfinite(value) or (low is not None and value < low):
        raise ValueError(f"{where}: the schedule returned {value} at step {count}; {_bound(low)}")
    return float(value)


def _bound(low: float | None) -> str:
    return "it must be finite." if low is None else f"it must be finite and >= {low}."


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)``, where ``count`` is the updates so far.

    Example:
        >>> import torch
        >>> t = scale_by_schedule(lambda step: 1.0 / (step + 1))
        >>> u, s = t.update({"w": torch.ones(1)}, t.init(None))
        >>> u, s = t.update(u, s)
        >>> u, s.count
        ({'w': tensor([0.5000])}, 2)
    """
    _check_schedule("scale_by_schedule", "step_size_fn", step_size_fn)
    return _scale_by_schedule("scale_by_schedule", step_size_fn, sign=1.0, low=None)


def _scale_by_schedule(
    where: str, fn: Schedule, *, sign: float, low: float | None
) -> GradientTransformation:
    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=0)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        factor = sign * _scheduled(where, fn, state.count, low=low)
        new = map_foreach(torch._foreach_mul, updates, factor, donate=donate)
        return new, ScaleByScheduleState(state.count + 1)

    return GradientTransformationExtraArgs(init, update)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (a float or a schedule of the step count).

    The state records the rate of the last update (``learning_rate``), which
    :func:`~functional_fsdp.learning_rate_of` and ``train_step``'s ``metrics["lr"]`` read.
    A schedule is called inside ``update`` with the state's step count (never by ``init``:
    a fresh state records ``nan``); the rate is a Python float for an int count, a 0-dim
    float64 tensor on the count's device for a tensor count (nothing read back to the host).

    Args:
        learning_rate: a non-negative float, a schedule ``fn(step) -> float``, or a 0-dim
            floating tensor (what :func:`~functional_fsdp.inject_hyperparams` passes under a
            tensor step count), used as it is: checking it would read it back to the host.
        flip_sign: negate, so that :func:`apply_updates` descends (the default).

    Raises:
        TypeError: if ``learning_rate`` is neither a number nor callable.
        ValueError: if it is negative or not finite (the sign is flipped for you).

    Example:
        >>> import torch
        >>> t = scale_by_learning_rate(lambda step: 0.1 / (step + 1))
        >>> u, state = t.update({"w": torch.ones(1)}, t.init(None))
        >>> t.update({"w": torch.ones(1)}, state)
        ({'w': tensor([-0.0500])}, ScaleByLearningRateState(count=2, learning_rate=0.05))
    """
    where = "scale_by_learning_rate"
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        schedule = learning_rate

        def init(params: Params) -> ScaleByLearningRateState:
            return ScaleByLearningRateState(0, math.nan)  # no update yet: no rate

        def update(
            updates: Updates,
            state: OptState,
            params: Params | None = None,
            *,
            donate: bool = False,
            **extra: Any,
        ) -> tuple[Updates, OptState]:
            rate = _scheduled(where, schedule, state.count, low=0.0)
            new = map_foreach(torch._foreach_mul, updates, sign * rate, donate=donate)
            return new, ScaleByLearningRateState(state.count + 1, _record(rate, state.count))

        return GradientTransformationExtraArgs(init, update)
    if isinstance(learning_rate, torch.Tensor) and _scalar_float(learning_rate):
        # A rate already on the device (inject_hyperparams under a tensor count): used as it
        # is, unchecked, since checking it would read it back to the host.
        rate = learning_rate

        def update_tensor(
            updates: Updates,
            state: OptState,
            params: Params | None = None,
            *,
            donate: bool = False,
            **extra: Any,
        ) -> tuple[Updates, OptState]:
            new = map_foreach(torch._foreach_mul, updates, sign * rate, donate=donate)
            return new, ConstantLearningRateState(rate)

        return GradientTransformationExtraArgs(
            lambda params: ConstantLearningRateState(rate), update_tensor
        )
    if isinstance(learning_rate, torch.Tensor) or not isinstance(learning_rate, numbers.Real):
        raise TypeError(
            f"{where}: learning_rate must be a float or a schedule fn(step) -> float, got "
            f"{learning_rate!r} ({type(learning_rate).__name__}). For a tensor pass a "
            f"0-dim floating one, or float(lr); for a changing rate pass a schedule such as "
            f"warmup_cosine_decay_schedule(...)."
        )
    lr = float(learning_rate)
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(
            f"{where}: learning_rate must be finite and >= 0, got {lr}. Pass the step size "
            f"as a positive number: the update is negated for you (flip_sign=True)."
        )
    scaled = scale(sign * lr)

    def update_constant(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:  # scale's update; the state is the recorded rate
        new = scaled.update(updates, EmptyState(), params, **extra)[0]
        # The rate applied, recorded: a state from another rate's init (inject_hyperparams
        # builds this transformation anew each step) would report a stale one. A rate the
        # state holds as a tensor (apply_if_finite's) is this one: kept as it is.
        if isinstance(state.learning_rate, torch.Tensor) or state.learning_rate == lr:
            return new, state
        return new, ConstantLearningRateState(lr)

    return GradientTransformationExtraArgs(
        lambda params: ConstantLearningRateState(lr), update_constant
    )


def _scalar_float(t: torch.Tensor) -> bool:
    return t.ndim == 0 and t.is_floating_point()


def _record(rate: float | torch.Tensor, count: int | torch.Tensor) -> float | torch.Tensor:
    """The rate as the state records it: a tensor on the count's device for a tensor count
    (a schedule may return a float for any count), so the state's leaves keep their types."""
    if isinstance(count, torch.Tensor) and not isinstance(rate, torch.Tensor):
        return torch.tensor(rate, dtype=torch.float64, device=count.device)
    return rate


# --------------------------------------------------------------------------- transformations


def trace(
    decay: float, nesterov: bool = False, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Momentum: ``buf = decay * buf + g``; emits ``buf`` (or ``g + decay * buf`` if nesterov).

    optax's ``trace``, and ``torch.optim.SGD`` momentum with dampening 0: the first buffer is
    the gradient itself. ``accumulator_dtype`` stores the buffer in another dtype (the
    arithmetic runs in the wider of it and the update's, as optax's does).

    Example:
        >>> import torch
        >>> t = trace(0.9)
        >>> g = {"w": torch.ones(1)}
        >>> u, s = t.update(g, t.init(g))
        >>> t.update(g, s)[0]
        {'w': tensor([1.9000])}
    """
    decay = check_real("trace", "decay", decay, low=0.0)
    acc = check_dtype("trace", "accumulator_dtype", accumulator_dtype)

    def init(params: Params) -> TraceState:
        check_tensor_tree(params, "trace.init")
        return TraceState(trace=zeros_like_tree(params, acc))

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        buf = leaves_like("trace", "state.trace", state.trace, updates)
        g, treedef = local_leaves(updates)
        if not g:
            return updates, state
        if any(b.dtype != x.dtype for b, x in zip(buf, g)):  # a buffer in another dtype
            new_buf = [x + _rounded(decay, b.dtype) * b for x, b in zip(g, buf)]
            out = [x + decay * b for x, b in zip(g, new_buf)] if nesterov else new_buf
            stored = [n.to(b.dtype) for n, b in zip(new_buf, buf)]
            new_trace = optree.tree_unflatten(treedef, stored)
            return optree.tree_unflatten(treedef, out), TraceState(trace=new_trace)
        new_buf = torch._foreach_add(g, buf, alpha=decay)
        if donate:  # write the buffer and the updates in place (same arithmetic)
            torch._foreach_copy_(buf, new_buf)
            if nesterov:
                torch._foreach_add_(g, buf, alpha=decay)
            else:
                torch._foreach_copy_(g, buf)
            return updates, state
        out = torch._foreach_add(g, new_buf, alpha=decay) if nesterov else new_buf
        new_trace = optree.tree_unflatten(treedef, new_buf)
        return optree.tree_unflatten(treedef, out), TraceState(trace=new_trace)

    return GradientTransformationExtraArgs(init, update)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Adam's rescaling: ``m_hat / (sqrt(v_hat + eps_root) + eps)``, with bias-corrected moments.

    optax's ``scale_by_adam``: the same arguments in the same order. ``eps_root`` is added
    inside the square root (for differentiating through the update), ``mu_dtype`` stores the
    first moment in another dtype (e.g. ``torch.bfloat16``), and ``nesterov=True`` is NAdam
    (Dozat 2016) as optax computes it. With the defaults the arithmetic is
    ``torch.optim.Adam``'s (``m / (sqrt(v) / sqrt(1 - b2**t) + eps) / (1 - b1**t)``), which
    equals optax's to rounding.

    Example:
        >>> import torch
        >>> t = scale_by_adam()
        >>> g = {"w": torch.tensor([2.0, -3.0])}
        >>> t.update(g, t.init(g))[0]["w"]  # the first step is sign(g), up to eps
        tensor([ 1.0000, -1.0000])
    """
    b1, b2 = (
        check_unit_interval("scale_by_adam", "b1", b1),
        check_unit_interval("scale_by_adam", "b2", b2),
    )
    eps = check_real("scale_by_adam", "eps", eps, low=0.0)
    eps_root = check_real("scale_by_adam", "eps_root", eps_root, low=0.0)
    mu_dtype = check_dtype("scale_by_adam", "mu_dtype", mu_dtype)
    plain = eps_root == 0.0 and not nesterov  # torch.optim.Adam's arithmetic, fused

    def init(params: Params) -> ScaleByAdamState:
        check_tensor_tree(params, "scale_by_adam.init")
        return ScaleByAdamState(
            count=0, mu=zeros_like_tree(params, mu_dtype), nu=zeros_like_tree(params)
        )

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        mu = leaves_like("scale_by_adam", "state.mu", state.mu, updates)
        nu = leaves_like("scale_by_adam", "state.nu", state.nu, updates)
        g, treedef = local_leaves(updates)
        count = state.count + 1
        if not g:
            return updates, state._replace(count=count)
        bc1, bc2 = _bias_correction(b1, count), _bias_correction(b2, count)
        same = all(m.dtype == x.dtype for m, x in zip(mu, g))
        if donate and plain and same:  # moments in place, the step's grads reused as scratch
            torch._foreach_lerp_(mu, g, 1.0 - b1)
            torch._foreach_mul_(nu, b2)
            torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
            torch._foreach_copy_(g, nu)
            torch._foreach_sqrt_(g)
            torch._foreach_div_(g, bc2**0.5)
            torch._foreach_add_(g, eps)
            if torch.compiler.is_compiling():  # the compiler plans the buffers (one kernel)
                out = torch._foreach_div(mu, g)
            else:  # the update, written over its denominator: no new buffers
                out = g
                for m, d in zip(mu, g):
                    torch.div(m, d, out=d)
            torch._foreach_div_(out, bc1)
            return optree.tree_unflatten(treedef, out), state._replace(count=count)
        if same:
            new_mu = torch._foreach_lerp(mu, g, 1.0 - b1)
        else:  # mu_dtype: optax's arithmetic, in the wider dtype, stored in mu's
            # (JAX rounds b1 to mu's dtype first: a Python scalar takes the array's dtype.)
            new_mu = [(1.0 - b1) * x + _rounded(b1, m.dtype) * m for m, x in zip(mu, g)]
        new_nu = torch._foreach_addcmul(torch._foreach_mul(nu, b2), g, g, value=1.0 - b2)
        if plain:
            denom = torch._foreach_add(
                torch._foreach_div(torch._foreach_sqrt(new_nu), bc2**0.5), eps
            )
            out = torch._foreach_div(torch._foreach_div(new_mu, denom), bc1)
        else:  # optax's arithmetic: sqrt(v_hat + eps_root) + eps
            nu_hat = torch._foreach_div(new_nu, bc2)
            if eps_root:
                torch._foreach_add_(nu_hat, eps_root)
            denom = torch._foreach_add(torch._foreach_sqrt(nu_hat), eps)
            if nesterov:  # b1 * m / (1 - b1**(t+1)) + (1 - b1) * g / (1 - b1**t)
                mu_hat = torch._foreach_add(
                    torch._foreach_mul(new_mu, b1 / _bias_correction(b1, count + 1)),
                    torch._foreach_mul(g, (1.0 - b1) / bc1),
                )
            else:
                mu_hat = torch._foreach_div(new_mu, bc1)
            out = torch._foreach_div(mu_hat, denom)
        stored_mu = new_mu if same else [n.to(m.dtype) for n, m in zip(new_mu, mu)]
        new_state = ScaleByAdamState(
            count,
            optree.tree_unflatten(treedef, stored_mu),
            optree.tree_unflatten(treedef, new_nu),
        )
        return optree.tree_unflatten(treedef, out), new_state

    return GradientTransformationExtraArgs(init, update)


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (as JAX converts a Python scalar to an array's dtype)."""
    return torch.tensor(value, dtype=dtype).item()


def _bias_correction(beta: float, count: int | torch.Tensor) -> float | torch.Tensor:
    """``1 - beta**count``: on the host for an int count, on its device (float64) for a tensor."""
    if isinstance(count, torch.Tensor):
        return 1.0 - torch.pow(beta, count.to(torch.float64))
    return 1.0 - beta**count


def add_decayed_weights(weight_decay: float, mask: Mask | None = None) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (only where ``mask`` is true, if given).

    Before :func:`scale_by_adam` this is Adam's L2 penalty; after it (and before the learning
    rate) it is AdamW's decoupled decay. ``update`` needs ``params``.

    Example:
        >>> import torch
        >>> params = {"w": torch.ones(2), "bias": torch.ones(2)}
        >>> t = add_decayed_weights(0.1, mask=lambda path, p: not path.endswith("bias"))
        >>> t.update({"w": torch.zeros(2), "bias": torch.zeros(2)}, t.init(params), params)[0]
        {'w': tensor([0.1000, 0.1000]), 'bias': tensor([0., 0.])}
    """
    weight_decay = check_real("add_decayed_weights", "weight_decay", weight_decay, low=0.0)
    if mask is not None:
        return masked(add_decayed_weights(weight_decay), mask)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        donate: bool = False,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        require_params("add_decayed_weights", params)
        p = leaves_like("add_decayed_weights", "params", params, updates, SAME_PARAMS_HINT)
        if weight_decay == 0.0 or not p:
            return updates, state
        new = map_foreach(torch._foreach_add, updates, p, alpha=weight_decay, donate=donate)
        return new, state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


# --------------------------------------------------------------------------- masks


def _mask_flags(where: str, mask: Mask, tree: Any) -> tuple[list[bool], list[Any], Any]:
    """One bool per leaf of ``tree`` (``Sharded`` values are leaves), its leaves and treedef."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    if callable(mask) and not isinstance(mask, (dict, list, tuple)) and _takes_one(mask):
        mask = mask(tree)  # optax's form: fn(params) -> a tree of bools
    if callable(mask) and not isinstance(mask, (dict, list, tuple)):
        flags = [mask(dotted(p), x) for p, x in zip(paths, leaves)]
    else:
        # A mask may cover more dict keys than the tree: one written for all params still
        # applies to the trainable part from ff.partition.
        flags = prefix_mask_flags(where, mask, paths)
    for path, flag in zip(paths, flags):
        if not isinstance(flag, bool):
            raise TypeError(
                f"{where}: the mask gives {flag!r} ({type(flag).__name__}) for "
                f"{dotted(path) or '<root>'}; a mask is a tree of bools or a predicate "
                f"fn(path, leaf) -> bool."
            )
    return flags, leaves, treedef


def _takes_one(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes one positional argument (optax's ``fn(params)``), not two."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    return len(required) == 1 and not any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters
    )


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` is true; other updates pass through unchanged.

    Args:
        inner: the transformation to apply to the masked leaves. Its state covers only them.
        mask: a tree of bools matching the params (or a prefix of it); optax's
            ``fn(params)`` returning one (``Sharded`` values are leaves of ``params``); or a
            predicate ``fn(dotted_path, leaf) -> bool`` called with paths like
            ``blocks.0.attn.weight`` and the leaf (a tensor or ``Sharded``, whose ``ndim`` is
            the global one).

    Example:
        >>> import torch
        >>> params = {"w": torch.ones(2, 2), "norm": torch.ones(2)}
        >>> t = masked(scale(0.0), lambda path, p: p.ndim >= 2)
        >>> u, _ = t.update({"w": torch.ones(2, 2), "norm": torch.ones(2)}, t.init(params))
        >>> u["w"].sum().item(), u["norm"].tolist()
        (0.0, [1.0, 1.0])
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked: inner must be a GradientTransformation, got {inner!r}.")

    def select(flags: list[bool], leaves: list[Any], treedef: Any) -> Any:
        return optree.tree_unflatten(treedef, [x if f else None for x, f in zip(leaves, flags)])

    def init(params: Params) -> MaskedState:
        flags, leaves, treedef = _mask_flags("masked", mask, params)
        return MaskedState(inner.init(select(flags, leaves, treedef)))

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        # The mask is resolved on the params when given (as in init), else on the updates.
        flags, leaves, treedef = _mask_flags("masked", mask, updates if params is None else params)
        u_leaves = leaves
        if params is not None:
            try:
                u_leaves = treedef.flatten_up_to(updates)
            except ValueError:
                raise mismatch_error(
                    "masked", "params", params, updates, SAME_PARAMS_HINT
                ) from None
        sub_params = None if params is None else select(flags, leaves, treedef)
        sub_updates = select(flags, u_leaves, treedef)
        # The inner transformation sees some of the updates: their norm is not ``grad_norm``.
        new_sub, inner_state = call_update(
            inner, sub_updates, state.inner_state, sub_params, without(extra)
        )
        new_leaves = treedef.flatten_up_to(new_sub)
        out = [n if f else u for u, n, f in zip(u_leaves, new_leaves, flags)]
        return optree.tree_unflatten(treedef, out), MaskedState(inner_state)

    return GradientTransformationExtraArgs(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates``, leaf by leaf, keeping each param's dtype. Out of place.

    optax's rounding: the sum is taken in the wider of the two dtypes and rounded to the
    param's once (bfloat16 ``256`` plus a float32 ``1.0039`` is ``258``, not ``256`` as
    rounding the update first would give).

    Example:
        >>> import torch
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
        >>> w = torch.tensor([256.0], dtype=torch.bfloat16)
        >>> apply_updates({"w": w}, {"w": torch.tensor([1.0039])})["w"]
        tensor([258.], dtype=torch.bfloat16)
    """
    check_tensor_tree(params, "apply_updates")
    p = leaves_like("apply_updates", "params", params, updates, SAME_PARAMS_HINT)
    u = local_leaves(updates)[0]
    if not p:
        return params
    if all(x.dtype == y.dtype for x, y in zip(u, p)):
        new = torch._foreach_add(p, u)
    else:  # added in the promoted dtype, rounded to the param's once
        new = [torch.add(y, x).to(y.dtype) for x, y in zip(u, p)]
    # Rebuild with the params' structure, so Sharded values keep their layout.
    return optree.tree_unflatten(local_leaves(params)[1], new)


# --------------------------------------------------------------------------- optimizers


def sgd(
    learning_rate: float | Schedule,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: torch.dtype | None = None,
    *,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """SGD, optax's: the same arguments in the same order, momentum with dampening 0 (as
    ``torch.optim.SGD``), optional Nesterov.

    Args:
        learning_rate: a float or a schedule.
        momentum: the momentum decay (``None`` or ``0`` for none).
        nesterov: Nesterov momentum.
        accumulator_dtype: the momentum buffer's dtype (the params' by default).
        weight_decay: keyword-only, not in optax: ``torch.optim.SGD``'s L2 penalty, added
            to the gradient before the momentum.

    Example:
        >>> import torch
        >>> opt = sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """
    momentum = 0.0 if momentum is None else check_real("sgd", "momentum", momentum, low=0.0)
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs a momentum > 0, e.g. sgd(lr, momentum=0.9).")
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    if momentum:
        parts.append(trace(momentum, nesterov, accumulator_dtype))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


def adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam, optax's: the same arguments in the same order (see :func:`scale_by_adam`).

    ``weight_decay`` (keyword-only, not in optax) is ``torch.optim.Adam``'s L2 penalty,
    added to the gradient before the moments; use :func:`adamw` for decoupled decay.

    Example:
        >>> import torch
        >>> opt = adam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """
    parts = [add_decayed_weights(weight_decay)] if weight_decay else []
    parts += [
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    ]
    return chain(*parts)


def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float = 1e-4,
    mask: Mask | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdamW, optax's: the same arguments, order and defaults (``weight_decay=1e-4``).

    The Adam step, plus ``weight_decay * params`` decoupled from it, both scaled by the
    learning rate: ``torch.optim.AdamW``'s numbers for the same ``weight_decay``, whose
    default there is ``0.01`` (pass it to port torch code). ``mask`` selects the params that
    decay (see :func:`masked`).

    Example:
        >>> import torch
        >>> no_bias = lambda path, p: not path.endswith("bias")
        >>> opt = adamw(0.1, weight_decay=0.5, mask=no_bias)
        >>> params = {"w": torch.ones(1), "bias": torch.ones(1)}
        >>> grads = {"w": torch.ones(1), "bias": torch.ones(1)}
        >>> updates, state = opt.update(grads, opt.init(params), params)
        >>> apply_updates(params, updates)
        {'w': tensor([0.8500]), 'bias': tensor([0.9000])}
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
