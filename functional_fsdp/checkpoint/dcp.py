"""Checkpoints with torch Distributed Checkpoint (DCP): save on one mesh, load on another.

``save`` writes every ``Sharded`` value as a ``DTensor`` (each rank writes its own rows) and
other leaves as they are. ``load`` reads into the layout of a template tree — typically a
freshly initialised state on the new mesh — so a checkpoint written by 2 ranks with
``P("dp")`` loads on 4 ranks, on a 2-D mesh, or on one process. Both are collective calls:
every rank of the mesh must call them.

Key layout. Every leaf is stored under its dotted path in the tree: dict keys, sequence
positions, and the field names of NamedTuples (optimizer states). For a :class:`TrainState`:

=====================================  ==================================================
``params.<param>``                      every parameter, trainable and frozen, e.g.
                                        ``params.layers.0.self_attn.q_proj.weight``
``opt_state.<i>.<field>.<param>``       optimizer state of transformation ``i`` of the
                                        ``chain`` (``adamw`` = ``scale_by_adam``,
                                        ``add_decayed_weights``, learning rate), e.g.
                                        ``opt_state.0.mu.layers.0.self_attn.q_proj.weight``
                                        (``mu``/``nu``: Adam's moments, ``trace``:
                                        momentum, ``inner_state``: under ``masked``)
``opt_state.<i>.count``                 step counters of the transformations that keep one
``opt_state.<i>.learning_rate``         the rate of the last update (recorded for reports)
``step``                                completed optimizer steps
=====================================  ==================================================

A state created with ``trainable=`` has ``opt_state`` keys for its trainable parameters only;
load it into a template created with the same ``trainable``. ``<param>`` is the name from
``module.named_parameters()`` (the keys of :meth:`FSDP.shard`).

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

from .._tree import NAMESPACE
from ..distributed.simulate import is_simulated
from ..optim.records import is_record
from ..sharded import Sharded
from . import _atomic


def _key(entry: Any) -> str:
    """One path entry as a key part: NamedTuple fields by name (``mu``, not ``1``)."""
    if isinstance(entry, optree.NamedTupleEntry):
        return str(entry.field)
    if isinstance(entry, (optree.GetAttrEntry, optree.DataclassEntry)):
        return str(entry.name)
    return str(entry.entry)


def _flatten(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    keys, leaves, treedef, _ = _flatten_with_records(tree)
    return keys, leaves, treedef


def _flatten_with_records(
    tree: Any,
) -> tuple[list[str], list[Any], optree.PyTreeSpec, set[str]]:
    """Keys, leaves and treedef of ``tree``, and the keys of the fields optimizer states
    record for reports (see :mod:`functional_fsdp.optim.records`)."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        tree, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True, namespace=NAMESPACE
    )
    keys = [".".join(_key(e) for e in a) or "<root>" for a in accessors]
    records = {k for k, a in zip(keys, accessors) if len(a) and is_record(a[-1])}
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise ValueError(
                f"checkpoint: two leaves of the tree have the same key {key!r} (leaves "
                f"{seen[key]} and {i}); rename one, e.g. a dict key that contains dots."
            )
        seen[key] = i
    return keys, leaves, treedef, records


def refuse_simulated(where: str) -> None:
    """Checkpoints need real processes: torch's Distributed Checkpoint runs one per rank."""
    if is_simulated():
        raise ValueError(
            f"{where} on ff.simulated_mesh: torch's Distributed Checkpoint writes and reads "
            f"with one real process per rank, and a simulation is one process playing every "
            f"rank. Run the code that checkpoints on real processes: torchrun "
            f"--nproc-per-node N, or ff.launch(fn, N) from a notebook (a simulated mesh is for "
            f"layouts, numerics and counts, not for files)."
        )


def save(path: str | os.PathLike[str], tree: Any) -> None:
    """Write ``tree`` (params, a :class:`TrainState`, any pytree) to the directory ``path``.

    The save is atomic: files go to a temporary directory next to ``path``, are fsynced and
    hashed into a commit marker, then renamed onto ``path``. A save killed at any point
    leaves the previous checkpoint at ``path`` loadable.

    Raises:
        CheckpointError: the directory cannot be written (read-only, full, ...), or ``path``
            holds a file or other files that a save would replace; on every rank, and the
            previous checkpoint at ``path`` is untouched.

    Example:
        >>> ff.checkpoint.save("ckpt/step_100", state)  # doctest: +SKIP
    """
    refuse_simulated("ff.checkpoint.save")
    keys, leaves, _ = _flatten(tree)
    state_dict = {k: v.to_dtensor() if isinstance(v, Sharded) else v for k, v in zip(keys, leaves)}
    _atomic.save_state_dict(path, state_dict)


