"""Tables (rich), HTML and a text chart of planner reports (private; ``rich`` loads lazily)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

# Reports are read, never built, here: annotated as ``Any`` so that this module imports
# nothing of the planner (``_plan`` renders its reports with it).
PlanReport = Any

PARTS = ("params", "grads", "optimizer", "gathered", "activations")


def human(n: int | float | None) -> str:
    """Bytes as ``1.50 GiB`` / ``12.0 MiB`` / ``512 B``; ``-`` for ``None``."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
UNIT_NOTE = "bytes: K, M, G, T are KiB, MiB, GiB, TiB"
SOURCE_NOTE = "source cp: context-parallel attention's keys and values (and their gradients)"


def short(n: int | float) -> str:
    """Bytes in 3 significant digits and the unit's letter (``263G``, ``7.13G``, ``512B``;
    K, M, G, T are KiB, MiB, GiB, TiB): at most 5 characters, so that a table of them fits
    an 80-column terminal."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g}{unit[0]}" if value < 1000 else f"{value:.0f}{unit[0]}"
    return f"{int(n)}B"


def parts(report: PlanReport) -> dict[str, int]:
    """The peak estimate split into its parts (bytes per device)."""
    return {
        "params": report.param_bytes,
        "grads": report.grad_bytes,
        "optimizer": report.opt_state_bytes + report.owner_peak_bytes,
        "gathered": report.gathered_peak_bytes,
        "activations": (report.activation_bytes or 0) + report.recompute_bytes,
    }


def report_table(report: PlanReport) -> Any:
    """Memory per device, then communication by kind and axis; names never wrap (a row's
    label wraps between words, so a unit's path stays whole)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    compact: dict[str, Any] = dict(title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)

    mesh = " x ".join(f"{a}={s}" for a, s in report.mesh.items())
    title = f"{report.name + ': ' if report.name else ''}per device on {mesh}"
    if report.sequence_axis is not None and report.mesh.get(report.sequence_axis, 1) > 1:
        title += f" ({report.sequence_axis} splits each sequence)"
    mem = Table(title=title, **compact)
    mem.add_column("memory")
    mem.add_column("bytes", justify="right", no_wrap=True)
    rows = [
        ("parameters (shards)", report.param_bytes),
        ("  of which padding", report.padding_bytes),
        ("gradients", report.grad_bytes),
        ("optimizer state", report.opt_state_bytes),
    ]
    if report.owner_bytes:
        rows.append(
            (f"  + owners' exchange (rank {report.owner_peak_rank})", report.owner_peak_bytes)
        )
    rows += [
        (f"largest unit ({report.largest_unit or '<root>'})", report.largest_unit_bytes),
        ("gathered peak (prefetch)", report.gathered_peak_bytes),
        ("activations", report.activation_bytes),
        ("  without checkpointing", report.activation_bytes_no_checkpoint),
        ("  every unit checkpointed", report.activation_bytes_checkpoint),
        ("peak estimate", report.peak_bytes),
    ]
    for label, value in rows:
        mem.add_row(label, human(value))
    comm = Table(
        title="communication per step (bytes sent per rank)",
        caption=SOURCE_NOTE if any(c.source == "cp" for c in report.comms) else None,
        caption_justify="left",
        **compact,
    )
    for col in ("kind", "axis", "source", "count", "bytes"):
        comm.add_column(col, justify="right" if col in ("count", "bytes") else "left", no_wrap=True)
    for c in report.comms:
        comm.add_row(c.kind, c.axis, c.source, str(c.count), human(c.bytes))
    return Group(mem, comm)


def comparison_table(
    reports: Sequence[PlanReport], gib: float | None = None, paper: dict[str, float] | None = None
) -> Any:
    """One row per report: memory by part, peak and traffic per step, in :func:`short` bytes.

    Laid out for 80 columns: no cell padding (a space divides the columns), names and
    numbers never wrap, a mesh wraps between its axes only; ``fits`` says yes or no in words.
    """
    from rich import box
    from rich.table import Table

    table = Table(
        title="per device" + (f" (fits in {gib:g} GiB?)" if gib else ""),
        title_justify="left",
        caption=UNIT_NOTE,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 0),
    )
    table.add_column("strategy", no_wrap=True)
    axes = [f"{a}={s}" for r in reports for a, s in r.mesh.items()]
    table.add_column("mesh", min_width=max(map(len, axes), default=4))
    for col in ("params", "grads", "optim", "gathered", "activ", "peak", "comm"):
        table.add_column(col, justify="right", no_wrap=True)
    if gib is not None:
        table.add_column("fits", no_wrap=True)
    for r in reports:
        p = parts(r)
        row = [r.name, " ".join(f"{a}={s}" for a, s in r.mesh.items())]
        row += [short(p[k]) for k in PARTS] + [short(r.peak_bytes), short(r.comm_bytes())]
        if gib is not None:
            row.append("yes" if r.fits(gib) else "no")
        table.add_row(*row)
    if not paper:
        return table
    from rich.console import Group

    return Group(table, paper_table(reports, paper))


