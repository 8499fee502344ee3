"""Pictures: ``visualize``, ``describe``, ``Sharded._repr_html_`` and the plot helpers.

Every cell of a layout picture is checked against the data: the coordinate it names holds
exactly that slice of the global tensor (and zeros for the padding it shows), on a simulated
mesh and on real gloo processes. Colours are checked for consistency across values and
against the legend; ``describe`` against ``named_parameters`` order; plots against the
figures they draw (the planner's, and what a run measured), read back from the Axes.
"""

from __future__ import annotations

import ast
import html.parser
import io
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

import functional_fsdp as ff
from functional_fsdp.display import PALETTE, coordinate_color
from functional_fsdp.models import GPT, GPTConfig, lm_loss
from functional_fsdp.planner._render import PARTS, parts
from functional_fsdp.spec import format_mesh

from . import _display_workers as W
from ._hf import tiny_llama_config

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RANGE = re.compile(r"\[([\d:, ]+)\](?: \+([\d,]+) pad)?")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# --------------------------------------------------------------------------- helpers


def render(fn, *args, width: int = 200, colors: bool = False, **kwargs) -> Console:
    console = Console(
        file=io.StringIO(),
        width=width,
        color_system="truecolor" if colors else None,
        record=True,
    )
    fn(*args, console=console, **kwargs)
    return console


def text_of(fn, *args, **kwargs) -> str:
    return render(fn, *args, **kwargs).export_text()


def parse_range(header: str) -> tuple[tuple[int, int, int], ...]:
    """``[3:5, 0:2] +1,0 pad`` -> ``((3, 5, 1), (0, 2, 0))``; ``()`` for an empty header."""
    m = RANGE.fullmatch(header.strip())
    if not m:
        return ()
    spans = [tuple(int(i) for i in r.split(":")) for r in m[1].split(", ")]
    pads = [int(p) for p in m[2].split(",")] if m[2] else [0] * len(spans)
    return tuple((a, b, p) for (a, b), p in zip(spans, pads))


