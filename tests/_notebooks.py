"""The notebooks with their outputs: execute them, compare with what is committed, refresh.

The notebooks are committed with their outputs, so that the docs site (mkdocs-jupyter, which
does not execute them) and any notebook viewer show their pictures without a kernel.
``tests/test_notebooks.py`` executes each notebook once (the only execution in the test
suite) and checks that the committed outputs are fresh: the same outputs, cell by cell, up to
the rounding of printed numbers and the bytes of images. After changing a notebook or what
it prints, refresh them:

    python -m tests._notebooks            # all of them
    python -m tests._notebooks planner    # one
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def execute(path: Path, timeout: int = 600) -> Any:
    """``path`` executed in a fresh kernel, in the notebooks' directory."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _words(text: str) -> tuple[str, list[float]]:
    """The text with its numbers taken out, and the numbers (so that a last-digit rounding
    difference between machines does not count as stale)."""
    text = _ADDRESS.sub(" at 0x", text)
    numbers = [float(n.replace(",", "")) for n in _NUMBER.findall(text)]
    return _NUMBER.sub("#", text), numbers


def outputs(nb: Any) -> list[list[tuple[str, str, Any]]]:
    """Each code cell's outputs as ``(kind, mime or stream, content)``: texts as words and
    numbers, images as their presence. Consecutive prints to one stream count as one output,
    however the kernel flushed them."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        raw: list[tuple[str, str, Any]] = []
        for o in cell.get("outputs", []):
            if o.output_type == "stream" and o.name == "stderr":
                continue  # warnings name the machine's paths and packages: not content
            if o.output_type == "stream":
                if raw and raw[-1][:2] == ("stream", o.name):
                    raw[-1] = ("stream", o.name, raw[-1][2] + _text(o.text))
                else:
                    raw.append(("stream", o.name, _text(o.text)))
            elif o.output_type in ("display_data", "execute_result"):
                # What a page shows: the HTML where there is one (an object's plain repr may
                # hold a timing, e.g. a plan's seconds), else the text.
                shown = {m for m in o.data if m != "text/plain"} or {"text/plain"}
                for mime, value in sorted((m, v) for m, v in o.data.items() if m in shown):
                    content = "image" if mime.startswith("image/") else _words(_text(value))
                    raw.append((o.output_type, mime, content))
            elif o.output_type == "error":
                raw.append(("error", o.ename, o.evalue))
        cells.append([(k, m, _words(c)) if k == "stream" else (k, m, c) for k, m, c in raw])
    return cells


def same(committed: Any, executed: Any, rel: float = 1e-3) -> str | None:
    """``None`` if the committed outputs are those of the execution, else where they differ."""
    a, b = outputs(committed), outputs(executed)
    if len(a) != len(b):
        return f"{len(a)} code cells committed, {len(b)} executed"
    for i, (ca, cb) in enumerate(zip(a, b)):
        if [x[:2] for x in ca] != [x[:2] for x in cb]:
            return f"code cell {i}: outputs {[x[:2] for x in ca]} != {[x[:2] for x in cb]}"
        for (kind, mime, va), (_, _, vb) in zip(ca, cb):
            if va == vb:
                continue
            if isinstance(va, tuple) and va[0] == vb[0] and len(va[1]) == len(vb[1]):
                close = all(
                    abs(x - y) <= rel * max(abs(x), abs(y), 1.0) for x, y in zip(va[1], vb[1])
                )
                if close:
                    continue
            return f"code cell {i}: {kind} {mime} differs:\n{va}\n!=\n{vb}"
    return None


def refresh(names: list[str]) -> None:
    """Execute the named notebooks (all when none) and write them with their outputs."""
    paths = [NOTEBOOKS / f"{n}.ipynb" for n in names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        nb = execute(path)
        for cell in nb.cells:
            cell.get("metadata", {}).pop("execution", None)  # timestamps: not content
            if "outputs" in cell:  # stderr (warnings with this machine's paths): not content
                cell.outputs = [
                    o
                    for o in cell.outputs
                    if not (o.output_type == "stream" and o.name == "stderr")
                ]
        nbformat.write(nb, path)
        print("refreshed", path.name)


if __name__ == "__main__":
    refresh(sys.argv[1:])
