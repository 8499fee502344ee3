"""A shallow copy of a module: the one helper the formats share (below every format file)."""

from __future__ import annotations

import types

from torch import nn


def shallow_copy(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A copy of ``module`` (of class ``cls``, default its own) with its own parameter, buffer
    and child dicts (values shared); an instance-level forward bound to ``module`` is bound to
    the copy."""
    c = object.__new__(cls or type(module))
    d = module.__dict__.copy()
    d["_parameters"] = dict(module._parameters)
    d["_buffers"] = dict(module._buffers)
    d["_modules"] = dict(module._modules)
    own = d.get("forward")
    if isinstance(own, types.MethodType) and own.__self__ is module:
        d["forward"] = types.MethodType(own.__func__, c)
    object.__setattr__(c, "__dict__", d)
    return c