def parse_grid(text: str) -> dict[tuple, str]:
    """``{(row ranges, column ranges): cell text}`` of one value's table (ranges per dim as
    ``(start, stop, pad)``; a 1-D value's row has none)."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    cols = [c.strip() for c in header.strip("┃").split("┃")][1:]
    out = {}
    for line in lines:
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        for col, cell in zip(cols, cells[1:]):
            out[(parse_range(cells[0]), parse_range(col))] = cell
    return out


def coords_of(label: str, sizes: dict[str, int]) -> list[dict[str, int]]:
    """Every mesh coordinate a cell label stands for (``dp1 ×2``: dp=1 and any other axis)."""
    named = dict((m[1], int(m[2])) for m in re.finditer(r"([a-z]+)(\d+)", label.split(" ")[0]))
    out = [{}]
    for axis, size in sizes.items():
        values = [named[axis]] if axis in named else range(size)
        out = [{**c, axis: v} for c in out for v in values]
    return out


def rank_of(coord: dict[str, int], sizes: dict[str, int]) -> int:
    rank = 0
    for axis, size in sizes.items():
        rank = rank * size + coord[axis]
    return rank


def check_cells(text: str, full: torch.Tensor, locals_: list[torch.Tensor], sizes: dict) -> None:
    """Each cell's coordinates hold exactly its slice of ``full`` (padded with zeros as the
    header says), and every rank is named by a cell or by the padding note."""
    grid = parse_grid(text)
    assert grid, text
    seen = set()
    for (row, col), label in grid.items():
        ranges = [*row, *col]
        assert len(ranges) == full.ndim, (row, col)
        if label.startswith("all"):
            coords = coords_of("", sizes)
        else:
            coords = coords_of(label, sizes)
            copies = re.search(r"×(\d+)", label)
            assert len(coords) == (int(copies[1]) if copies else 1), (label, text)
        for coord in coords:
            local = locals_[rank_of(coord, sizes)]
            real = local[tuple(slice(0, b - a) for a, b, _ in ranges)]
            torch.testing.assert_close(real, full[tuple(slice(a, b) for a, b, _ in ranges)])
            for dim, (a, b, pad) in enumerate(ranges):
                assert local.shape[dim] - (b - a) == pad, (label, dim, text)
                assert not local.narrow(dim, b - a, pad).any()
            seen.add(rank_of(coord, sizes))
    note = re.search(r"only padding on (.*) \((?:\d+ coordinates, )?a block", text)
    if note:
        for label in note[1].split(", "):
            for coord in coords_of(label, sizes):
                assert not locals_[rank_of(coord, sizes)].any()
                seen.add(rank_of(coord, sizes))
    assert seen == set(range(len(locals_))), (seen, text)


def colours(console: Console) -> list[tuple[str, str]]:
    """``[(cell text, background colour)]`` in the order printed."""
    exported = console.export_html(inline_styles=True)
    return [
        (m[2].strip(), m[1])
        for m in re.finditer(r'background-color: (#[0-9a-f]{6})">([^<]*)</span>', exported)
    ]


class _HTMLTable(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[tuple[str, str, str]]] = []  # (tag, text, style)
        self._cell: list | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = [tag, "", dict(attrs).get("style", "")]

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1] += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(tuple(self._cell))
            self._cell = None


def html_grid(page: str) -> dict[tuple, tuple[str, str]]:
    """``{(row range, column range): (cell text, background)}`` of a ``_repr_html_`` table."""
    parser = _HTMLTable()
    parser.feed(page)
    header, *rows = parser.rows
    cols = [parse_range(text) for _, text, _ in header[1:]]
    out = {}
    for row in rows:
        for col, (_, text, style) in zip(cols, row[1:]):
            bg = re.search(r"background:(#[0-9a-f]{6})", style)
            out[(parse_range(row[0][1]), col)] = (text, bg[1] if bg else "")
    return out


CASES = [
    ((10, 3), ff.P(("tp", "dp")), {"dp": 4, "tp": 2}),  # hierarchical, uneven, padding only
    ((5, 4), ff.P("dp", "tp"), {"dp": 2, "tp": 2}),  # both dims split
    ((7,), ff.P("dp"), {"dp": 4, "tp": 2}),  # 1-D, replicated over tp
    ((3, 2, 4), ff.P(None, None, "dp"), {"dp": 2}),  # a split beyond dim 1
    ((2, 3), ff.P(), {"dp": 2, "tp": 2}),  # replicated everywhere
]


# --------------------------------------------------------------------------- visualize


@pytest.mark.parametrize(("shape", "spec", "axes"), CASES)
def test_visualize_cells_match_the_blocks_ranks_hold(shape, spec, axes):
    full = W.full(shape)
    with ff.simulated_mesh(axes) as mesh:
        x = ff.shard(full, mesh, spec)
        text = text_of(ff.visualize, x, legend=False)
        locals_ = [t.clone() for t in ff.rank_values(x.local)]
    if len(locals_) == 1:  # the same on every rank
        locals_ = locals_ * len(list(coords_of("", axes)))
    check_cells(text, full, locals_, axes)
    assert f"{spec.trimmed()} on {format_mesh(axes)}" in text


def test_visualize_a_tree_one_block_per_leaf_in_tree_order_with_consistent_colours():
    axes = {"dp": 2, "tp": 2}
    with ff.simulated_mesh(axes) as mesh:
        tree = {
            "z": ff.shard(torch.ones(4, 4), mesh, ff.P("dp", "tp")),
            "a": [
                ff.shard(torch.ones(8), mesh, ff.P(("tp", "dp"))),
                ff.shard(torch.ones(6, 2), mesh, ff.P("dp")),
            ],
            "not sharded": torch.ones(3),
        }
        console = render(ff.visualize, tree, colors=True)
    text = console.export_text(clear=False)
    titles = [line.split(" ")[0] for line in text.splitlines() if "local block" in line]
    assert titles == ["z", "a.0", "a.1"]
    by_label: dict[str, set[str]] = {}
    for label, colour in colours(console):
        by_label.setdefault(label.split(" ")[0], set()).add(colour)
    coords = [f"dp{d},tp{t}" for d in range(2) for t in range(2)]
    for i, label in enumerate(coords):  # legend, both 2-D and 1-D values: one colour each
        assert by_label[label] == {PALETTE[i]}, label
    # a block replicated over tp takes the colour of its copy at tp=0
    assert by_label["dp1"] == {coordinate_color({"dp": 1, "tp": 0}, axes)}
    assert len({c for label in coords for c in by_label[label]}) == 4


def test_visualize_elides_long_rows_and_needs_a_sharded_value():
    with ff.simulated_mesh({"dp": 18}) as mesh:
        text = text_of(ff.visualize, ff.shard(torch.ones(36), mesh, ff.P("dp")), legend=False)
        tiny = text_of(ff.visualize, ff.shard(torch.ones(3), mesh, ff.P("dp")), legend=False)
    assert "only padding on dp3, dp4, dp5, dp6, …, dp16, dp17 (15 coordinates, a block" in tiny
    grid = parse_grid(text)
    assert len(grid) == 17 and "…" in text  # 8 first, an ellipsis, 8 last
    assert grid[((), ((34, 36, 0),))] == "dp17" and grid[((), ((14, 16, 0),))] == "dp7"
    with pytest.raises(TypeError, match=r"ff.visualize takes a Sharded value or a pytree holding"):
        ff.visualize({"w": torch.ones(2)})


# --------------------------------------------------------------------------- _repr_html_


@pytest.mark.parametrize(("shape", "spec", "axes"), CASES[:3])
def test_repr_html_is_the_visualized_layout_and_needs_no_process_group(shape, spec, axes):
    with ff.simulated_mesh(axes) as mesh:
        x = ff.shard(W.full(shape), mesh, spec)
        text = text_of(ff.visualize, x, legend=False)
    assert not dist.is_initialized()
    page = x._repr_html_()  # after the mesh is gone: the layout alone
    assert page.startswith("<div") and f"{shape}" in page
    cells = html_grid(page)
    assert {k: t for k, (t, _) in cells.items()} == parse_grid(text)
    for text_label, colour in cells.values():
        coord = coords_of(text_label, axes)[0]
        assert colour == coordinate_color(coord, axes)


# --------------------------------------------------------------------------- describe


def first_column(text: str) -> list[str]:
    return [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]


def test_describe_keeps_module_order_and_full_paths():
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 3) for _ in range(12)))
    names = [n for n, _ in model.named_parameters()]
    with ff.simulated_mesh({"dp": 2}) as mesh:
        params = ff.fsdp(model, mesh).shard()
        wide = text_of(ff.describe, params, width=200)
        narrow = text_of(ff.describe, params, width=60)
        nested = text_of(ff.describe, {"b": params["0.bias"], "a": [params["0.weight"]]})
    assert first_column(wide) == names  # 10.weight after 9.bias, not after 1.bias
    # Too narrow for the table: each path whole on a line of its own, in module order.
    assert (
        "…" not in narrow
        and [x.strip() for x in narrow.splitlines() if x.strip() in names] == names
    )
    assert first_column(nested) == ["b", "a.0"]


def test_describe_default_console_widens_rather_than_cuts(capsys):
    with ff.simulated_mesh({"dp": 2}) as mesh:
        long = "encoder.layers.11.self_attention.query_key_value.weight_of_a_long_name"
        ff.describe({long: ff.shard(torch.ones(4, 3), mesh, ff.P("dp"))})
    out = capsys.readouterr().out
    assert long in out and "…" not in out


def test_describe_and_visualize_a_transformers_llama():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    names = [n for n, _ in model.named_parameters()]
    with ff.simulated_mesh({"dp": 2}) as mesh:
        params = ff.fsdp(model, mesh).shard()
        described = text_of(ff.describe, params)
        pictures = text_of(ff.visualize, params)
    assert first_column(described) == names
    assert "model.layers.1.self_attn.q_proj.weight" in names
    titles = [line.split(" ")[0] for line in pictures.splitlines() if "local block" in line]
    assert titles == names


# --------------------------------------------------------------------------- real processes


@pytest.mark.multiprocess
def test_gloo_pictures_match_the_blocks_each_rank_holds_and_the_simulation(pools):
    results = pools.run(2, W.pictures)
    axes = {"dp": 2}
    with ff.simulated_mesh(axes) as mesh:
        tree = {k: ff.shard(W.full(s), mesh, spec) for k, (s, spec) in W.VALUES.items()}
        simulated = {
            "visualize": {k: W.render(ff.visualize, v, legend=False) for k, v in tree.items()},
            "tree": W.render(ff.visualize, tree),
            "describe": W.render(ff.describe, tree),
            "html": {k: v._repr_html_() for k, v in tree.items()},
        }
    for rank_result in results:
        for key in ("visualize", "tree", "describe", "html"):
            assert rank_result[key] == simulated[key], key
    for name, (shape, _) in W.VALUES.items():
        locals_ = [r["local"][name] for r in results]  # each rank's real block
        check_cells(results[0]["visualize"][name], W.full(shape), locals_, axes)
    assert first_column(results[0]["describe"]) == list(W.VALUES)


@pytest.mark.multiprocess
def test_gloo_measured_comms_plot_next_to_the_plan(pools):
    batch = torch.randint(0, W.GPT_CFG.vocab_size, (4, 9), generator=torch.Generator())
    measured = pools.run(2, W.gpt_comms, batch)[0]
    with torch.device("meta"):
        model = GPT(W.GPT_CFG)
    report = ff.plan(
        model, {"dp": 2}, batch=(4, 8), optimizer=ff.adamw(1e-3, weight_decay=0.01), name="zero3"
    )
    ax = ff.plot_comms(report, measured={"zero3": measured})
    planned = {c.get_label(): c for c in ax.containers if not c.get_label().startswith("_")}
    done = {
        c.get_label()[len("_measured ") :]: c for c in ax.containers if c not in planned.values()
    }
    assert set(planned) == {f"{k} over {a}" for k, a in measured}
    for (kind, axis), (_, nbytes) in measured.items():
        label = f"{kind} over {axis}"
        assert done[label].patches[0].get_height() == pytest.approx(nbytes / 1024)  # KiB
        assert planned[label].patches[0].get_height() == pytest.approx(nbytes / 1024)


# --------------------------------------------------------------------------- plots


def test_plot_losses_overlays_runs_with_their_values():
    with ff.simulated_mesh({"dp": 2}) as mesh:
        per_rank = ff.all_reduce(
            ff.shard(torch.tensor([1.0, 2.0]), mesh, ff.P("dp")).local, mesh, "dp"
        )
        runs = {"simulated": [per_rank, 2.0], "gloo": [torch.tensor(3.0), 2.0]}
        ax = ff.plot_losses(runs, title="t")
    lines = {line.get_label(): line for line in ax.lines}
    assert lines["simulated"].get_ydata().tolist() == [3.0, 2.0]
    assert lines["gloo"].get_xdata().tolist() == [1, 2]
    assert lines["simulated"].get_linestyle() != lines["gloo"].get_linestyle()
    assert ax.get_title() == "t" and [t.get_text() for t in ax.get_legend().texts] == list(runs)
    with pytest.raises(TypeError, match=r"ff.plot_losses takes \{run name: losses\}"):
        ff.plot_losses([1.0, 2.0])


def test_plot_memory_bars_are_the_reports_parts_and_the_measured_ones():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 63))
    cmp = ff.compare_strategies(model, 4, strategies=("ddp", "zero2", "zero3"))
    measured = {"zero3": {"params": 4000, "gathered": 17000}}
    _, ax = plt.subplots()
    assert ff.plot_memory(cmp, measured=measured, gib=0.0001, ax=ax) is ax
    bars = {c.get_label(): c for c in ax.containers}
    assert ax.get_ylabel() == "KiB per device"
    for part in PARTS:
        heights = [p.get_height() for p in bars[part].patches]
        assert heights == pytest.approx([parts(r)[part] / 1024 for r in cmp.reports])
        mheights = [p.get_height() for p in bars[f"_measured {part}"].patches]
        assert mheights == pytest.approx([0, 0, measured["zero3"].get(part, 0) / 1024])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ddp", "zero2", "zero3"]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(0.0001 * 1024**3 / 1024)
    by_name = ff.plot_memory({"mine": cmp["zero3"]})
    assert [t.get_text() for t in by_name.get_xticklabels()] == ["mine"]
    with pytest.raises(TypeError, match=r"ff.plot_memory takes what ff.plan or"):
        ff.plot_memory("zero3")
    with pytest.raises(ValueError, match=r"'zero4' names no report; the reports are"):
        ff.plot_memory(cmp, measured={"zero4": {}})
    with pytest.raises(ValueError, match=r"'zero3' has part 'weights'; the parts are"):
        ff.plot_memory(cmp, measured={"zero3": {"weights": 1}})


def test_comparison_plot_is_plot_memory_and_text_without_matplotlib(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 63))
    cmp = ff.compare_strategies(model, 4, strategies=("ddp", "zero3"))
    _, ax = plt.subplots()
    assert cmp.plot(0.0001, ax=ax) is ax
    ref = ff.plot_memory(cmp, gib=0.0001)
    for got, want in zip(ax.containers, ref.containers, strict=True):
        assert got.get_label() == want.get_label()
        assert [p.get_height() for p in got] == [p.get_height() for p in want]
    assert ax.get_ylabel() == ref.get_ylabel() and ax.get_title() == ref.get_title()
    assert ax.lines[0].get_ydata()[0] == ref.lines[0].get_ydata()[0]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cmp.plot(0.0001) == cmp.text_chart(0.0001)


def test_plot_comms_bars_are_the_reports_collectives_and_a_simulated_step():
    cfg = GPTConfig(n_layer=1, vocab_size=32, n_embd=16, n_head=2, block_size=8)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = torch.randint(0, cfg.vocab_size, (4, 9))
    with ff.simulated_mesh({"replicate": 2, "shard": 2}) as mesh:
        sharded_model = ff.fsdp(model, mesh)
        opt = ff.adamw(1e-3, weight_decay=0.01)
        step = ff.train_step(
            lambda p, b: lm_loss(sharded_model.apply(p, b[:, :-1]), b[:, 1:]),
            opt,
            model=sharded_model,
        )
        with ff.count_comms() as comms:
            step(ff.TrainState.create(sharded_model.shard(), opt), batch)
    report = ff.plan(model, {"replicate": 2, "shard": 2}, batch=(4, 8), optimizer=opt, name="hsdp")
    ax = ff.plot_comms([report], measured={"hsdp": comms})
    expected = report.by_kind_and_axis()
    assert expected == comms.by_kind_and_axis()
    labels = {c.get_label() for c in ax.containers}
    assert labels == {f"{k} over {a}" for k, a in expected} | {
        f"_measured {k} over {a}" for k, a in expected
    }
    for c in ax.containers:
        kind, axis = c.get_label().removeprefix("_measured ").split(" over ")
        assert c.patches[0].get_height() == pytest.approx(expected[(kind, axis)][1] / 1024)
    counts = [t.get_text() for t in ax.texts]
    assert counts == [str(sum(n for n, _ in expected.values()))] * 2


def test_plots_ask_for_the_notebooks_extra_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install 'functional_fsdp\[notebooks\]'"):
        ff.plot_losses({"a": [1.0]})


def test_no_module_of_the_library_imports_matplotlib_at_import_time():
    root = Path(ff.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in getattr(node, "names", [])]
            names += [getattr(node, "module", None) or ""]
            assert not any(n.split(".")[0] == "matplotlib" for n in names), path
