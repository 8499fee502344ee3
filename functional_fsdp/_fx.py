"""Helpers that read FX graphs (the traced steps of :func:`~functional_fsdp.jit`)."""

from __future__ import annotations

import torch


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into one of its arguments (an in-place or ``out=`` op).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda x: x.add_(1).mul(2))(torch.ones(2)).graph
        >>> [writes_in_place(n) for n in graph.nodes if n.op == "call_function"]
        [True, False]
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
