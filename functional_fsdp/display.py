"""Look at layouts: which mesh coordinate owns which block, and a table of a parameter tree.

Pure functions of the layout (no communication, no process needed). ``rich`` is imported
lazily. Every picture colours a mesh coordinate the same way: the coordinate's row-major
index on the mesh (its rank on a ``make_mesh`` mesh) picks the colour, so ``dp1`` has the
same colour in every value and every call.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import optree

from .distributed.mesh import axis_sizes
from .sharded import Sharded, provide
from .spec import Layout, format_mesh

# Light backgrounds that stay readable with black text on light and dark themes.
PALETTE = (
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#8dd3c7",
    "#ffffb3",
    "#bebada",
    "#fb8072",
    "#80b1d3",
    "#fdb462",
    "#b3de69",
    "#fccde5",
    "#ccebc5",
    "#ffed6f",
    "#bc80bd",
)
REPLICATED = "#d9d9d9"  # a block every coordinate holds
# A 16-colour terminal maps the light colours above onto few of its own, so that neighbouring
# blocks can look alike: there, coordinates cycle through these (black text on each), and
# neighbouring coordinates always differ. The labels in the cells carry the information; with
# colour off (NO_COLOR, a pipe) they are all there is, and the colour legend is left out.
PALETTE_16 = (
    "cyan",
    "yellow",
    "green",
    "magenta",
    "bright_cyan",
    "bright_yellow",
    "bright_green",
    "bright_magenta",
    "bright_red",
    "bright_blue",
    "red",
)
REPLICATED_16 = "white"
_TO_16 = {c: PALETTE_16[i % len(PALETTE_16)] for i, c in enumerate(PALETTE)} | {
    REPLICATED: REPLICATED_16
}
_ORDERED = "functional_fsdp.display"
MAX_BLOCKS = 16  # blocks shown per row or column; the middle ones are elided beyond that


def block_owners(layout: Layout) -> dict[tuple[tuple[int, int], ...], list[dict[str, int]]]:
    """``{((start, stop) per dim): [mesh coordinates holding exactly that block]}``.

    Coordinates whose block is empty (all padding) are left out.

    Example:
        >>> from functional_fsdp import P
        >>> owners = block_owners(Layout.make((4,), P("dp"), {"dp": 2, "tp": 2}))
        >>> owners[((0, 2),)]
        [{'dp': 0, 'tp': 0}, {'dp': 0, 'tp': 1}]
    """
    out: dict[tuple[tuple[int, int], ...], list[dict[str, int]]] = {}
    for coord in _coordinates(layout.sizes):
        slices, _ = layout.owned(coord)
        if any(s.stop == s.start for s in slices):
            continue
        out.setdefault(tuple((s.start, s.stop) for s in slices), []).append(coord)
    return out


def coordinate_color(coord: Mapping[str, int], sizes: Mapping[str, int]) -> str:
    """The colour of a mesh coordinate in every picture: ``PALETTE[row-major index]``.

    Example:
        >>> coordinate_color({"dp": 1, "tp": 0}, {"dp": 2, "tp": 2}) == PALETTE[2]
        True
    """
    return PALETTE[_index(coord, sizes) % len(PALETTE)]


def _coordinates(sizes: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Every mesh coordinate, in row-major order (the rank order of ``make_mesh``)."""
    names = list(sizes)
    for flat in range(math.prod(sizes.values())):
        coord, rest = {}, flat
        for name in reversed(names):
            coord[name] = rest % sizes[name]
            rest //= sizes[name]
        yield {n: coord[n] for n in names}


def _index(coord: Mapping[str, int], sizes: Mapping[str, int]) -> int:
    flat = 0
    for name, size in sizes.items():
        flat = flat * size + coord[name]
    return flat


def _coord_label(coord: Mapping[str, int], show: list[str]) -> str:
    return ",".join(f"{a}{coord[a]}" for a in show)


# --------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class _Cell:
    text: str
    color: str


@dataclass(frozen=True)
class _Grid:
    """The picture of one layout as data: headers, cells and notes (shared by text and HTML)."""

    title: str
    corner: str  # what the row headers are
    rows: list[str]
    cols: list[str]
    cells: list[list[_Cell | None]]  # None: an elided row or column
    notes: list[str]


