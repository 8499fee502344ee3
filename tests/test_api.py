"""The public API: every exported name is documented with an example."""

from __future__ import annotations

import inspect

import pytest

import functional_fsdp as ff


@pytest.mark.parametrize("name", ff.__all__)
def test_public_name_has_docstring_with_example(name):
    obj = getattr(ff, name)
    doc = inspect.getdoc(obj) or ""
    assert len(doc.splitlines()[0]) > 10, f"ff.{name} needs a one-line summary"
    assert "Example" in doc, f"ff.{name}'s docstring needs an example"


def test_all_lists_every_public_name():
    exported = {n for n in dir(ff) if not n.startswith("_") and n not in ("annotations",)}
    modules = {n for n in exported if inspect.ismodule(getattr(ff, n))}
    public_modules = {"checkpoint"}  # used as ff.checkpoint.save / ff.checkpoint.load
    assert set(ff.__all__) == (exported - modules) | public_modules
