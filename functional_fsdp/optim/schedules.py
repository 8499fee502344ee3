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


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    ``value(t) = init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * min(t, decay_steps) /
    decay_steps))) ** exponent + alpha)`` (optax's).

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
    exponent = _value("exponent", exponent, where)
    decay_steps = _steps("decay_steps", decay_steps, where, positive=True)

    def schedule(count: int) -> float:
        frac = _clamped(count, 0, decay_steps) / decay_steps
        cos = (
            torch.cos(math.pi * frac)
            if isinstance(frac, torch.Tensor)
            else math.cos(math.pi * frac)
        )
        if exponent == 1.0:  # the arithmetic of before exponent existed, bitwise
            return init_value * ((1.0 - alpha) * 0.5 * (1.0 + cos) + alpha)
        return init_value * ((1.0 - alpha) * (0.5 * (1.0 + cos)) ** exponent + alpha)

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
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``
    (raised to ``exponent``, as :func:`cosine_decay_schedule`).

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
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)
    if warmup_steps == 0:
        return decay
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    return join_schedules([warmup, decay], [warmup_steps])


# --------------------------------------------------------------------------- more of optax's


def _fn(count: object, host: object, device: object) -> object:
    return device if isinstance(count, torch.Tensor) else host


def _as64(count: int | torch.Tensor) -> float | torch.Tensor:
    return count.to(torch.float64) if isinstance(count, torch.Tensor) else count


def _where(cond: bool | torch.Tensor, a: object, b: object) -> object:
    """``a if cond else b``, as a select for a tensor ``cond`` (no host sync)."""
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, _float64(a, cond), _float64(b, cond))
    return a if cond else b


