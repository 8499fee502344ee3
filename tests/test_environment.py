"""The test environment is reproducible: CI runs the README's commands, and they install from
the committed constraints.txt, which pins every dependency inside the ranges the package
declares (so the pins are a choice within what users get, never a different environment).
The README's notebooks install line is checked too: CI resolves it (``pip install --dry-run``
in ``.ci/run``), and here the ``notebooks`` extra is checked against what the notebooks import."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _readme_commands() -> tuple[str, str]:
    """The README's first two commands: the example run, then the test run."""
    blocks = [b.strip() for b in _bash_blocks((ROOT / "README.md").read_text())]
    return blocks[0], blocks[1]


def _notebooks_command() -> str:
    """The README's command that installs the ``notebooks`` extra."""
    blocks = [b.strip() for b in _bash_blocks((ROOT / "README.md").read_text())]
    (command,) = [b for b in blocks if '".[notebooks]"' in b]
    return command


def _install_args(command: str) -> list[str]:
    """The arguments of the ``pip install`` step of a README command."""
    install = next(part for part in command.split("&&") if "pip install" in part)
    return shlex.split(install)


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def test_the_readme_commands_install_from_the_constraints():
    for command in (*_readme_commands(), _notebooks_command()):
        args = _install_args(command)
        assert "-c" in args and args[args.index("-c") + 1] == "constraints.txt", command
        assert "torch==2.13.0" in args, command


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    _, tests = _readme_commands()
    steps = [shlex.split(s) for s in tests.split("&&")]
    ci_lines = [
        shlex.split(line)
        for line in ci.splitlines()
        if line.startswith(".venv/bin/") and ("pip install" in line or "pytest" in line)
    ]
    for step in steps[1:]:  # the venv is made by CI itself
        # CI may add quiet flags; every argument of the README's step must be in one CI line.
        assert any(set(step) <= set(line) for line in ci_lines), (step, ci)


def test_constraints_pin_every_declared_dependency_inside_its_range():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req}"
        )
    assert pins["torch"] == "2.13.0"


def test_ci_resolves_the_readme_notebooks_install_line():
    # A dry run: pip resolves the whole extra against constraints.txt and installs nothing
    # (13 to 17 s on the shared 2-core machine).
    ci = (ROOT / ".ci" / "run").read_text()
    readme = _install_args(_notebooks_command())[1:]  # without the venv's pip path
    dry_runs = [
        shlex.split(line)
        for line in ci.splitlines()
        if line.startswith(".venv/bin/pip install") and "--dry-run" in line
    ]
    assert any(set(readme) <= set(line) for line in dry_runs), (readme, dry_runs)


def _notebook_imports(path: Path) -> set[str]:
    """The top-level modules a notebook's code cells import."""
    found = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        source = "\n".join(
            "" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()
        )
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def test_the_notebooks_extra_opens_every_notebook_and_covers_its_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {
        canonicalize_name(Requirement(r).name)
        for r in project["optional-dependencies"]["notebooks"]
    }
    core = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert {"jupyterlab", "ipykernel"} <= extra  # something to open them with, and a kernel
    pins = _pins()
    assert not extra - set(pins), (
        f"the notebooks extra names unpinned packages: {extra - set(pins)}"
    )
    provided = importlib.metadata.packages_distributions()
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    missing = {}
    for nb in notebooks:
        for module in _notebook_imports(nb):
            if module in sys.stdlib_module_names or module == "functional_fsdp":
                continue
            dists = {canonicalize_name(d) for d in provided.get(module, ())}
            if not dists & (extra | core):
                missing.setdefault(nb.name, []).append(module)
    assert not missing, (
        f"notebooks import modules that neither the notebooks extra nor the core dependencies "
        f"install: {missing}; add them to [project.optional-dependencies] notebooks"
    )
