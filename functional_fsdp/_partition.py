"""Trainable and frozen parameters: ``partition`` a tree in two, ``combine`` it back.

This is equinox's ``partition``/``combine``, adapted to ``torch.func``. ``partition(params,
trainable)`` returns two trees that together hold every leaf once. A dict keeps only the keys
whose values it holds; any other container (list, tuple, NamedTuple, a registered node) keeps
its shape, with ``None`` where the leaf went to the other tree. Dicts drop keys instead of
holding ``None`` because ``torch.func`` treats ``None`` as a leaf and refuses it
("Thing passed to transform API must be Tensor"), and a parameter tree is usually a flat
``{name: Sharded}`` dict. So the functional recipe works as written::

    trainable, frozen = ff.partition(params, sharded_model)   # requires_grad=True vs False
    grads = torch.func.grad(lambda t: loss_fn(ff.combine(t, frozen), batch))(trainable)
    opt_state = optimizer.init(trainable)                      # moments for trainable only

Frozen values are never differentiated, so :meth:`FSDP.apply` gives them no gradient and
issues no reduce-scatter for them; an optimizer built on the trainable tree keeps no state for
them; and ``combine`` returns the frozen tensors themselves, so they never change.
:func:`functional_fsdp.train_step` does all of this for a :class:`TrainState` created with
``trainable=``.

The ``trainable`` argument may be:

- an object with a ``.trainable`` collection of names (the ``FSDP`` description of a module),
  or an ``nn.Module`` or ``FSDP`` without one: its parameters with ``requires_grad=True``;
- a collection of dotted names (``{"layers.0.q_proj.lora_A.weight", ...}``);
- a predicate ``fn(dotted_path, leaf) -> bool``;
- a tree of bools laid out like ``tree``, or a prefix of it (``{"head": True, "body": False}``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import optree
import torch

from ._tree import dotted

Trainable = Any  # see the module docstring


class _Missing:
    """Marks a leaf that went to the other tree, until containers are pruned."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def module_trainable(obj: Any) -> frozenset[str] | None:
    """The trainable parameter names of an ``FSDP`` description or an ``nn.Module``.

    ``obj.trainable`` when it has one; otherwise the names (first name of tied parameters)
    of the module's parameters with ``requires_grad=True``. ``None`` for other objects.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> model.bias.requires_grad_(False)
        Parameter containing:
        tensor(...)
        >>> sorted(module_trainable(model))
        ['weight']
    """
    names = getattr(obj, "trainable", None)
    if names is not None and not callable(names):
        return frozenset(names)
    module = obj if isinstance(obj, torch.nn.Module) else getattr(obj, "module", None)
    if isinstance(module, torch.nn.Module):
        return frozenset(n for n, p in module.named_parameters() if p.requires_grad)
    return None


_FROZEN = "_functional_fsdp_frozen"  # set on the local block of a frozen parameter's shard


def mark_frozen(params: dict[str, Any], model: Any) -> dict[str, Any]:
    """Tag the shards of ``model``'s frozen parameters (``requires_grad=False``), in place.

    The shards were just made by the library (``FSDP.shard``, ``init_sharded``,
    ``load_safetensors``), so tagging their local blocks changes nothing of the user's. The tag
    lets :meth:`TrainState.create` without ``trainable=`` refuse them at once, instead of the
    first step. It is lost by any operation that makes new tensors, which is what a tag should.
    It is a hint for an earlier error and nothing reads it for a computation; the rule it
    serves (``train._refuse_frozen``) is checked again at the step from the module itself.
    """
    trainable = module_trainable(model)
    if trainable is None:
        return params
    for name, value in params.items():
        local = getattr(value, "local", value)
        differentiable = isinstance(local, torch.Tensor) and (
            local.is_floating_point() or local.is_complex()
        )
        if name not in trainable and differentiable:  # integer ones have their own error
            setattr(local, _FROZEN, True)
    return params


