"""Shallow copies of modules: the one way the library copies a module or a module tree.

The FSDP runtime copies the tree per call, the planner per priced step and the formats per
stored layer; all three share these two functions, which differ only in how an instance
``forward`` is bound to the copy.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

Bind = Callable[[nn.Module, types.MethodType], Any]  # (copy, original bound forward) -> forward


def _bind_strongly(copy: nn.Module, own: types.MethodType) -> Any:
    return types.MethodType(own.__func__, copy)


def shallow_copy(
    module: nn.Module, cls: type | None = None, *, bind: Bind = _bind_strongly
) -> nn.Module:
    """A copy of ``module`` (of class ``cls``, default its own) with its own parameter, buffer
    and child dicts (values shared); a ``forward`` bound to the instance is bound to the copy
    by ``bind``. Every other attribute is shared with the original until set."""
    c = object.__new__(cls or type(module))
    d = module.__dict__.copy()
    d["_parameters"] = dict(module._parameters)
    d["_buffers"] = dict(module._buffers)
    d["_modules"] = dict(module._modules)
    own = d.get("forward")
    if isinstance(own, types.MethodType) and own.__self__ is module:
        d["forward"] = bind(c, own)
    object.__setattr__(c, "__dict__", d)
    return c


def copy_tree(
    modules: Iterable[tuple[str, nn.Module]], *, bind: Bind = _bind_strongly
) -> dict[str, nn.Module]:
    """Shallow copies of a module tree given as ``(path, module)`` pairs (e.g.
    ``named_modules(remove_duplicate=False)``): ``{path: copy}`` for every path, a module
    reached by two paths copied once, and each copy's children the copies."""
    by_id: dict[int, nn.Module] = {}
    out: dict[str, nn.Module] = {}
    for path, m in modules:
        c = by_id.get(id(m))
        if c is None:
            c = by_id[id(m)] = shallow_copy(m, bind=bind)
        out[path] = c
    for c in by_id.values():
        children = c.__dict__["_modules"]
        for k, child in children.items():
            if child is not None:
                children[k] = by_id[id(child)]
    return out
