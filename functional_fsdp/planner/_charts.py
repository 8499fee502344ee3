"""The planner's memory and communication per device as matplotlib charts (private; shown
as :func:`functional_fsdp.plot_memory` and :func:`functional_fsdp.plot_comms`).

Each function draws on a matplotlib ``Axes`` (a new figure unless ``ax=`` is given) and
returns it, so the data can be read back (``ax.containers``). matplotlib is an optional
dependency, imported when a function is called: ``pip install 'functional_fsdp[notebooks]'``.

Planned and measured figures sit side by side: give ``measured=`` (what ``ff.count_comms``,
``ff.track_memory`` and the real tensors of a run show) and each report gets a second,
hatched bar next to its planned one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._plan import PlanReport
from ._render import PARTS, parts

INSTALL = "pip install 'functional_fsdp[notebooks]'"
_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f"functional_fsdp's plots need matplotlib, an optional dependency: {INSTALL} "
            f"(or pip install matplotlib)."
        ) from e
    return plt


def _axes(ax: Any, figsize: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=figsize)
    return ax


def _unit(largest: float) -> tuple[str, int]:
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def _reports(reports: Any, fn: str) -> list[tuple[str, PlanReport]]:
    """``[(label, report)]`` from a report, a Comparison, a list or a dict of reports."""
    if isinstance(reports, PlanReport):
        items: list[tuple[str, Any]] = [("", reports)]
    elif isinstance(getattr(reports, "reports", None), tuple):  # a Comparison
        items = [("", r) for r in reports.reports]
    elif isinstance(reports, Mapping):
        items = [(str(k), r) for k, r in reports.items()]
    elif isinstance(reports, Sequence) and not isinstance(reports, str):
        items = [("", r) for r in reports]
    else:
        items = [("", reports)]
    bad = [r for _, r in items if not isinstance(r, PlanReport)]
    if bad or not items:
        got = type(bad[0]).__name__ if bad else "nothing"
        raise TypeError(
            f"ff.{fn} takes what ff.plan or ff.compare_strategies returns: a PlanReport, a "
            f"Comparison, or a list or dict of PlanReports; got {got}. For example "
            f"ff.{fn}(ff.compare_strategies(model, 8))."
        )
    return [(label or r.name or str(r.mesh), r) for label, r in items]


def _check_measured(measured: Mapping[str, Any] | None, labels: list[str], fn: str) -> None:
    unknown = [k for k in measured or {} if k not in labels]
    if unknown:
        raise ValueError(
            f"ff.{fn}(measured=...): {unknown[0]!r} names no report; the reports are "
            f"{labels}. Key measured figures by the report's name (e.g. the strategy)."
        )


def plot_memory(
    reports: Any,
    *,
    measured: Mapping[str, Mapping[str, int]] | None = None,
    gib: float | None = None,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Memory per device of each report, as bars stacked by part.

    The parts are those of the planner's peak estimate: parameter shards (``params``),
    gradients (``grads``), optimizer state (``optimizer``), gathered units at their peak
    with prefetch (``gathered``) and activations (``activations``). The unit (B, KiB,
    MiB, GiB) follows the largest bar.

    Args:
        reports: a :class:`~functional_fsdp.PlanReport`, a
            :class:`~functional_fsdp.Comparison`, a list of reports, or ``{label: report}``.
        measured: ``{report name: {part: bytes}}`` from a run (parts may be left out, e.g.
            activations on a simulated mesh); each gets a hatched bar beside the planned one.
        gib: draw the device's memory (GiB) as a dashed line.
        ax: the matplotlib ``Axes`` to draw on (default: a new figure).
        title: the axes title.

    Returns:
        The ``Axes``. Its bar containers are labelled by part (planned) and
        ``"_measured <part>"`` (measured: hidden from the legend).

    Raises:
        TypeError: ``reports`` is not what ``ff.plan``/``ff.compare_strategies`` return.
        ValueError: ``measured`` names an unknown report or part.
        ImportError: without matplotlib (``pip install 'functional_fsdp[notebooks]'``).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        >>> cmp = ff.compare_strategies(model, 4, strategies=("ddp", "zero3"))
        >>> ax = ff.plot_memory(cmp, measured={"zero3": {"params": 8320}})
        >>> [t.get_text() for t in ax.get_xticklabels()], ax.get_ylabel()
        (['ddp', 'zero3'], 'KiB per device')
    """
    items = _reports(reports, "plot_memory")
    labels = [label for label, _ in items]
    _check_measured(measured, labels, "plot_memory")
    for name, figures in (measured or {}).items():
        bad = [p for p in figures if p not in PARTS]
        if bad:
            raise ValueError(
                f"ff.plot_memory(measured=...): {name!r} has part {bad[0]!r}; the parts are "
                f"{PARTS}."
            )
    planned = [parts(r) for _, r in items]
    done = [dict((measured or {}).get(label, {})) for label in labels]
    largest = max(
        [sum(p.values()) for p in planned]
        + [sum(m.values()) for m in done]
        + [gib * 1024**3 if gib else 0]
    )
    unit, size = _unit(largest)
    ax = _axes(ax, (max(6.0, 1.0 * len(items)), 4))
    width = 0.4 if measured else 0.8
    xs = list(range(len(items)))
    colors = _part_colors()
    _stacked_bars(
        ax,
        xs,
        width,
        [
            (
                part,
                colors[part],
                [p[part] / size for p in planned],
                [m.get(part, 0) / size for m in done] if measured else None,
            )
            for part in PARTS
        ],
    )
    if gib is not None:
        ax.axhline(gib * 1024**3 / size, color="black", linestyle="--", linewidth=1)
        ax.text(xs[-1] + 0.5, gib * 1024**3 / size, f" {gib:g} GiB", va="bottom", ha="right")
    _finish(ax, xs, labels, bool(measured))
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(title or "memory per device: planned" + (" and measured" if measured else ""))
    return ax


