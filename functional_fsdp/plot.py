"""Plots for notebooks: loss curves, and the planner's memory and communication per device.

Each function draws on a matplotlib ``Axes`` (a new figure unless ``ax=`` is given) and
returns it, so the data can be read back (``ax.lines``, ``ax.containers``). matplotlib is an
optional dependency, imported when a function is called: ``pip install
'functional_fsdp[notebooks]'``.

Planned and measured figures sit side by side: give ``measured=`` (what ``ff.count_comms``,
``ff.track_memory`` and the real tensors of a run show) and each report gets a second,
hatched bar next to its planned one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .planner._charts import _axes
from .planner._charts import plot_comms as plot_comms
from .planner._charts import plot_memory as plot_memory

_STYLES = (("-", "o"), ("--", "x"), (":", "s"), ("-.", "^"))


def _float(x: Any) -> float:
    """A loss as a float: a number, a 0-d tensor, or a simulated per-rank tensor (rank 0)."""
    per_rank = getattr(x, "_local_tensors", None)
    if per_rank is not None:
        x = per_rank[min(per_rank)]
    return float(x)


def plot_losses(
    runs: Mapping[str, Sequence[Any]],
    *,
    ax: Any = None,
    title: str | None = None,
    logy: bool = False,
) -> Any:
    """Loss curves of several runs overlaid (e.g. simulated against real processes).

    Step ``i`` (from 1) of each run is plotted at ``x = i``. Runs get different line styles
    and markers, so curves that coincide stay visible.

    Args:
        runs: ``{name: losses}``; a loss may be a float, a 0-d tensor, or a per-rank tensor
            of a simulated mesh (rank 0's value is plotted).
        ax: the matplotlib ``Axes`` to draw on (default: a new figure).
        title: the axes title.
        logy: a logarithmic loss axis.

    Returns:
        The ``Axes``: one line per run, labelled with its name.

    Raises:
        ImportError: without matplotlib (``pip install 'functional_fsdp[notebooks]'``).

    Example:
        >>> import functional_fsdp as ff
        >>> ax = ff.plot_losses({"simulated": [2.5, 2.1, 1.9], "gloo": [2.5, 2.1, 1.9]})
        >>> [(line.get_label(), line.get_ydata().tolist()) for line in ax.lines][1]
        ('gloo', [2.5, 2.1, 1.9])
    """
    if not isinstance(runs, Mapping) or not runs:
        raise TypeError(
            f"ff.plot_losses takes {{run name: losses}}, e.g. {{'simulated': [2.3, 2.1], "
            f"'gloo': [2.3, 2.1]}}; got {type(runs).__name__}."
        )
    ax = _axes(ax, (6, 3.5))
    for i, (name, losses) in enumerate(runs.items()):
        ys = [_float(v) for v in losses]
        style, marker = _STYLES[i % len(_STYLES)]
        ax.plot(range(1, len(ys) + 1), ys, linestyle=style, marker=marker, label=str(name))
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.legend(fontsize="small")
    return ax