def _range_label(ranges: tuple[tuple[int, int], ...], pads: tuple[int, ...]) -> str:
    text = "[" + ", ".join(f"{a}:{b}" for a, b in ranges) + "]"
    if any(pads):
        text += " +" + ",".join(str(p) for p in pads) + " pad"
    return text


def _elide(keys: list[Any], limit: int = MAX_BLOCKS) -> list[Any]:
    """At most ``limit`` keys: the first and last halves, ``None`` standing for the rest."""
    if len(keys) <= limit:
        return keys
    half = limit // 2
    return [*keys[:half], None, *keys[-half:]]


def _grid(value: Sharded) -> _Grid:
    layout = value.layout
    sizes = layout.sizes
    names = list(sizes)
    used = [a for a in names if a in value.spec.axes]
    replicated = [a for a in names if a not in used]
    ndim = value.ndim
    local = layout.local_shape
    owners = block_owners(layout)

    def split(key: tuple[tuple[int, int], ...]) -> tuple[tuple, tuple]:
        # rows: blocks of dim 0; columns: blocks of the other dims (a 1-D value is one row)
        return ((), key) if ndim == 1 else (key[:1], key[1:])

    row_keys = _elide(sorted({split(k)[0] for k in owners}))
    col_keys = _elide(sorted({split(k)[1] for k in owners}))

    def header(key: tuple[tuple[int, int], ...] | None, dims: range) -> str:
        if key is None:
            return "…"
        if not key:
            return ""
        pads = tuple(local[d] - (b - a) for d, (a, b) in zip(dims, key))
        return _range_label(key, pads)

    first_col_dim = 0 if ndim == 1 else 1
    rows = [header(r, range(0, 1)) for r in row_keys]
    cols = [header(c, range(first_col_dim, ndim)) for c in col_keys]
    n_copies = math.prod(sizes[a] for a in replicated)
    cells: list[list[_Cell | None]] = []
    for r in row_keys:
        line: list[_Cell | None] = []
        for c in col_keys:
            coords = owners.get(r + c, []) if r is not None and c is not None else None
            if coords is None:
                line.append(None)
            elif not coords:  # no coordinate holds this combination of blocks
                line.append(_Cell("", "#ffffff"))
            elif not used:
                line.append(_Cell(f"all {len(coords)}", REPLICATED))
            else:
                text = _coord_label(coords[0], used)
                if n_copies > 1:
                    text += f" ×{n_copies}"
                line.append(_Cell(text, coordinate_color(coords[0], sizes)))
        cells.append(line)

    title = (
        f"{value.global_shape} {str(value.dtype).removeprefix('torch.')} "
        f"{value.spec.trimmed()} on {format_mesh(sizes)}, local block {local}"
    )
    notes = []
    if replicated and used:
        notes.append(
            f"replicated over {', '.join(replicated)}: ×{n_copies} is the copies of a block; "
            f"its colour is that of the copy at {', '.join(f'{a}=0' for a in replicated)}"
        )
    elif not used:
        notes.append(f"replicated: every one of the {n_copies} coordinates holds all of it")
    empty = [
        _coord_label(c, used)
        for c in _coordinates({a: sizes[a] for a in used})
        if any(s.stop == s.start for s in layout.owned({**dict.fromkeys(names, 0), **c})[0])
    ]
    if empty:
        shown = ", ".join(empty) if len(empty) <= 8 else ", ".join([*empty[:4], "…", *empty[-2:]])
        count = f"{len(empty)} coordinates, " if len(empty) > 8 else ""
        notes.append(f"only padding on {shown} ({count}a block of {local} zeros)")
    return _Grid(title, "dim 0" if ndim >= 2 else "", rows, cols, cells, notes)


# --------------------------------------------------------------------------- rich


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    """``[(dotted key path, leaf)]`` in the tree's own order (dicts in insertion order, as a
    module's ``named_parameters``), with ``Sharded`` values as leaves."""
    # A namespace of our own: the ordering is set for it alone, and Sharded is a leaf in it.
    with optree.dict_insertion_ordered(True, namespace=_ORDERED):
        paths, leaves, _ = optree.tree_flatten_with_path(
            tree, none_is_leaf=True, namespace=_ORDERED
        )
    return [(".".join(str(k) for k in p), v) for p, v in zip(paths, leaves)]


