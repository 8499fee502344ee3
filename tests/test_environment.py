"""The test environment is reproducible: CI runs the README's commands, and both install from
the committed constraints.txt, which pins every dependency inside the ranges the package
declares (so the pins are a choice within what users get, never a different environment)."""

from __future__ import annotations

import re
import shlex
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


def test_both_readme_commands_install_from_the_constraints():
    for command in _readme_commands():
        install = next(part for part in command.split("&&") if "pip install" in part)
        args = shlex.split(install)
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
