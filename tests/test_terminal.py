"""Terminal output at 80 columns: ``ff.describe`` never breaks a parameter path, and
``ff.visualize`` stays legible in 16 colours and with colour off (the labels carry the
information; colour only helps). Behaviour, not escape codes: the text is read back, and the
colours are rich's own styles as a 16-colour terminal would show them."""

from __future__ import annotations

import io
import itertools
import re

import pytest
import torch
from rich.color import ColorSystem
from rich.console import Console

import functional_fsdp as ff

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_params():
    """The parameter names and shards of a peft LoRA Llama: long dotted paths."""
    from ._trainable_workers import lora_llama

    model, _ = lora_llama()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        return ff.fsdp(model, mesh).shard()  # describe reads only the layouts


def _text(fn, tree, width: int, **console) -> str:
    out = io.StringIO()
    fn(tree, console=Console(width=width, file=out, **console))
    return out.getvalue()


def test_describe_never_breaks_a_path_at_80_columns(lora_params):
    text = _text(ff.describe, lora_params, 80, color_system=None)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    for name, value in lora_params.items():
        # The whole path on one line, and its figures right after it.
        (i,) = [
            i for i, line in enumerate(lines) if re.search(rf"(^|\s){re.escape(name)}(\s|$)", line)
        ]
        figures = lines[i] + lines[i + 1]
        assert str(value.global_shape) in figures and str(value.layout.local_shape) in figures
    # Wide enough, the same figures are one table row per parameter.
    wide = _text(ff.describe, lora_params, 200, color_system=None)
    for name, value in lora_params.items():
        (row,) = [line for line in wide.splitlines() if f" {name} " in line]
        assert str(value.global_shape) in row and str(value.layout.local_shape) in row


@pytest.mark.parametrize("columns", ["80", None, "200"])
def test_describe_and_visualize_through_a_pipe_take_the_planners_width(
    lora_params, monkeypatch, capsys, columns
):
    # A default console through a pipe is as wide as the planner's command line makes its
    # tables: COLUMNS, else 80 (rich's width), never widened to fit the table.
    from functional_fsdp.planner._render import terminal_width

    for key in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE", "JUPYTER_COLUMNS"):
        monkeypatch.delenv(key, raising=False)
    if columns is not None:
        monkeypatch.setenv("COLUMNS", columns)
    width = terminal_width()
    assert width == int(columns or 80)
    ff.describe(lora_params)
    described = capsys.readouterr().out
    some = dict(itertools.islice(lora_params.items(), 3))
    ff.visualize(some)
    pictures = capsys.readouterr().out
    for text in (described, pictures):
        assert max(map(len, text.splitlines())) <= width
        assert "…" not in text and "\x1b[" not in text
    rows = [line for line in described.splitlines() if line.startswith("│")]
    if width == 80:  # too narrow for the table: each path whole on a line of its own
        assert not rows and all(name in described.splitlines() for name in lora_params)
    else:  # a table row per parameter, as wide as it needs
        assert len(rows) == len(lora_params)
        assert max(map(len, described.splitlines())) > 80


def _labels_and_backgrounds(tree, color_system: str) -> dict[str, set[int | None]]:
    """Each cell label of ``ff.visualize``'s grids, and the background colours (as numbers
    of a terminal with that colour system) it was drawn in."""
    console = Console(width=80, file=io.StringIO(), color_system=color_system, force_terminal=True)
    seen: dict[str, set[int | None]] = {}

    original = console.print

    def capture(renderable, *args, **kwargs):
        for segment in console.render(renderable, console.options):
            label = segment.text.strip()
            if re.fullmatch(r"(dp\d+,?)+(tp\d+)?( ×\d+)?|(dp|tp)\d+(,tp\d+)?", label):
                bg = segment.style.bgcolor if segment.style else None
                system = (
                    ColorSystem.STANDARD if color_system == "standard" else ColorSystem.TRUECOLOR
                )
                number = bg.downgrade(system).number if bg is not None else None
                seen.setdefault(label, set()).add(number)
        original(renderable, *args, **kwargs)

    console.print = capture  # type: ignore[method-assign]
    ff.visualize(tree, console=console, legend=False)
    return seen


def test_visualize_in_16_colours_gives_each_coordinate_its_own_colour():
    with ff.simulated_mesh({"dp": 4, "tp": 2}) as mesh:
        w = ff.shard(torch.zeros(8, 6), mesh, ff.P("dp", "tp"))
        seen = _labels_and_backgrounds(w, "standard")
        column = _labels_and_backgrounds(
            ff.shard(torch.zeros(16), mesh, ff.P(("dp", "tp"))), "standard"
        )
    assert len(seen) == 8
    assert all(len(colours) == 1 and None not in colours for colours in seen.values())
    assert len({c for colours in seen.values() for c in colours}) == 8, seen
    # A column of 8 blocks: neighbours never share a colour.
    order = [f"dp{d},tp{t}" for d in range(4) for t in range(2)]
    colours = [next(iter(column[label])) for label in order]
    assert all(a != b for a, b in itertools.pairwise(colours)), colours