def _sharded_leaves(tree: Any, fn: str) -> list[tuple[str, Sharded]]:
    found = [(p, v) for p, v in _leaves(tree) if isinstance(v, Sharded)]
    if not found:
        raise TypeError(
            f"ff.{fn} takes a Sharded value or a pytree holding some, got "
            f"{type(tree).__name__} with no Sharded leaves; shard it first, e.g. "
            f"ff.{fn}(ff.shard(tensor, mesh, ff.P('dp')))."
        )
    return found


def _background(color: str, standard: bool) -> str:
    """The cell style of a coordinate's colour, for a 16-colour terminal when ``standard``."""
    return f"black on {_TO_16.get(color, color) if standard else color}"


def _table(grid: _Grid, path: str, standard: bool = False, width: int | None = None) -> Any:
    """The grid as rich renderables: a title line, the table, then the notes (full width).

    When the table is wider than ``width``, the blocks are listed one per line instead, so
    that no cell's label is cut.
    """
    from rich.table import Table
    from rich.text import Text

    title = Text()
    if path:
        title.append(path, style="bold").append(" ")
    title.append(grid.title)
    table = Table(show_header=any(grid.cols), show_lines=True)
    table.add_column(grid.corner, no_wrap=True)
    for col in grid.cols:
        table.add_column(col, justify="center", no_wrap=True)
    for header, line in zip(grid.rows, grid.cells):
        row: list[Any] = [header]
        for cell in line:
            row.append(
                "…" if cell is None else Text(f" {cell.text} ", _background(cell.color, standard))
            )
        table.add_row(*row)
    notes = [Text(n, style="dim") for n in grid.notes]
    if width is None or _natural_width(None, table) <= width:
        return [title, table, *notes]
    one_row = not any(grid.rows)  # a 1-D value: its blocks are the columns
    blocks = []
    for header, line in zip(grid.rows, grid.cells):
        for col, cell in zip(grid.cols if any(grid.cols) else [""] * len(line), line):
            where = " ".join(
                h for h in (header, col if not one_row else f"{grid.corner} {col}".strip()) if h
            )
            blocks.append((where or "every element", cell))
    pad = max(len(w) for w, _ in blocks)
    listed: list[Any] = [title]
    for where, cell in blocks:
        text = Text(f"  {where:<{pad}}  ")
        if cell is None:
            text.append("…")
        else:
            text.append(f" {cell.text} ", _background(cell.color, standard))
        listed.append(text)
    return [*listed, *notes]


def _legend(sizes: Mapping[str, int], standard: bool = False) -> Any:
    from rich.text import Text

    legend = Text("colours: ")
    for coord in _coordinates(sizes):
        legend.append(
            f" {_coord_label(coord, list(sizes))} ",
            style=_background(coordinate_color(coord, sizes), standard),
        )
        legend.append(" ")
    return legend


def _console(console: Any) -> tuple[Any, bool]:
    """``console``, or a new default one; and whether it is new (then it may be widened).

    A new console is as wide as rich makes it, the same width the planner's command line
    uses: the terminal's, else ``COLUMNS``, else 80 (a pipe, a file); in Jupyter it widens
    to fit (see :func:`_print`)."""
    if console is not None:
        return console, False
    from rich.console import Console

    return Console(), True


def _colour(console: Any) -> tuple[bool, bool]:
    """Whether ``console`` shows colour at all, and whether it has only 16 colours."""
    system = console.color_system
    shown = system is not None and not console.no_color
    return shown, system in ("standard", "windows")


def _natural_width(console: Any, renderable: Any) -> int:
    """The width ``renderable`` takes with nothing wrapped (on ``console``, or a plain one)."""
    from rich.console import Console
    from rich.measure import Measurement

    if console is None:
        console = Console(width=100_000, color_system=None, file=io.StringIO())
    options = console.options.update(max_width=100_000)
    return Measurement.get(console, options, renderable).maximum


