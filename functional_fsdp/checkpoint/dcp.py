"""Checkpoints with torch Distributed Checkpoint (DCP): save on one mesh, load on another.

``save`` writes every ``Sharded`` value as a ``DTensor`` (each rank writes its own rows) and
other leaves as they are. ``load`` reads into the layout of a template tree — typically a
freshly initialised state on the new mesh — so a checkpoint written by 2 ranks with
``P("dp")`` loads on 4 ranks, on a 2-D mesh, or on one process. Both are collective calls:
every rank of the mesh must call them.

Example:
    >>> ff.checkpoint.save("ckpt/step_100", state)  # doctest: +SKIP
    >>> state = ff.checkpoint.load("ckpt/step_100", fresh_state_on_another_mesh)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

import optree
import torch
import torch.distributed.checkpoint as dcp

from .._tree import NAMESPACE, dotted
from ..sharded import Sharded


def _flatten(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    paths, leaves, treedef = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True, namespace=NAMESPACE
    )
    return [dotted(p) or "<root>" for p in paths], leaves, treedef


def save(path: str | os.PathLike[str], tree: Any) -> None:
    """Write ``tree`` (params, a :class:`TrainState`, any pytree) to the directory ``path``.

    Example:
        >>> ff.checkpoint.save("ckpt/step_100", state)  # doctest: +SKIP
    """
    keys, leaves, _ = _flatten(tree)
    state_dict = {k: v.to_dtensor() if isinstance(v, Sharded) else v for k, v in zip(keys, leaves)}
    dcp.save(state_dict, checkpoint_id=os.fspath(path))


def load(path: str | os.PathLike[str], like: Any) -> Any:
    """Read the checkpoint at ``path`` into the structure and layouts of ``like``.

    ``like`` is not modified: values are read into new buffers. ``Sharded`` leaves come back
    with ``like``'s spec and mesh (resharded as needed); other tensors and Python values come
    back as saved.

    Raises:
        ValueError: if a key of ``like`` is missing from the checkpoint or has another
            global shape there.

    Example:
        >>> template = ff.TrainState.create(new_model.shard(), optimizer)  # doctest: +SKIP
        >>> state = ff.checkpoint.load("ckpt/step_100", template)  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor

    keys, leaves, treedef = _flatten(like)
    metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    state_dict: dict[str, Any] = {}
    for key, leaf in zip(keys, leaves):
        if key not in metadata:
            raise ValueError(
                f"checkpoint.load: {key!r} is not in the checkpoint at {os.fspath(path)!r} "
                f"(it has {sorted(metadata)[:8]}...). Load into a template with the saved "
                f"structure, e.g. the same model and optimizer."
            )
        saved_shape = getattr(metadata[key], "size", None)
        tensor_like = isinstance(leaf, (Sharded, torch.Tensor)) and saved_shape is not None
        if tensor_like and tuple(saved_shape) != tuple(leaf.shape):
            raise ValueError(
                f"checkpoint.load: {key!r} was saved with global shape "
                f"{tuple(saved_shape)}, but the template has {tuple(leaf.shape)}."
            )
        if isinstance(leaf, Sharded):
            dt = leaf.to_dtensor()
            local = torch.empty_like(dt.to_local())
            state_dict[key] = DTensor.from_local(
                local,
                dt.device_mesh,
                dt.placements,
                run_check=False,
                shape=dt.shape,
                stride=dt.stride(),
            )
        elif isinstance(leaf, torch.Tensor):
            state_dict[key] = torch.empty_like(leaf)
        else:
            state_dict[key] = leaf
    dcp.load(state_dict, checkpoint_id=os.fspath(path))
    out = []
    for key, leaf in zip(keys, leaves):
        value = state_dict[key]
        out.append(Sharded.from_dtensor(value) if isinstance(leaf, Sharded) else value)
    return optree.tree_unflatten(treedef, out)
