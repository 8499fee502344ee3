"""docs/results.md is what ``python benchmarks/plot_results.py`` writes from the benchmarks'
JSON (``benchmarks/results/*.json``): its tables, their provenance and its plots."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


plot_results = _load("plot_results")
results = _load("_results")


def test_the_page_is_what_the_script_writes_from_the_json():
    text = plot_results.PAGE.read_text()
    blocks = plot_results.BLOCK.findall(text)
    assert sorted(blocks) == sorted(plot_results.PAGES), "a benchmark has no block on the page"
    assert plot_results.render_page(text) == text, (
        "docs/results.md differs from benchmarks/results/*.json: run "
        "python benchmarks/plot_results.py"
    )
    # The script rewrites a block whose table was edited by hand.
    edited = text.replace("| 1.000 (101.3 ms) |", "| 1.000 (99.9 ms) |")
    assert edited != text and plot_results.render_page(edited) == text


def test_every_run_says_where_its_figures_come_from():
    for path in sorted(plot_results.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        assert data["benchmark"] == path.stem and data["description"], path
        for run in data["runs"]:
            missing = {"key", "command", "commit", "date", "machine", "source", "figures"} - set(
                run
            )
            assert not missing, f"{path.name}: run {run.get('key')} lacks {missing}"
            assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", run["commit"]), run["commit"]
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]), run["date"]


def test_the_plots_are_drawn_and_every_image_the_docs_show_is_committed(tmp_path):
    pytest.importorskip("matplotlib")
    drawn = plot_results.draw(tmp_path, dpi=30)  # the committed ones: 110 dpi
    assert sorted(p.name for p in drawn) == sorted(f"{n}.png" for n in plot_results.PLOTS)
    for path in drawn:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2_000
        assert (plot_results.IMAGES / path.name).exists(), f"docs/images/{path.name} missing"
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for page in pages:
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text()):
            assert (page.parent / image).exists(), f"{page.name} shows {image}, which is missing"


def test_a_benchmark_records_its_run_with_command_commit_and_machine(tmp_path):
    path = results.record("demo", "width=64", {"ms": 1.5}, nproc=2, directory=tmp_path)
    results.record("demo", "width=8", {"ms": 0.5}, nproc=2, directory=tmp_path)
    results.record("demo", "width=64", {"ms": 1.25}, nproc=2, directory=tmp_path)
    runs = json.loads(path.read_text())["runs"]
    assert [(r["key"], r["figures"]) for r in runs] == [
        ("width=8", {"ms": 0.5}),
        ("width=64", {"ms": 1.25}),
    ]
    assert runs[0]["command"].startswith("torchrun --nproc-per-node 2 ")
    assert runs[0]["source"] == "measured" and "CPUs" in runs[0]["machine"]