def plot_comms(
    reports: Any,
    *,
    measured: Mapping[str, Any] | None = None,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Bytes each rank sends per training step, as bars stacked by collective and mesh axis.

    The number of collectives is written above each bar.

    Args:
        reports: a :class:`~functional_fsdp.PlanReport`, a
            :class:`~functional_fsdp.Comparison`, a list of reports, or ``{label: report}``.
        measured: ``{report name: what a step measured}``: a
            :class:`~functional_fsdp.CommCounter` from ``ff.count_comms()``, or its
            ``by_kind_and_axis()`` (``{(kind, axis): (count, bytes)}``); each gets a hatched
            bar beside the planned one. Context-parallel attention's collectives (source
            ``"cp"``) are a layer of their own, ``"<kind> over <axis> (attention)"``; a
            measured counter splits them off by their records' label, a
            ``by_kind_and_axis()`` cannot.
        ax: the matplotlib ``Axes`` to draw on (default: a new figure).
        title: the axes title.

    Returns:
        The ``Axes``. Its bar containers are labelled ``"<kind> over <axis>"`` (planned)
        and ``"_measured <kind> over <axis>"`` (measured).

    Raises:
        TypeError: ``reports`` is not what ``ff.plan``/``ff.compare_strategies`` return.
        ValueError: ``measured`` names an unknown report.
        ImportError: without matplotlib (``pip install 'functional_fsdp[notebooks]'``).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        >>> ax = ff.plot_comms(ff.compare_strategies(model, 4, strategies=("ddp", "zero3")))
        >>> sorted(c.get_label() for c in ax.containers)
        ['all_gather over dp', 'all_reduce over dp', 'reduce_scatter over dp']
    """
    items = _reports(reports, "plot_comms")
    labels = [label for label, _ in items]
    _check_measured(measured, labels, "plot_comms")
    planned = [_by_layer(r) for _, r in items]
    done = [_by_kind_and_axis((measured or {}).get(label)) for label in labels]
    keys = sorted({k for figures in planned + done for k in figures})
    largest = max([sum(b for _, b in f.values()) for f in planned + done] + [1])
    unit, size = _unit(largest)
    ax = _axes(ax, (max(6.0, 1.0 * len(items)), 4))
    width = 0.4 if measured else 0.8
    xs = list(range(len(items)))
    cmap = _pyplot().get_cmap("tab10")
    bottom, bottom_m = _stacked_bars(
        ax,
        xs,
        width,
        [
            (
                _layer_label(key),
                cmap(i % 10),
                [f.get(key, (0, 0))[1] / size for f in planned],
                [f.get(key, (0, 0))[1] / size for f in done] if measured else None,
            )
            for i, key in enumerate(keys)
        ],
    )
    for x, f, top in zip(xs, planned, bottom):
        ax.text(
            x - width / 2 if measured else x,
            top,
            str(sum(n for n, _ in f.values())),
            ha="center",
            va="bottom",
            fontsize="small",
        )
    if measured:
        for x, f, top, label in zip(xs, done, bottom_m, labels):
            if label in measured:
                ax.text(
                    x + width / 2,
                    top,
                    str(sum(n for n, _ in f.values())),
                    ha="center",
                    va="bottom",
                    fontsize="small",
                )
    _finish(ax, xs, labels, bool(measured))
    ax.set_ylabel(f"{unit} sent per rank per step")
    ax.set_title(
        title
        or "communication per step: planned"
        + (" and measured" if measured else "")
        + " (collectives on top)"
    )
    return ax


Layer = tuple[str, str, bool]  # (kind, axis, issued by context-parallel attention)


def _layer_label(key: Layer) -> str:
    return f"{key[0]} over {key[1]}" + (" (attention)" if key[2] else "")


def _by_layer(report: PlanReport) -> dict[Layer, tuple[int, int]]:
    """``{(kind, axis, attention): (count, bytes)}`` of a report's collectives."""
    out: dict[Layer, tuple[int, int]] = {}
    for c in report.comms:
        key = (c.kind, c.axis, c.source == "cp")
        n, b = out.get(key, (0, 0))
        out[key] = (n + c.count, b + c.bytes)
    return out


