"""Look at layouts: which mesh coordinate owns which block, and a table of a parameter tree.

Pure functions of the layout (no communication). ``rich`` is imported lazily.
"""

from __future__ import annotations

import math
from typing import Any

import optree

from ._tree import keystr
from .dist.mesh import axis_names, axis_sizes
from .sharded import Sharded
from .spec import Layout, format_mesh


def block_owners(layout: Layout) -> dict[tuple[tuple[int, int], ...], list[dict[str, int]]]:
    """``{((start, stop) per dim): [mesh coordinates holding exactly that block]}``.

    Coordinates whose block is empty (all padding) are left out.

    Example:
        >>> from functional_fsdp import P
        >>> owners = block_owners(Layout.make((4,), P("dp"), {"dp": 2, "tp": 2}))
        >>> owners[((0, 2),)]
        [{'dp': 0, 'tp': 0}, {'dp': 0, 'tp': 1}]
    """
    names = [a for a, _ in layout.axis_sizes]
    sizes = [n for _, n in layout.axis_sizes]
    out: dict[tuple[tuple[int, int], ...], list[dict[str, int]]] = {}
    for flat in range(math.prod(sizes)):
        coord, rest = {}, flat
        for name, size in reversed(list(zip(names, sizes))):
            coord[name] = rest % size
            rest //= size
        coord = {n: coord[n] for n in names}
        slices, _ = layout.owned(coord)
        if any(s.stop == s.start for s in slices):
            continue
        out.setdefault(tuple((s.start, s.stop) for s in slices), []).append(coord)
    return out


def _coord_label(coord: dict[str, int], show: list[str]) -> str:
    return ",".join(f"{a}{coord[a]}" for a in show) or "all"


def visualize(value: Sharded, *, console: Any = None) -> None:
    """Print a grid of ``value``'s first two dims, each cell naming the coordinates that own it.

    Like JAX's ``visualize_array_sharding``: rows are blocks of dim 0, columns blocks of dim 1
    (a 1-D value is one row); a cell lists the mesh coordinates (over the axes the spec uses)
    holding that block, and its size.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ...     w = ff.shard(torch.zeros(6, 4), mesh, ff.P(("tp", "dp"), None))
        ...     ff.visualize(w)  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    layout = value.layout
    owners = block_owners(layout)
    used = [a for a in axis_names(value.mesh) if a in value.spec.axes]
    ndim = value.ndim
    rows = sorted({k[0] for k in owners}) if ndim >= 1 else [(0, 1)]
    cols = sorted({k[1] for k in owners}) if ndim >= 2 else [(0, 1)]
    replicated = [a for a in axis_names(value.mesh) if a not in used]
    title = f"{value.global_shape} {value.spec.trimmed()} on {format_mesh(axis_sizes(value.mesh))}"
    if replicated:
        title += f", replicated over {', '.join(replicated)}"
    table = Table(title=title, show_header=ndim >= 2, show_lines=True)
    table.add_column("dim 0" if ndim >= 1 else "")
    for c in cols:
        table.add_column(f"[{c[0]}:{c[1]}]" if ndim >= 2 else "", justify="center")
    for r in rows:
        cells = []
        for c in cols:
            key = [r, c][:ndim] if ndim >= 1 else []
            coords = [c for k, cs in owners.items() if list(k[:2]) == key for c in cs]
            cells.append(" ".join(dict.fromkeys(_coord_label(c, used) for c in coords)))
        table.add_row(f"[{r[0]}:{r[1]}]" if ndim >= 1 else "", *cells)
    (console or Console()).print(table)


def describe(tree: Any, *, console: Any = None) -> None:
    """Print a table of every ``Sharded`` value in ``tree``: path, shape, spec, local block,
    dtype, local bytes and padding.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 4}) as mesh:
        ...     params = ff.shard({"w": torch.zeros(10, 3)}, mesh, ff.P("dp"))
        ...     ff.describe(params)  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    table = Table(title="Sharded values")
    for col in ("path", "global shape", "spec", "local block", "dtype", "local bytes", "padding"):
        table.add_column(col, justify="right" if col in ("local bytes", "padding") else "left")
    total_local = total_global = 0
    for path, v in zip(paths, leaves):
        if not isinstance(v, Sharded):
            continue
        local_numel = math.prod(v.layout.local_shape)
        n_ranks = math.prod(axis_sizes(v.mesh)[a] for a in v.spec.axes)
        padding = 1 - v.numel() / (local_numel * n_ranks) if local_numel else 0.0
        nbytes = local_numel * v.dtype.itemsize
        total_local += nbytes
        total_global += v.numel() * v.dtype.itemsize
        table.add_row(
            keystr(path),
            str(v.global_shape),
            str(v.spec.trimmed()),
            str(v.layout.local_shape),
            str(v.dtype).removeprefix("torch."),
            f"{nbytes:,}",
            f"{padding:.0%}",
        )
    table.caption = f"local {total_local:,} bytes per rank of {total_global:,} in total"
    (console or Console()).print(table)