def test_visualize_with_colour_off_says_everything_in_words(monkeypatch, capsys):
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        w = ff.shard(torch.zeros(5, 40), mesh, ff.P("dp", "tp"))
        piped = _text(ff.visualize, w, 80, color_system=None)
        # With colour, a legend comes first.
        assert "colours:" in _text(
            ff.visualize, w, 80, color_system="standard", force_terminal=True
        )
        # NO_COLOR on a colour terminal: the default console, as a user gets it.
        monkeypatch.setenv("NO_COLOR", "1")
        monkeypatch.setenv("FORCE_COLOR", "1")
        monkeypatch.setenv("COLUMNS", "80")
        ff.visualize(w)
        no_color = capsys.readouterr().out
    for text in (piped, no_color):
        plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
        assert not re.search(r"\x1b\[[0-9;]*(4[0-7]|10[0-7]|48;)", text)  # no background colour
        assert "colours:" not in plain  # a colour legend means nothing without colour
        for label in ("dp0,tp0", "dp0,tp1", "dp1,tp0", "dp1,tp1"):
            assert label in plain
        assert "+1 pad" in plain
        assert max(map(len, plain.splitlines())) <= 80


# --------------------------------------------------------------------------- planner tables


@pytest.fixture(scope="module")
def comparison():
    """Every strategy of a small GPT on 1,024 ranks: long mesh names (replicate=128
    shard=8), the ZeRO paper's table, and a unit path in each report."""
    from functional_fsdp.models import GPT, GPTConfig, gpt_plan

    cfg = GPTConfig(n_layer=2, vocab_size=64, n_embd=64, n_head=8, block_size=16)
    with torch.device("meta"):
        model = GPT(cfg)
    return ff.compare_strategies(
        model,
        1024,
        batch=(1024, 16),
        tp_plan=gpt_plan(cfg, loss_parallel=False),
        tp=8,
        hsdp_shard=8,
        mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16),
        optimizer="adam",
    )


def _whole(word: str, text: str) -> bool:
    return re.search(rf"(^|\s){re.escape(word)}(\s|$)", text, re.M) is not None


def test_plan_tables_take_the_terminal_width_and_never_break_a_name(comparison, monkeypatch):
    from functional_fsdp.planner._render import short

    monkeypatch.setenv("COLUMNS", "80")  # not a terminal here: rich reads COLUMNS
    texts = {"cmp": str(comparison), "gib": comparison.summary(gib=0.0005)}
    texts |= {r.name: str(r) for r in comparison.reports}
    for text in texts.values():
        assert max(map(len, text.splitlines())) <= 80, text
        assert "…" not in text and "\x1b[" not in text  # nothing cut short, no colour
    table = texts["gib"].split("at rest per device")[0].splitlines()
    for r in comparison.reports:
        # A row per strategy: its whole name, each mesh axis whole, its figures, and
        # whether it fits in words.
        (i,) = [i for i, line in enumerate(table) if line.split()[:1] == [r.name]]
        row = table[i]
        assert [short(r.peak_bytes), short(r.comm_bytes())] == row.split()[-3:-1]
        assert row.split()[-1] == ("yes" if r.fits(0.0005) else "no")
        for axis, size in r.mesh.items():
            assert _whole(f"{axis}={size}", table[i] + "\n" + table[i + 1])
        text = texts[r.name]
        assert _whole(f"({r.largest_unit or '<root>'})", text) and _whole(r.name + ":", text)
    # Wider terminals get wider tables: one line per strategy, mesh included.
    monkeypatch.setenv("COLUMNS", "200")
    wide = str(comparison).splitlines()
    (row,) = [line for line in wide if line.split()[:1] == ["hsdp"]]
    assert "replicate=128 shard=8" in row


def test_plan_tables_in_16_colours_say_what_they_say_without_colour(comparison, monkeypatch):
    from functional_fsdp.planner._render import to_text

    monkeypatch.delenv("NO_COLOR", raising=False)
    out = io.StringIO()
    Console(width=80, file=out, color_system="standard", force_terminal=True).print(comparison)
    coloured = out.getvalue()
    assert not re.search(r"\x1b\[[0-9;]*(4[0-7]|10[0-7]|48;)", coloured)  # no background
    plain = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    assert [line.rstrip() for line in plain.splitlines()] == [
        line.rstrip() for line in to_text(comparison, width=80).splitlines()
    ]
    # NO_COLOR on a colour terminal, as a user gets it: the same words, no escape codes.
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    Console(width=80, file=out, force_terminal=True).print(comparison["hsdp"])
    assert not re.search(r"\x1b\[[0-9;]*3[0-7]m", out.getvalue())
    assert "replicate" in out.getvalue() and "peak estimate" in out.getvalue()