def _by_kind_and_axis(figures: Any) -> dict[Layer, tuple[int, int]]:
    if figures is None:
        return {}
    records = getattr(figures, "records", None)
    if records is not None:  # a CommCounter: its records say which the attention issued
        from ..cp.attention import COMM_LABEL

        out: dict[Layer, tuple[int, int]] = {}
        for r in records:
            key = (r.kind, r.axis, r.label == COMM_LABEL)
            n, b = out.get(key, (0, 0))
            out[key] = (n + 1, b + r.bytes)
        return out
    if hasattr(figures, "by_kind_and_axis"):
        figures = figures.by_kind_and_axis()
    if not isinstance(figures, Mapping):
        raise TypeError(
            f"ff.plot_comms(measured=...) takes a CommCounter (from ff.count_comms()) or its "
            f"by_kind_and_axis() per report, got {type(figures).__name__}."
        )
    return {(str(k[0]), str(k[1]), False): (int(v[0]), int(v[1])) for k, v in figures.items()}


def _part_colors() -> dict[str, Any]:
    cmap = _pyplot().get_cmap("tab10")
    return {part: cmap(i) for i, part in enumerate(PARTS)}


def _finish(ax: Any, xs: list[int], labels: list[str], measured: bool) -> None:
    """Tick labels, and a legend with an entry for the hatched (measured) bars."""
    from matplotlib.patches import Patch

    slanted = len(labels) > 3 or max(len(label) for label in labels) > 12
    ax.set_xticks(xs, labels, rotation=30 if slanted else 0, ha="right" if slanted else "center")
    handles, _ = ax.get_legend_handles_labels()
    if measured:
        hatch = Patch(facecolor="white", edgecolor="black", hatch="//", label="measured")
        handles.append(hatch)
    # beside the bars, not over them; headroom above the tallest bar for its label
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)


def _stacked_bars(
    ax: Any,
    xs: list[int],
    width: float,
    series: list[tuple[str, Any, list[float], list[float] | None]],
) -> tuple[list[float], list[float]]:
    """Stacked bars, one layer per ``(label, color, planned, measured)``; a measured layer
    (hatched, labelled ``_measured <label>``) stands beside the planned one. Returns the tops."""
    bottom = [0.0] * len(xs)
    bottom_m = [0.0] * len(xs)
    for label, color, planned, measured in series:
        at = [x - width / 2 if measured is not None else x for x in xs]
        ax.bar(at, planned, width, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, planned)]
        if measured is not None:
            ax.bar(
                [x + width / 2 for x in xs],
                measured,
                width,
                bottom=bottom_m,
                label=f"_measured {label}",
                color=color,
                hatch="//",
                edgecolor="black",
                linewidth=0.5,
            )
            bottom_m = [b + h for b, h in zip(bottom_m, measured)]
    return bottom, bottom_m
