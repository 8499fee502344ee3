"""Plumbing shared by the optimizer modules: argument checks and tree helpers.

Trees are flattened with the library's namespace, so ``Sharded`` values are seen through to
their local tensors. Errors name leaves by dotted path and show ``Sharded`` values whole
(global shape and spec).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import optree
import torch

from .._tree import dotted, tree_flatten, tree_map
from ..sharded import Sharded

REINIT_HINT = (
    "The optimizer state was built by init() for another params tree: call "
    "state = opt.init(params) with the params you update, and again after changing the model "
    "or its sharding."
)
SAME_PARAMS_HINT = "Pass the params these updates belong to (the same tree, keys and sharding)."


def require_params(where: str, params: object) -> None:
    """Refuse ``update(grads, state)`` for a transformation that reads the params.

    Example:
        >>> require_params("lamb", None)
        Traceback (most recent call last):
        ...
        ValueError: lamb needs the params: call opt.update(grads, state, params) instead of opt.update(grads, state).
    """
    if params is None:
        raise ValueError(
            f"{where} needs the params: call opt.update(grads, state, params) instead of "
            f"opt.update(grads, state)."
        )


def check_real(where: str, name: str, value: object, *, low: float | None = None) -> float:
    """``value`` as a float, or a ``TypeError``/``ValueError`` naming ``where`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: {name} must be a real number, got {value!r} ({type(value).__name__})."
        )
    value = float(value)
    if not math.isfinite(value) or (low is not None and value < low):
        bound = "finite" if low is None else f"finite and >= {low}"
        raise ValueError(f"{where}: {name} must be {bound}, got {value}.")
    return value


def check_unit_interval(where: str, name: str, value: object) -> float:
    """``value`` as a float in ``[0, 1)`` (a decay rate such as Adam's betas)."""
    value = check_real(where, name, value, low=0.0)
    if value >= 1.0:
        raise ValueError(f"{where}: {name} must be in [0, 1), got {value}.")
    return value


def local_leaves(tree: Any) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """The local tensors of ``tree`` (``Sharded`` seen through) and its namespaced treedef."""
    return tree_flatten(tree)


def check_tensor_tree(tree: Any, where: str) -> None:
    """Raise a ``TypeError`` naming the first leaf that is not a tensor or ``Sharded``."""
    for path, leaf in zip(*optree.tree_flatten_with_path(tree)[:2]):
        if not isinstance(leaf, (torch.Tensor, Sharded)):
            raise TypeError(
                f"{where}: {dotted(path) or '<root>'} is {leaf!r} ({type(leaf).__name__}); "
                f"optimizers work on trees of tensors (or Sharded). Keep other values out of "
                f"the params tree, e.g. in a separate dict."
            )


def _describe(x: Any) -> str:
    if isinstance(x, Sharded):
        return f"Sharded {x.global_shape} {x.spec.trimmed()}"
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def mismatch_error(where: str, what: str, expected: Any, got: Any, hint: str) -> ValueError:
    """An error naming the leaves where ``expected`` (e.g. ``state.mu``) and ``got`` differ."""
    exp = {dotted(p): x for p, x in zip(*optree.tree_flatten_with_path(expected)[:2])}
    act = {dotted(p): x for p, x in zip(*optree.tree_flatten_with_path(got)[:2])}
    lines = []
    missing, extra = sorted(set(exp) - set(act)), sorted(set(act) - set(exp))
    if missing:
        lines.append(f"  only in {what}: {missing[:10]}")
    if extra:
        lines.append(f"  only in the updates: {extra[:10]}")
    for key in exp:
        if key in act and _describe(exp[key]) != _describe(act[key]):
            lines.append(
                f"  {key or '<root>'}: {_describe(exp[key])} in {what}, "
                f"{_describe(act[key])} in the updates"
            )
    return ValueError(
        f"{where}: {what} does not match the updates.\n" + "\n".join(lines[:8]) + "\n"
        f"  {what} structure: {_short(str(optree.tree_structure(expected)))}\n"
        f"  updates structure: {_short(str(optree.tree_structure(got)))}\n{hint}"
    )


def leaves_like(
    where: str, what: str, tree: Any, updates: Any, hint: str = REINIT_HINT
) -> list[torch.Tensor]:
    """The local tensors of ``tree``, after checking that it is laid out like ``updates``."""
    leaves, treedef = local_leaves(tree)
    u_leaves, u_def = local_leaves(updates)
    if treedef != u_def or any(a.shape != b.shape for a, b in zip(leaves, u_leaves)):
        raise mismatch_error(where, what, tree, updates, hint)
    return leaves


def zeros_like_tree(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Zeros with the shapes, dtypes (or ``dtype``) and layouts of ``tree``."""
    return tree_map(lambda t: torch.zeros_like(t, dtype=dtype), tree)


def check_dtype(where: str, name: str, value: object) -> torch.dtype | None:
    """``value`` if it is ``None`` or a floating ``torch.dtype``, else a ``TypeError``."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    raise TypeError(
        f"{where}: {name} must be a floating torch.dtype such as torch.bfloat16 (or None for "
        f"the params' dtype), got {value!r} ({type(value).__name__})."
    )


def map_foreach(
    fn: Callable[..., list[torch.Tensor]], tree: Any, *args: Any, donate: bool = False, **kw: Any
) -> Any:
    """``fn(local_tensors, *args, **kw)``, rebuilt into the structure of ``tree``.

    ``donate``: ``tree``'s tensors may be overwritten (the updates of a
    ``train_step(donate=True)``, which the step owns): the in-place variant
    (``torch._foreach_mul_`` for ``_foreach_mul``) writes them instead. Bitwise the same.
    """
    leaves, treedef = local_leaves(tree)
    if not leaves:
        return tree
    if donate:
        inplace = getattr(torch, fn.__name__ + "_", None)
        if inplace is not None:
            inplace(leaves, *args, **kw)
            return tree
    return optree.tree_unflatten(treedef, fn(leaves, *args, **kw))