def paper_table(reports: Sequence[PlanReport], paper: dict[str, float]) -> Any:
    """Bytes at rest per device next to the ZeRO paper's figure, in decimal GB as it counts."""
    from rich.table import Table

    psi = max(r.params for r in reports) / 1e9
    n = max(r.world_size for r in reports)
    table = Table(
        title="at rest per device vs the ZeRO paper, GB",
        caption=f"Ψ = {psi:.2f}B parameters, N = {n}, K = 12",
        title_justify="left",
        caption_justify="left",
    )
    for col in ("strategy", "params", "grads", "optimizer", "at rest", "paper"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in reports:
        if r.name not in paper:
            continue
        figures = (r.param_bytes, r.grad_bytes, r.opt_state_bytes, r.at_rest_bytes)
        table.add_row(r.name, *(f"{b / 1e9:.1f}" for b in figures), f"{paper[r.name] / 1e9:.1f}")
    return table


def terminal_width() -> int:
    """The width ``rich`` gives a console here: the terminal's, else ``COLUMNS``, else 80
    (a pipe, a file); in Jupyter, rich's default for notebooks."""
    from rich.console import Console

    return Console().width


def to_text(renderable: Any, width: int | None = None) -> str:
    """``renderable`` as plain text (no colour), ``width`` columns wide (default: the
    terminal's, see :func:`terminal_width`)."""
    from rich.console import Console

    console = Console(
        file=io.StringIO(),
        width=width or terminal_width(),
        color_system=None,
        record=True,
        force_jupyter=False,
    )
    console.print(renderable)
    return console.export_text()


def to_html(renderable: Any) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=110, record=True, force_jupyter=False)
    console.print(renderable)
    return console.export_html(inline_styles=True)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def text_chart(reports: Sequence[PlanReport], gib: float | None = None, width: int = 50) -> str:
    """A bar per report, one letter per part (p, g, o, G, a), scaled to the largest peak."""
    letters = dict(zip(PARTS, "pgoGa"))
    top = max([r.peak_bytes for r in reports] + [gib * 1024**3 if gib else 0]) or 1
    name_w = max(len(r.name or str(r.mesh)) for r in reports)
    lines = []
    for r in reports:
        bar = "".join(letters[k] * round(v / top * width) for k, v in parts(r).items())
        lines.append(f"{(r.name or str(r.mesh)):<{name_w}} |{bar:<{width}}| {human(r.peak_bytes)}")
    legend = ", ".join(f"{c}={k}" for k, c in letters.items())
    if gib:
        mark = round(gib * 1024**3 / top * width)
        lines.append(f"{'':<{name_w}}  {' ' * mark}^ {gib:g} GiB")
    lines.append(f"({legend})")
    return "\n".join(lines)
