"""Learning-rate schedules: pure functions from a step count to a Python float (optax semantics).

A schedule is called with the number of updates applied so far (``0`` for the first update)
and returns a Python ``float``: everything happens on the host, so a scheduled learning rate
never forces a device sync. The schedules here also take the count as a 0-dim integer tensor
(as optimizer states under :func:`~functional_fsdp.apply_if_finite` hold it) and then return a
0-dim float64 tensor on its device, computed with the same float64 arithmetic and without
reading the count back. Builders validate their arguments eagerly and raise
``ValueError``/``TypeError`` that say which argument is wrong and how to fix it.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Protocol

import torch


class Schedule(Protocol):
    """A function from the step count (updates applied so far) to a value, e.g. the lr.

    Any callable ``fn(count) -> float`` is a schedule.

    Example:
        >>> warmup = linear_schedule(0.0, 1e-3, 10)
        >>> warmup(5)
        0.0005
    """

    def __call__(self, count: int) -> float: ...


def _clamped(count: int | torch.Tensor, low: int, high: int) -> float | torch.Tensor:
    """``min(max(count, low), high)``, as float64 (a tensor for a tensor count)."""
    if isinstance(count, torch.Tensor):
        return count.clamp(low, high).to(torch.float64)
    return min(max(count, low), high)


def _value(name: str, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: {name} must be a real number, got {value!r} ({type(value).__name__}). "
            f"Pass a Python float, e.g. {name}=1e-3."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be finite, got {value}.")
    return value


def _steps(name: str, steps: object, where: str, *, positive: bool = False) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(
            f"{where}: {name} must be an int (a number of steps), got {steps!r} "
            f"({type(steps).__name__})."
        )
    steps = int(steps)
    if steps < 0 or (positive and steps == 0):
        bound = "positive" if positive else "non-negative"
        raise ValueError(f"{where}: {name} must be {bound}, got {steps}.")
    return steps


def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Example:
        >>> constant_schedule(0.1)(1000)
        0.1
    """
    value = _value("value", value, "constant_schedule")

    def schedule(count: int) -> float:
        return value

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Go linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    The value is ``init_value`` for the first ``transition_begin`` steps and ``end_value``
    from step ``transition_begin + transition_steps`` on.

    Raises:
        ValueError: if ``transition_steps`` is not positive (use :func:`constant_schedule`
            for a constant) or ``transition_begin`` is negative, or a value is not finite.

    Example:
        >>> s = linear_schedule(1.0, 0.0, transition_steps=4)
        >>> [s(i) for i in range(6)]
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    where = "linear_schedule"
    init_value = _value("init_value", init_value, where)
    end_value = _value("end_value", end_value, where)
    if isinstance(transition_steps, numbers.Integral) and transition_steps == 0:
        raise ValueError(
            f"{where}: transition_steps must be positive, got 0. For a value that never "
            f"changes use constant_schedule({init_value})."
        )
    transition_steps = _steps("transition_steps", transition_steps, where, positive=True)
    transition_begin = _steps("transition_begin", transition_begin, where)

    def schedule(count: int) -> float:
        done = _clamped(count - transition_begin, 0, transition_steps)
        return init_value + (end_value - init_value) * (done / transition_steps)

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    ``value(t) = init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * min(t, decay_steps) /
    decay_steps)) + alpha)``.

    Raises:
        ValueError: if ``decay_steps`` is not positive or a value is not finite.

    Example:
        >>> s = cosine_decay_schedule(1.0, decay_steps=4)
        >>> [round(s(i), 4) for i in range(6)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    where = "cosine_decay_schedule"
    init_value = _value("init_value", init_value, where)
    alpha = _value("alpha", alpha, where)
    decay_steps = _steps("decay_steps", decay_steps, where, positive=True)

    def schedule(count: int) -> float:
        frac = _clamped(count, 0, decay_steps) / decay_steps
        cos = (
            torch.cos(math.pi * frac)
            if isinstance(frac, torch.Tensor)
            else math.cos(math.pi * frac)
        )
        return init_value * ((1.0 - alpha) * 0.5 * (1.0 + cos) + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i-1]`` on, each restarted at count 0.

    Raises:
        ValueError: if there is not exactly one boundary fewer than schedules, or the
            boundaries are negative or not increasing.

    Example:
        >>> s = join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 2)], [3])
        >>> [s(i) for i in range(6)]
        [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    where = "join_schedules"
    schedules = list(schedules)
    bounds = [_steps("boundaries", b, where) for b in boundaries]
    if len(bounds) != len(schedules) - 1:
        raise ValueError(
            f"{where}: got {len(schedules)} schedules and {len(bounds)} boundaries; give one "
            f"boundary between each pair of schedules ({len(schedules) - 1})."
        )
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"{where}: boundaries must be strictly increasing, got {bounds}.")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"{where}: schedules[{i}] is {s!r}, which is not callable.")

    def schedule(count: int) -> float:
        if isinstance(count, torch.Tensor):  # every piece, then a select: no host sync
            value = _float64(schedules[-1](count - (bounds[-1] if bounds else 0)), count)
            for i in reversed(range(len(bounds))):
                start = bounds[i - 1] if i else 0
                piece = _float64(schedules[i](count - start), count)
                value = torch.where(count < bounds[i], piece, value)
            return value
        start = 0
        for fn, bound in zip(schedules, bounds):
            if count < bound:
                return fn(count - start)
            start = bound
        return schedules[-1](count - start)

    return schedule


def _float64(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=like.device)


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    ``decay_steps`` counts the whole schedule, warmup included (optax semantics): the cosine
    phase lasts ``decay_steps - warmup_steps`` steps, and the value is ``end_value`` from step
    ``decay_steps`` on.

    Raises:
        ValueError: if ``warmup_steps`` is negative, ``decay_steps <= warmup_steps``, or a
            value is not finite.

    Example:
        >>> s = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
        >>> [round(s(i), 4) for i in range(8)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    where = "warmup_cosine_decay_schedule"
    init_value = _value("init_value", init_value, where)
    peak_value = _value("peak_value", peak_value, where)
    end_value = _value("end_value", end_value, where)
    warmup_steps = _steps("warmup_steps", warmup_steps, where)
    decay_steps = _steps("decay_steps", decay_steps, where)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"{where}: decay_steps={decay_steps} must be greater than "
            f"warmup_steps={warmup_steps}. decay_steps counts the warmup too: for "
            f"{warmup_steps} warmup steps followed by N decay steps pass "
            f"decay_steps={warmup_steps} + N."
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha)
    if warmup_steps == 0:
        return decay
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    return join_schedules([warmup, decay], [warmup_steps])
