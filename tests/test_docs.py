"""The docs: every code block of the documentation site (``docs/**/*.md``) runs in CI as
written and computes the right numbers, or says why it cannot; the README's one screen is the
getting-started page's; and the API reference (docs/api/, built by ``mkdocs build --strict``
in CI) covers every public name.

A ```python block preceded by ``<!-- requires: torchrun --nproc-per-node N -->`` runs on N
real gloo processes (the session's worker pool, as torchrun would run it: each rank executes
the whole block); any other python block runs in this process. Blocks with a check (below)
are then compared with a single-process reference (see ``tests/_docs_workers.py``). Any other
block (shell commands, printed output) carries ``<!-- not run: why -->`` on the line above it.
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

from . import _docs_workers as W
from .conftest import SUITE_SIZE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# The check for each block, by its page and the heading it sits under (None: it only has to
# run).
CHECKED = {
    ("getting-started.md", "In one screen"): "one_screen",
    ("guides/fine-tuning.md", "Fine-tuning: LoRA, QLoRA and supervised fine-tuning"): "lora",
    ("guides/tp-2d.md", "FSDP + TP in one screen"): "2d",
    ("guides/compiled-step.md", "The compiled step: `ff.jit`"): "jit",
}


class Block(NamedTuple):
    heading: str
    line: int  # of the opening fence, 1-based
    source: str
    nproc: int | None  # None: runs in this process
    lang: str = "python"
    not_run: str | None = None  # why it cannot run


def code_blocks(text: str, name: str = "page") -> list[Block]:
    """The fenced code blocks of a markdown text, with the process count they ask for."""
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
            marker = lines[i - 1].strip() if i else ""
            nproc, not_run = None, None
            if marker.startswith("<!--"):
                found = re.fullmatch(r"<!-- requires: torchrun --nproc-per-node (\d+) -->", marker)
                why = re.fullmatch(r"<!-- not run: (.+?) -->", marker)
                if not (found or why):
                    raise ValueError(f"{name}:{i}: unknown marker {marker!r}")
                nproc = int(found.group(1)) if found else None
                not_run = why.group(1) if why else None
            body = [s[len(indent) :] for s in lines[i + 1 : end]]
            blocks.append(Block(heading, i + 1, "\n".join(body) + "\n", nproc, lang, not_run))
            i = end
        i += 1
    return blocks


PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
ALL = [(page, b) for page in PAGES for b in code_blocks((DOCS / page).read_text(), page)]
BLOCKS = [(page, b) for page, b in ALL if b.lang == "python" and b.not_run is None]
README_TEXT = README.read_text()


def test_the_parser_finds_blocks_and_markers():
    text = (
        "# A\n```python\nx = 1\n```\n## B\n<!-- requires: torchrun --nproc-per-node 4 -->\n"
        "```python\ny = 2\n```\n<!-- not run: a GPU -->\n```bash\nls\n```\n"
    )
    assert code_blocks(text) == [
        Block("A", 2, "x = 1\n", None),
        Block("B", 7, "y = 2\n", 4),
        Block("B", 11, "ls\n", None, "bash", "a GPU"),
    ]
    with pytest.raises(ValueError, match="unknown marker"):
        code_blocks("<!-- requires: mpirun -->\n```python\npass\n```\n")


def test_every_block_runs_or_says_why_not():
    assert len(PAGES) >= 10 and len(BLOCKS) >= 8
    silent = [
        f"docs/{page}:{b.line} ({b.lang or 'no language'})"
        for page, b in ALL
        if b.lang != "python" and b.not_run is None
    ]
    assert not silent, f"code blocks that neither run nor say why: {silent}"
    for page, b in BLOCKS:
        if "make_mesh" in b.source:
            assert b.nproc, f"docs/{page}:{b.line} needs a requires: torchrun marker"
    assert {(page, b.heading) for page, b in BLOCKS} >= set(CHECKED)


def test_the_readme_shows_the_getting_started_pages_one_screen():
    (readme,) = [b for b in code_blocks(README_TEXT, "README.md") if b.lang == "python"]
    (page,) = [b for p, b in BLOCKS if CHECKED.get((p, b.heading)) == "one_screen"]
    assert readme.source == page.source and readme.nproc == page.nproc


def test_the_readmes_links_resolve():
    # mkdocs build --strict checks the site's links; the README is not part of the site.
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README_TEXT)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to {missing}, which do not exist"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page,block", BLOCKS, ids=[f"{p}:{b.line}" for p, b in BLOCKS])
def test_docs_block_runs(page, block, pools, tmp_path):
    filename = f"docs/{page}:{block.line}"
    check = CHECKED.get((page, block.heading))
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
    # test_docs_block_runs). Its old last lines (batch.chunk(2)[dist.get_rank()]) took
    # rank 0's half on every simulated rank; asking torch for the rank there now raises.
    (block,) = [b for p, b in BLOCKS if CHECKED.get((p, b.heading)) == "one_screen"]
    print(W.run_one_screen_simulated(block.source, f"docs/getting-started.md:{block.line}"))
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