def polynomial_schedule(
    init_value: float,
    end_value: float,
    power: float,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """From ``init_value`` to ``end_value`` along ``(1 - t / transition_steps) ** power``.

    optax's: ``(init_value - end_value) * (1 - t / transition_steps) ** power + end_value``,
    ``t`` counted from ``transition_begin`` and clipped to ``[0, transition_steps]``.

    Example:
        >>> s = polynomial_schedule(1.0, 0.0, power=2, transition_steps=4)
        >>> [s(i) for i in range(6)]
        [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """
    where = "polynomial_schedule"
    init_value = _value("init_value", init_value, where)
    end_value = _value("end_value", end_value, where)
    power = _value("power", power, where)
    transition_steps = _steps("transition_steps", transition_steps, where, positive=True)
    transition_begin = _steps("transition_begin", transition_begin, where)

    def schedule(count: int) -> float:
        done = _clamped(count - transition_begin, 0, transition_steps)
        frac = 1 - done / transition_steps
        return (init_value - end_value) * frac**power + end_value

    return schedule


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init_value * decay_rate ** ((t - transition_begin) / transition_steps)`` (optax's).

    ``staircase`` floors the exponent; ``end_value`` bounds the value (below for a decay,
    above for a growth). Before ``transition_begin`` the value is ``init_value``.

    Example:
        >>> s = exponential_decay(1.0, transition_steps=2, decay_rate=0.5, staircase=True)
        >>> [s(i) for i in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    where = "exponential_decay"
    init_value = _value("init_value", init_value, where)
    decay_rate = _value("decay_rate", decay_rate, where)
    transition_steps = _steps("transition_steps", transition_steps, where, positive=True)
    transition_begin = _steps("transition_begin", transition_begin, where)
    end = None if end_value is None else _value("end_value", end_value, where)

    def schedule(count: int) -> float:
        elapsed = _as64(count - transition_begin)
        p = elapsed / transition_steps
        if staircase:
            p = _fn(count, math.floor, torch.floor)(p)
        value = _where(elapsed <= 0, init_value, init_value * decay_rate**p)
        if end is not None:
            bound = (
                (max if decay_rate < 1.0 else min)
                if not isinstance(value, torch.Tensor)
                else (torch.clamp_min if decay_rate < 1.0 else torch.clamp_max)
            )
            value = bound(value, end)
        return value

    return schedule


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: dict[int, float] | None = None
) -> Schedule:
    """``init_value``, multiplied by ``scale`` from each step ``boundary`` on (optax's).

    Example:
        >>> s = piecewise_constant_schedule(1.0, {2: 0.5, 4: 0.1})
        >>> [s(i) for i in range(6)]
        [1.0, 1.0, 0.5, 0.5, 0.05, 0.05]
    """
    where = "piecewise_constant_schedule"
    init_value = _value("init_value", init_value, where)
    pieces = _boundaries_and_scales(where, boundaries_and_scales)

    def schedule(count: int) -> float:
        value: float | torch.Tensor = init_value
        for boundary, scale in pieces:
            value = _where(count >= boundary, value * scale, value)
        return value

    return schedule


def _boundaries_and_scales(where: str, given: object) -> list[tuple[int, float]]:
    if given is None:
        return []
    if not isinstance(given, dict):
        raise TypeError(
            f"{where}: boundaries_and_scales must be a dict {{step: scale}}, got {given!r}."
        )
    pieces = sorted(
        (_steps("a boundary", b, where), _value("a scale", s, where)) for b, s in given.items()
    )
    for boundary, scale in pieces:
        if scale < 0:
            raise ValueError(f"{where}: scales must be >= 0, got {scale} at step {boundary}.")
    return pieces


def _piecewise_interpolate(
    where: str, kind: str, init_value: float, boundaries_and_scales: dict[int, float]
) -> Schedule:
    """optax's ``piecewise_interpolate_schedule``: values ``init_value * prod(scales)``
    reached at each boundary, interpolated linearly or along a half cosine in between."""
    pieces = _boundaries_and_scales(where, boundaries_and_scales)
    bounds = [0] + [b for b, _ in pieces]
    values = [init_value]
    for _, scale in pieces:
        values.append(values[-1] * scale)

    def interpolate(start: float, end: float, pct: float | torch.Tensor) -> float | torch.Tensor:
        if kind == "linear":
            return (end - start) * pct + start
        cos = _fn(pct, math.cos, torch.cos)(math.pi * pct)
        return end + (start - end) / 2.0 * (cos + 1)

    def schedule(count: int) -> float:
        c = _as64(count)
        value: float | torch.Tensor = _where(bounds[-1] <= count, values[-1], 0.0)
        for i in range(len(bounds) - 1):
            lo, hi = bounds[i], bounds[i + 1]
            pct = (c - lo) / max(hi - lo, 1)
            inside = (lo <= count) & (count < hi)
            if isinstance(inside, torch.Tensor):
                value = torch.where(
                    inside, _float64(interpolate(values[i], values[i + 1], pct), inside), value
                )
            elif inside:
                value = interpolate(values[i], values[i + 1], pct)
        return value

    return schedule


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """One cycle (Smith 2018) with cosine ramps, optax's: from ``peak_value / div_factor`` up
    to ``peak_value`` over the first ``pct_start`` of ``transition_steps``, then down to
    ``peak_value / (div_factor * final_div_factor)``.

    Example:
        >>> s = cosine_onecycle_schedule(10, 1.0)
        >>> round(s(0), 4), round(s(3), 4), round(s(10), 8)
        (0.04, 1.0, 4e-06)
    """
    where = "cosine_onecycle_schedule"
    transition_steps = _steps("transition_steps", transition_steps, where, positive=True)
    peak_value = _value("peak_value", peak_value, where)
    return _piecewise_interpolate(
        where,
        "cosine",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(transition_steps): 1.0 / (div_factor * final_div_factor),
        },
    )


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """One cycle with linear ramps, optax's: up to ``peak_value`` at ``pct_start``, back to
    ``peak_value / div_factor`` at ``pct_final``, then to ``... / final_div_factor``.

    Example:
        >>> s = linear_onecycle_schedule(10, 1.0)
        >>> round(s(0), 4), round(s(3), 4), round(s(8), 4)
        (0.04, 1.0, 0.04)
    """
    where = "linear_onecycle_schedule"
    transition_steps = _steps("transition_steps", transition_steps, where, positive=True)
    peak_value = _value("peak_value", peak_value, where)
    return _piecewise_interpolate(
        where,
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(pct_final * transition_steps): 1.0 / div_factor,
            transition_steps: 1.0 / final_div_factor,
        },
    )


def sgdr_schedule(cosine_kwargs: Sequence[dict[str, float]]) -> Schedule:
    """Warm restarts (Loshchilov & Hutter 2017), optax's: one
    :func:`warmup_cosine_decay_schedule` per dict of ``cosine_kwargs``, each lasting its
    ``decay_steps``, joined.

    Example:
        >>> cycle = dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=3)
        >>> s = sgdr_schedule([cycle, cycle])
        >>> [round(s(i), 4) for i in range(6)]
        [0.0, 1.0, 0.5, 0.0, 1.0, 0.5]
    """
    schedules, boundaries, step = [], [], 0
    for kwargs in cosine_kwargs:
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += int(kwargs["decay_steps"])
        boundaries.append(step)
    if not schedules:
        raise ValueError(
            "sgdr_schedule: give at least one dict of warmup_cosine_decay_schedule's arguments."
        )
    return join_schedules(schedules, boundaries[:-1])
