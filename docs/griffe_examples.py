"""A Griffe extension for the API reference: read this project's docstrings as written.

- Google style names the section ``Examples:``; Griffe reads the singular ``Example:`` as a
  plain admonition, so doctest output such as ``[[0.0, 2.0]]`` would be read as markdown
  (and as broken links). The site reads ``Example:`` as ``Examples:``, rendered as code.
- Sphinx roles (``:func:`~functional_fsdp.gather```) are shown as code (``gather``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class ProjectDocstrings(griffe.Extension):
    """Rewrite ``Example:`` headers and Sphinx roles before docstrings are parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(_role, text)