def load(path: str | os.PathLike[str], like: Any, *, verify: bool = True) -> Any:
    """Read the checkpoint at ``path`` into the structure and layouts of ``like``.

    ``like`` is not modified: values are read into new buffers. ``Sharded`` leaves come back
    with ``like``'s spec and mesh (resharded as needed); other tensors and Python values come
    back as saved.

    A checkpoint written before an optimizer state recorded a field for reports (the
    learning rate of ``scale_by_learning_rate``, ``apply_if_finite``'s ``last_skipped``)
    lacks it: the loaded state keeps the template's value until its next update records
    one. Nothing but reports depends on these fields.

    With ``verify`` (the default) the commit marker must exist and every file must have its
    recorded size and CRC-32 before anything is read: the ranks split the hashing, so each
    reads about ``1/world`` of the checkpoint's bytes once more. ``verify=False`` reads a
    directory written by ``torch.distributed.checkpoint.save`` directly.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete (its save was killed) or
            corrupt (truncated, bytes changed).
        ValueError: if keys of ``like`` are missing from the checkpoint or have another
            global shape there (the message lists them).

    Example:
        >>> template = ff.TrainState.create(new_model.shard(), optimizer)  # doctest: +SKIP
        >>> state = ff.checkpoint.load("ckpt/step_100", template)  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor

    refuse_simulated("ff.checkpoint.load")
    keys, leaves, treedef, records = _flatten_with_records(like)
    if verify:
        path = _atomic.verify(path)
    try:
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    except Exception as e:  # a missing or truncated .metadata: OSError, UnpicklingError, ...
        raise _atomic.describe_error(path, e) from None
    kept = {k for k in records if k not in metadata}  # older checkpoints: the template's
    _check_template(os.fspath(path), keys, leaves, {**metadata, **dict.fromkeys(kept)})
    state_dict: dict[str, Any] = {}
    for key, leaf in zip(keys, leaves):
        if key in kept:
            continue
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
    _atomic.load_state_dict(path, state_dict)
    out = []
    for key, leaf in zip(keys, leaves):
        if key in kept:  # a copy: the template is never written through the loaded state
            out.append(leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)
            continue
        value = state_dict[key]
        out.append(Sharded.from_dtensor(value) if isinstance(leaf, Sharded) else value)
    return optree.tree_unflatten(treedef, out)


def _check_template(path: str, keys: list[str], leaves: list[Any], metadata: Any) -> None:
    """Refuse a template of another structure or shapes, naming every key that differs."""
    missing = [k for k in keys if k not in metadata]
    reshaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for key, leaf in zip(keys, leaves):
        saved = getattr(metadata.get(key), "size", None)
        tensor_like = isinstance(leaf, (Sharded, torch.Tensor)) and saved is not None
        if tensor_like and tuple(saved) != tuple(leaf.shape):
            reshaped.append((key, tuple(saved), tuple(leaf.shape)))
    if not missing and not reshaped:
        return
    extra = sorted(set(metadata) - set(keys))
    if reshaped:
        key, saved_shape, like_shape = reshaped[0]
        head = (
            f"checkpoint.load: {key!r} was saved with global shape {saved_shape} in {path!r}, "
            f"but the template has {like_shape}: the checkpoint is of another model."
        )
    else:
        head = (
            f"checkpoint.load: {missing[0]!r} is not in the checkpoint at {path!r}"
            f"{_close(missing[0], extra)}: the checkpoint is of another model or optimizer."
        )
    parts = []
    if len(reshaped) > 1 or (reshaped and missing):
        shown = "; ".join(f"{k!r} saved {a}, template {b}" for k, a, b in reshaped[:5])
        parts.append(f"{len(reshaped)} key(s) differ in shape: {shown}")
    if missing and (reshaped or len(missing) > 1):
        parts.append(f"{len(missing)} key(s) are not in the checkpoint: {missing[:5]}")
    if extra and missing:
        parts.append(f"the checkpoint has {len(extra)} key(s) the template lacks: {extra[:5]}")
    details = (" " + ". ".join(parts) + ".") if parts else ""
    raise ValueError(
        f"{head}{details} Build the template from the model configuration (and optimizer) "
        f"the checkpoint was saved with."
    )


def _close(key: str, keys: list[str]) -> str:
    import difflib

    found = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
    return f" (did you mean {found[0]!r}?)" if found else ""
