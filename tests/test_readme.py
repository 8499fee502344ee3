"""The docs: every ```python block of README.md runs as written and computes the right
numbers, and the API reference (docs/api/, built by ``mkdocs build --strict`` in CI) covers
every public name.

A block preceded by ``<!-- requires: torchrun --nproc-per-node N -->`` runs on N real gloo
processes (the session's worker pool, as torchrun would run it: each rank executes the whole
block); any other block runs in this process. Each block is then checked against a
single-process reference (see ``tests/_readme_workers.py``).
"""

from __future__ import annotations

import collections
import inspect
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import functional_fsdp as ff

from . import _readme_workers as W
from .conftest import SUITE_SIZE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The check for each block, by the heading it sits under (None: it only has to run).
CHECKED = {
    "In one screen": "one_screen",
    "Hugging Face models, LoRA, and models bigger than one rank": "lora",
    "2D: FSDP + tensor parallelism": "2d",
    "A compiled step: `ff.jit`": "jit",
}


class Block(NamedTuple):
    heading: str
    line: int  # of the opening fence, 1-based
    source: str
    nproc: int | None  # None: runs in this process


def readme_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text, with the process count they ask for."""
    blocks, heading, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        fence = re.match(r"^(\s*)```(\S*)\s*$", line)
        if fence:
            indent, lang = fence.groups()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if lang == "python":
                marker = lines[i - 1].strip() if i else ""
                nproc = None
                if marker.startswith("<!--"):
                    found = re.fullmatch(
                        r"<!-- requires: torchrun --nproc-per-node (\d+) -->", marker
                    )
                    if not found:
                        raise ValueError(f"README.md:{i}: unknown marker {marker!r}")
                    nproc = int(found.group(1))
                body = [s[len(indent) :] for s in lines[i + 1 : end]]
                blocks.append(Block(heading, i + 1, "\n".join(body) + "\n", nproc))
            i = end
        i += 1
    return blocks


README_TEXT = README.read_text()
BLOCKS = readme_blocks(README_TEXT)


def test_the_parser_finds_blocks_and_markers():
    text = "# A\n```python\nx = 1\n```\n## B\n<!-- requires: torchrun --nproc-per-node 4 -->\n```python\ny = 2\n```\n```bash\nls\n```\n"
    assert readme_blocks(text) == [
        Block("A", 2, "x = 1\n", None),
        Block("B", 7, "y = 2\n", 4),
    ]
    with pytest.raises(ValueError, match="unknown marker"):
        readme_blocks("<!-- requires: mpirun -->\n```python\npass\n```\n")


def test_every_block_that_needs_processes_says_so_and_has_a_check():
    assert BLOCKS, "README.md has no python blocks"
    for block in BLOCKS:
        if "make_mesh" in block.source:
            assert block.nproc, f"README.md:{block.line} needs a requires: torchrun marker"
    assert {b.heading for b in BLOCKS} >= set(CHECKED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_block_runs(block, pools, tmp_path):
    filename = f"README.md:{block.line}"
    check = CHECKED.get(block.heading)
    if block.nproc is None:
        W.run_block(block.source, filename, check, str(tmp_path))
        return
    # A failed check raises on the ranks (WorkerError here); the errors measured are shown.
    print(
        filename, pools.run(block.nproc, W.run_block, block.source, filename, check, str(tmp_path))
    )


@pytest.mark.timeout(300)
def test_the_one_screen_in_a_notebook_is_right_on_every_simulated_rank():
    # The same block, with the mesh line its comment gives for a notebook: every simulated
    # rank's gradients equal one process's on the global batch (under torchrun:
    # test_readme_block_runs). Its old last lines (batch.chunk(2)[dist.get_rank()]) took
    # rank 0's half on every simulated rank; asking torch for the rank there now raises.
    (block,) = [b for b in BLOCKS if b.heading == "In one screen"]
    print(W.run_one_screen_simulated(block.source, f"README.md:{block.line}"))
    old = "local_batch = global_batch.chunk(2)[torch.distributed.get_rank()]"
    with (
        ff.simulated_mesh({"dp": 2}),
        pytest.raises(
            RuntimeError, match=r"get_rank\(\) inside ff\.simulated_mesh.*ff\.local_batch"
        ),
    ):
        exec(old, {"torch": torch, "global_batch": torch.zeros(4, 3)})
    assert torch.distributed.get_rank.__module__ == "torch.distributed.distributed_c10d"


def test_the_readme_counts_the_tests(request):
    # The README's test count is what `python -m pytest --collect-only -q` collects; known
    # here only when this run collected the whole suite (no paths given).
    if SUITE_SIZE not in request.config.stash:
        pytest.skip("the whole suite was not collected: run python -m pytest without paths")
    found = re.search(
        r"The suite has ([\d,]+) tests \(`python -m pytest\s+--collect-only -q`", README_TEXT
    )
    assert found, "README.md no longer says how many tests the suite has"
    stated, collected = int(found.group(1).replace(",", "")), request.config.stash[SUITE_SIZE]
    assert stated == collected, f"README.md says the suite has {stated} tests; it has {collected}"


def test_the_api_reference_documents_every_public_name_once():
    # docs/api/*.md render ``::: functional_fsdp.NAME`` per public name, and whole public
    # packages (``::: functional_fsdp.checkpoint``) with their __all__.
    pages = collections.defaultdict(list)
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for target in re.findall(r"^::: (\S+)\s*$", page.read_text(), re.M):
            pages[target].append(page.name)
    twice = {t: p for t, p in pages.items() if len(p) > 1}
    assert not twice, f"documented more than once: {twice}"
    missing = [
        name
        for name in ff.__all__
        if f"functional_fsdp.{name}" not in pages
        and not (inspect.ismodule(getattr(ff, name)) and getattr(ff, name).__name__ in pages)
    ]
    assert not missing, (
        f"ff.{', ff.'.join(missing)} missing from the API reference: add a line "
        f"'::: functional_fsdp.NAME' to the page of docs/api/ for its topic."
    )
    unknown = [t for t in pages if t.startswith("functional_fsdp.") and t.count(".") == 1]
    unknown = [
        t for t in unknown if t.split(".")[1] not in ff.__all__ and t != "functional_fsdp.models"
    ]
    assert not unknown, f"docs/api/ documents names that ff does not export: {unknown}"