def _print(renderable: Any, console: Any, widen: bool) -> None:
    """Print on ``console``. A default console (``widen``) is widened to fit in Jupyter (its
    HTML output scrolls); a terminal or a pipe keeps rich's width, as the planner does."""
    if widen and console.is_jupyter:
        console.width = max(console.width, _natural_width(console, renderable))
    console.print(renderable)


def visualize(tree: Any, *, console: Any = None, legend: bool = True) -> None:
    """Draw which mesh coordinate owns which block of every ``Sharded`` value in ``tree``.

    Like JAX's ``visualize_array_sharding``. ``tree`` is one ``Sharded`` value or any
    pytree of them (other leaves are skipped); each value gets a grid titled with its key
    path: rows are blocks of dim 0, columns blocks of the other dims (a 1-D value is one
    row). A cell names the coordinate over the axes the spec uses and is coloured by it,
    the same colour for the same coordinate in every value (see :func:`coordinate_color`);
    ``×k`` marks a block replicated over the other axes. Headers give each block's global
    range and its padding (``+1 pad``), and a note names coordinates holding only padding.
    More than 16 blocks along a dim show as the first and last 8.

    Args:
        tree: a ``Sharded`` value or a pytree holding some.
        console: a ``rich`` console to print on (default: a new one as wide as the
            terminal, ``COLUMNS``, or 80 through a pipe, as the planner's command line;
            HTML in Jupyter).
        legend: print the colour of every mesh coordinate first (for up to 64 coordinates,
            on a console that shows colour).

    Raises:
        TypeError: if ``tree`` holds no ``Sharded`` value.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from rich.console import Console
        >>> with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ...     w = ff.shard(torch.zeros(5, 4), mesh, ff.P("dp", "tp"))
        ...     ff.visualize({"w": w}, console=Console(width=70, color_system=None), legend=False)
        w (5, 4) float32 P('dp', 'tp') on Mesh(dp=2, tp=2), local block (3, 2)
        ┏━━━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━┓
        ┃ dim 0        ┃   [0:2]   ┃   [2:4]   ┃
        ┡━━━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━┩
        │ [0:3]        │  dp0,tp0  │  dp0,tp1  │
        ├──────────────┼───────────┼───────────┤
        │ [3:5] +1 pad │  dp1,tp0  │  dp1,tp1  │
        └──────────────┴───────────┴───────────┘
    """
    from rich.console import Group

    leaves = _sharded_leaves(tree, "visualize")
    console, new = _console(console)
    shown, standard = _colour(console)
    parts: list[Any] = []
    if legend and shown:  # without colour, the labels in the cells say it all
        meshes = {tuple(axis_sizes(v.mesh).items()): None for _, v in leaves}
        parts += [_legend(dict(m), standard) for m in meshes if math.prod(s for _, s in m) <= 64]
    # A default console in Jupyter widens to fit; a terminal or a pipe keeps its width.
    width = None if new and console.is_jupyter else console.width
    for path, value in leaves:
        parts += _table(_grid(value), path, standard, width)
    _print(Group(*parts), console, new)


def to_html(value: Sharded) -> str:
    """``value``'s layout as a small HTML table (what ``Sharded._repr_html_`` shows).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = ff.shard(torch.zeros(3), mesh, ff.P("dp"))
        >>> "<table" in to_html(w) and "dp1" in to_html(w)
        True
    """
    grid = _grid(value)
    esc = html.escape
    cell_style = "border:1px solid #888;padding:2px 8px;text-align:center;"
    head_style = "border:1px solid #888;padding:2px 8px;font-weight:normal;"
    out = [
        '<div class="functional-fsdp-sharded">',
        f"<div><b>Sharded</b> {esc(grid.title)}</div>",
        '<table style="border-collapse:collapse;margin:4px 0;font-family:monospace;">',
    ]
    if any(grid.cols):
        out.append(f'<tr><th style="{head_style}">{esc(grid.corner)}</th>')
        out += [f'<th style="{head_style}">{esc(c)}</th>' for c in grid.cols]
        out.append("</tr>")
    for header, line in zip(grid.rows, grid.cells):
        out.append(f'<tr><th style="{head_style}">{esc(header)}</th>')
        for cell in line:
            if cell is None:
                out.append(f'<td style="{cell_style}">…</td>')
            else:
                style = f"{cell_style}background:{cell.color};color:#000;"
                out.append(f'<td style="{style}">{esc(cell.text)}</td>')
        out.append("</tr>")
    out.append("</table>")
    out += [f"<div><small>{esc(n)}</small></div>" for n in grid.notes]
    out.append("</div>")
    return "".join(out)


