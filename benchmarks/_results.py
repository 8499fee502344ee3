"""Where a benchmark's figures go: one JSON file per benchmark in ``benchmarks/results/``.

Each file holds ``{"benchmark", "description", "runs": [...]}``; a run is one configuration
(``key``, e.g. ``"width=256"``) with the command that measured it, the commit, the date, the
machine and the figures. ``python benchmarks/plot_results.py`` turns the files into the
plots and tables of ``docs/results.md``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def provenance(argv: list[str] | None = None, nproc: int | None = None) -> dict[str, str]:
    """The command, commit, date and machine of the running benchmark.

    Example:
        >>> sorted(provenance(["benchmarks/x.py", "--steps", "3"]))
        ['command', 'commit', 'date', 'machine', 'source']
    """
    argv = sys.argv if argv is None else argv
    launcher = f"torchrun --nproc-per-node {nproc} " if nproc else "python "
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import torch

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return {
        "command": launcher + " ".join(argv),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "machine": (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, load average {load} at the end"
        ),
        "source": "measured",
    }


def record(
    benchmark: str,
    key: str,
    figures: dict[str, Any],
    *,
    description: str = "",
    nproc: int | None = None,
    directory: Path = RESULTS,
) -> Path:
    """Write one run's figures into ``directory/benchmark.json``, replacing a run of that key.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> p = record("demo", "width=8", {"ms": 1.5}, directory=d)
        >>> p = record("demo", "width=8", {"ms": 1.25}, directory=d)
        >>> [r["figures"] for r in json.loads(p.read_text())["runs"]]
        [{'ms': 1.25}]
    """
    path = directory / f"{benchmark}.json"
    data = (
        json.loads(path.read_text())
        if path.exists()
        else {"benchmark": benchmark, "description": description, "runs": []}
    )
    if description:
        data["description"] = description
    run = {"key": key, **provenance(nproc=nproc), "figures": figures}
    runs = [r for r in data["runs"] if r["key"] != key] + [run]
    data["runs"] = sorted(runs, key=lambda r: _sort_key(r["key"]))
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def _sort_key(key: str) -> tuple[Any, ...]:
    name, _, value = key.partition("=")
    return (name, int(value)) if value.isdigit() else (name, 0, value)