def marked_frozen(tree: Any) -> list[str]:
    """The dotted names of the leaves of ``tree`` that :func:`mark_frozen` tagged."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return [
        dotted(path)
        for path, leaf in zip(paths, leaves)
        if getattr(getattr(leaf, "local", leaf), _FROZEN, False)
    ]


def _is_names(spec: Any) -> bool:
    if isinstance(spec, (set, frozenset)):
        return True
    return (
        isinstance(spec, (list, tuple)) and len(spec) > 0 and all(isinstance(s, str) for s in spec)
    )


def trainable_flags(where: str, spec: Trainable, tree: Any) -> list[bool]:
    """One bool per leaf of ``tree`` (optree's order; ``Sharded`` values are leaves).

    Raises:
        ValueError: for a name that is not a leaf of ``tree``, or a mask that does not fit it.
        TypeError: for a spec of another kind, or a mask or predicate that gives a non-bool.

    Example:
        >>> trainable_flags("example", {"b"}, {"a": 1, "b": 2})
        [False, True]
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    names = [dotted(p) for p in paths]
    selected = module_trainable(spec)
    if selected is None and _is_names(spec):
        selected = frozenset(spec)
    if selected is not None:
        unknown = sorted(selected - set(names))
        if unknown:
            close = [n for n in names if n.rpartition(".")[2] == unknown[0].rpartition(".")[2]]
            raise ValueError(
                f"{where}: trainable names {unknown[:3]} are not leaves of the params tree "
                f"({len(names)} leaves, e.g. {(close or names)[:3]}). Use the dotted names "
                f"of module.named_parameters() (the keys of FSDP.shard()), or a predicate "
                f"such as trainable=lambda path, p: 'lora_' in path."
            )
        return [n in selected for n in names]
    if callable(spec) and not isinstance(spec, (dict, list, tuple)):
        flags = [spec(n, x) for n, x in zip(names, leaves)]
    else:
        flags = prefix_mask_flags(where, spec, paths)
    for name, flag in zip(names, flags):
        if not isinstance(flag, bool):
            raise TypeError(
                f"{where}: the mask gives {flag!r} ({type(flag).__name__}) for "
                f"{name or '<root>'}; give a tree of bools, a predicate fn(path, leaf) -> bool, "
                f"a collection of dotted names, or an FSDP/nn.Module (its requires_grad)."
            )
    return flags


def prefix_mask_flags(where: str, mask: Any, paths: list[tuple[Any, ...]]) -> list[Any]:
    """The mask's value at the longest mask path that is a prefix of each leaf's path.

    The mask may be a prefix of the tree (one bool for a whole subtree) and may have more
    dict keys than the tree (a mask written for all params, applied to the trainable ones).
    """
    if mask is None or isinstance(mask, (str, bytes)):
        raise TypeError(
            f"{where}: expected a tree of bools, a predicate fn(path, leaf) -> bool, a "
            f"collection of dotted names or an FSDP/nn.Module, got {mask!r}."
        )
    m_paths, m_leaves, _ = optree.tree_flatten_with_path(mask)
    table = dict(zip(m_paths, m_leaves))
    flags = []
    for path in paths:
        for cut in range(len(path), -1, -1):
            if path[:cut] in table:
                flags.append(table[path[:cut]])
                break
        else:
            raise ValueError(
                f"{where}: the mask does not match the params tree: it has no entry for "
                f"{dotted(path) or '<root>'}.\n"
                f"  mask structure: {optree.tree_structure(mask)}\n"
                f"Give a tree of bools with the params' keys (or a prefix of them), or a "
                f"predicate, e.g. mask=lambda path, p: p.ndim >= 2."
            )
    return flags


def _is_dict(node: Any) -> bool:
    return type(node) in (dict, OrderedDict)


def _prune(node: Any, keep_none: bool) -> Any:
    """Drop missing leaves: dict keys go, other containers get ``None`` in their place.

    ``None`` values of the input stay in one tree only (``keep_none``): the frozen one.
    """
    if node is _MISSING:
        return node
    if node is None:
        return None if keep_none else _MISSING
    if _is_dict(node):
        kept = {k: _prune(v, keep_none) for k, v in node.items()}
        kept = {k: v for k, v in kept.items() if v is not _MISSING}
        return _MISSING if node and not kept else type(node)(kept)
    if _is_leaf(node):
        return node
    children, metadata, _, unflatten = optree.tree_flatten_one_level(node)
    pruned = [_prune(c, keep_none) for c in children]
    if children and all(c is _MISSING for c in pruned):
        return _MISSING
    return unflatten(metadata, [None if c is _MISSING else c for c in pruned])


def _is_leaf(node: Any) -> bool:
    return optree.treespec_is_leaf(optree.tree_structure(node))


def _empty_like(tree: Any) -> Any:
    return type(tree)() if _is_dict(tree) else None


def partition(tree: Any, trainable: Trainable) -> tuple[Any, Any]:
    """Split ``tree`` into ``(trainable_tree, frozen_tree)``.

    Args:
        tree: a params tree, e.g. ``{name: Sharded}`` from :meth:`FSDP.shard`.
        trainable: what to train: an ``FSDP`` description or ``nn.Module`` (its parameters
            with ``requires_grad=True``, or the FSDP's ``trainable`` names), a collection of
            dotted names, a predicate ``fn(dotted_path, leaf) -> bool``, or a tree of bools.

    Returns:
        Two trees holding every leaf of ``tree`` once, the same objects (no copies). Dicts
        keep only their own keys; other containers hold ``None`` in the other tree's places.

    Raises:
        ValueError: if a name is not in ``tree`` or a mask does not fit it.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> params = {"w": torch.ones(2), "lora": torch.zeros(2)}
        >>> train, frozen = ff.partition(params, lambda path, p: "lora" in path)
        >>> sorted(train), sorted(frozen)
        (['lora'], ['w'])
        >>> ff.combine(train, frozen)["w"] is params["w"]
        True
    """
    leaves, treedef = optree.tree_flatten(tree)
    flags = trainable_flags("partition", trainable, tree)
    yes = treedef.unflatten([x if f else _MISSING for x, f in zip(leaves, flags)])
    no = treedef.unflatten([_MISSING if f else x for x, f in zip(leaves, flags)])
    yes, no = _prune(yes, keep_none=False), _prune(no, keep_none=True)
    return (
        _empty_like(tree) if yes is _MISSING else yes,
        _empty_like(tree) if no is _MISSING else no,
    )


def combine(*trees: Any) -> Any:
    """Merge trees from :func:`partition` (or any disjoint trees) back into one.

    Dicts are merged key by key; in other containers each place takes the value that is not
    ``None``. Leaves are returned as they are (no copies).

    Raises:
        ValueError: if two trees hold a value at the same place, or their containers differ.

    Example:
        >>> import functional_fsdp as ff
        >>> ff.combine({"a": 1}, {"b": 2}), ff.combine([1, None], [None, 2])
        ({'a': 1, 'b': 2}, [1, 2])
    """
    return _merge(list(trees), ())


def _merge(nodes: list[Any], path: tuple[Any, ...]) -> Any:
    present = [n for n in nodes if n is not None]
    if len(present) <= 1:
        return present[0] if present else None
    if all(_is_dict(n) for n in present):
        keys: dict[Any, None] = {}
        for n in present:
            keys.update(dict.fromkeys(n))
        merged = {k: _merge([n[k] for n in present if k in n], (*path, k)) for k in keys}
        return type(present[0])(merged)
    where = dotted(path) or "<root>"
    if any(_is_leaf(n) for n in present):
        raise ValueError(
            f"combine: {where} is given by more than one tree ({_kinds(present)}). Combine "
            f"trees that hold each value once, such as the two halves of ff.partition(...)."
        )
    flat = [optree.tree_flatten_one_level(n) for n in present]
    first = flat[0]
    for other in flat[1:]:
        if other.metadata != first.metadata or len(other.children) != len(first.children):
            raise ValueError(
                f"combine: the trees have different containers at {where} "
                f"({_kinds(present)}); combine trees split from the same tree."
            )
    children = [
        _merge([f.children[i] for f in flat], (*path, first.entries[i]))
        for i in range(len(first.children))
    ]
    return first.unflatten_func(first.metadata, children)


def _kinds(nodes: Iterable[Any]) -> str:
    return ", ".join(type(n).__name__ for n in nodes)


def trainable_names(tree: Any, trainable: Trainable, where: str) -> frozenset[str]:
    """The dotted paths of the leaves of ``tree`` that ``trainable`` selects."""
    paths, _, _ = optree.tree_flatten_with_path(tree)
    flags = trainable_flags(where, trainable, tree)
    return frozenset(dotted(p) for p, f in zip(paths, flags) if f)


def names_of(tree: Any) -> list[str]:
    """The dotted paths of the leaves of ``tree``."""
    return [dotted(p) for p in optree.tree_paths(tree)]