def describe(tree: Any, *, console: Any = None) -> None:
    """Print a table of every ``Sharded`` value in ``tree``: path, global shape, spec, local
    block, dtype, local bytes per rank and padding.

    Rows keep the tree's order (a module's parameter dict stays in module order) and the
    full key paths, never broken: on a console too narrow for the table, each path gets a
    line of its own with its figures on the next.

    Args:
        tree: a pytree of ``Sharded`` values (other leaves are skipped).
        console: a ``rich`` console to print on (default: a new one as wide as the
            terminal, ``COLUMNS``, or 80 through a pipe, as the planner's command line;
            HTML in Jupyter).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from rich.console import Console
        >>> with ff.simulated_mesh({"dp": 4}) as mesh:
        ...     params = ff.shard({"w": torch.zeros(10, 3), "b": torch.zeros(3)}, mesh, ff.P("dp"))
        ...     ff.describe(params, console=Console(width=90, color_system=None))
        ... # doctest: +NORMALIZE_WHITESPACE
                                    Sharded values
        ┏━━━━━━┳━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━┳━━━━━━━━━┓
        ┃ path ┃ shape   ┃ spec    ┃ local block ┃ dtype   ┃ bytes ┃ padding ┃
        ┡━━━━━━╇━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━╇━━━━━━━━━┩
        │ w    │ (10, 3) │ P('dp') │ (3, 3)      │ float32 │    36 │     17% │
        │ b    │ (3,)    │ P('dp') │ (1,)        │ float32 │     4 │     25% │
        └──────┴─────────┴─────────┴─────────────┴─────────┴───────┴─────────┘
                      local 40 bytes per rank of 132 in total
    """
    from rich.table import Table
    from rich.text import Text

    columns = ("shape", "spec", "local block", "dtype", "bytes", "padding")
    rows = [(p or "<root>", v) for p, v in _leaves(tree) if isinstance(v, Sharded)]
    table = Table(title="Sharded values")
    table.add_column("path", no_wrap=True)  # a path is never broken
    for col in columns:
        justify = "right" if col in ("bytes", "padding") else "left"
        table.add_column(col, justify=justify, overflow="fold")
    cells = []
    total_local = total_global = 0
    for path, v in rows:
        local_numel = math.prod(v.layout.local_shape)
        n_ranks = math.prod(axis_sizes(v.mesh)[a] for a in v.spec.axes)
        padding = 1 - v.numel() / (local_numel * n_ranks) if local_numel else 0.0
        nbytes = local_numel * v.dtype.itemsize
        total_local += nbytes
        total_global += v.numel() * v.dtype.itemsize
        cells.append(
            (
                path,
                str(v.global_shape),
                str(v.spec.trimmed()),
                str(v.layout.local_shape),
                str(v.dtype).removeprefix("torch."),
                f"{nbytes:,}",
                f"{padding:.0%}",
            )
        )
        table.add_row(*cells[-1])
    caption = f"local {total_local:,} bytes per rank of {total_global:,} in total"
    table.caption = caption
    console, new = _console(console)
    widened = new and console.is_jupyter  # fits by construction
    if widened or _natural_width(console, table) <= console.width:
        _print(table, console, new)
        return
    # Too narrow for the paths and the figures side by side: each path on a line of its own,
    # its figures on the next, so that no path is broken or cut.
    lines: list[Any] = [Text("Sharded values", style="bold")]
    for path, shape, spec, local, dtype, nbytes, padding in cells:
        lines.append(Text(path, no_wrap=True, overflow="ignore"))
        lines.append(
            Text(f"    {shape} {spec}  local {local} {dtype}  {nbytes} bytes  padding {padding}")
        )
    lines.append(Text(caption, style="dim"))
    from rich.console import Group

    _print(Group(*lines), console, False)


provide("_repr_html_", to_html)  # Sharded._repr_html_
