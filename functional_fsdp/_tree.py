"""optree helpers that see through :class:`Sharded` (the library's pytree namespace).

Without the namespace a ``Sharded`` is a leaf; with it, a node whose only child is its local
tensor. Optimizers and user ``tree_map`` calls use the namespaced view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

NAMESPACE = "functional_fsdp"


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any, **kwargs: Any) -> Any:
    """``optree.tree_map`` over local tensors (``Sharded`` values are seen through).

    Example:
        >>> import torch
        >>> tree_map(lambda t: t * 2, {"w": torch.ones(2)})
        {'w': tensor([2., 2.])}
    """
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE, **kwargs)


def tree_leaves(tree: Any, **kwargs: Any) -> list[Any]:
    """The local tensors (and other leaves) of ``tree``, ``Sharded`` values seen through.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     tree = {"w": ff.shard(torch.zeros(4, 2), mesh, ff.P("dp")), "step": 3}
        ...     [getattr(x, "shape", x) for x in ff.tree_leaves(tree)]
        [3, torch.Size([2, 2])]
    """
    return optree.tree_leaves(tree, namespace=NAMESPACE, **kwargs)


def tree_flatten(tree: Any, **kwargs: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """``optree.tree_flatten`` with ``Sharded`` values seen through."""
    return optree.tree_flatten(tree, namespace=NAMESPACE, **kwargs)


def keystr(path: tuple[Any, ...]) -> str:
    """A key path as Python indexing, e.g. ``['blocks'][0]['weight']`` (``<root>`` if empty)."""
    if not path:
        return "<root>"
    return "".join(f"[{k!r}]" for k in path)


def dotted(path: tuple[Any, ...]) -> str:
    """A key path as a dotted name, e.g. ``blocks.0.attn.weight`` (what spec rules receive).

    Example:
        >>> dotted(("blocks", 0, "weight"))
        'blocks.0.weight'
    """
    return ".".join(str(getattr(k, "name", k)) for k in path)
