"""Load pretrained weights shard by shard: each rank reads only the rows it owns.

Two sources: safetensors files as ``save_pretrained`` writes them (one
``model.safetensors``, or shards listed in ``model.safetensors.index.json``), and DCP
checkpoints of a plain or FSDP2 state dict (``dcp.save(get_model_state_dict(model))``,
torchtitan). The result is what ``sm.shard()`` returns, ``{name: Sharded}``, without any rank
ever materialising the model: peak memory per rank is about Ψ/N plus the largest tensor, and
the module itself may live on the ``meta`` device.

Names: ``rename`` maps the module's parameter names to the checkpoint's keys (a function or a
dict; names it leaves out stay as they are). A tied parameter is found under any of its names
(e.g. ``lm_head.weight`` or ``model.embed_tokens.weight``). Checkpoint keys the module does not
use are ignored, as ``from_pretrained`` does.

Example:
    >>> sm = ff.fsdp(model, mesh)  # doctest: +SKIP
    >>> params = ff.checkpoint.load_safetensors(sm, "llama-dir")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from .._partition import mark_frozen
from ..distributed.mesh import axis_sizes
from ..distributed.simulate import per_coordinate
from ..formats import stored_param
from ..sharded import Sharded
from ..spec import Layout
from ._common import (
    SAFETENSORS_DTYPES,
    Rename,
    aliases,
    check_castable,
    check_path_exists,
    close_matches,
    renamer,
)

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie in a safetensors file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _read_header(file: str) -> dict[str, _Stored]:
    """The tensors of one safetensors file, from its header alone (8-byte length + JSON)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file!r} is not a safetensors file ({e}).") from None
    base = 8 + size
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise TypeError(
                f"{key!r} in {file!r} has safetensors dtype {info['dtype']!r}, which this loader "
                f"does not read (it reads {sorted(SAFETENSORS_DTYPES)})."
            )
        start, end = info["data_offsets"]
        out[key] = _Stored(
            file, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + end
        )
    return out


def safetensors_index(path: str | os.PathLike[str], what: str) -> tuple[dict[str, _Stored], str]:
    """Every tensor of the checkpoint at ``path`` (a file, an index, or a directory).

    Returns the tensors by key and a description of the files for error messages.
    """
    path = check_path_exists(what, path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            path = os.path.join(path, INDEX_NAME)
        elif os.path.exists(os.path.join(path, WEIGHTS_NAME)):
            path = os.path.join(path, WEIGHTS_NAME)
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(
                    f"{what}: the directory {path!r} has no {INDEX_NAME}, no {WEIGHTS_NAME} and "
                    f"no other .safetensors file (it holds {sorted(os.listdir(path))[:8]}). Pass "
                    f"the directory that save_pretrained wrote."
                )
            stored: dict[str, _Stored] = {}
            for name in files:
                stored.update(_read_header(os.path.join(path, name)))
            return stored, f"{path!r} ({', '.join(files)})"
    if path.endswith(".json"):
        with open(path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        folder = os.path.dirname(path)
        stored = {}
        for name in sorted(set(weight_map.values())):
            file = os.path.join(folder, name)
            if not os.path.exists(file):
                raise ValueError(
                    f"{what}: the index {path!r} lists {name!r} (for e.g. "
                    f"{next(k for k, v in weight_map.items() if v == name)!r}), but that file "
                    f"does not exist. Copy every shard file next to the index."
                )
            stored.update(_read_header(file))
        return stored, f"the shards of {path!r}"
    return _read_header(path), repr(path)


def _find(what: str, names: list[str], rename: Callable[[str], str], keys: Any, where: str) -> str:
    for name in names:
        key = rename(name)
        if key in keys:
            return key
    wanted = rename(names[0])
    tied = f" (or its tied names {[rename(n) for n in names[1:]]})" if len(names) > 1 else ""
    raise ValueError(
        f"{what}: the key {wanted!r}{tied} for the model's parameter {names[0]!r} is missing "
        f"from {where}{close_matches(wanted, list(keys))}. Pass rename= mapping the model's "
        f"names to the checkpoint's (e.g. lambda name: 'model.' + name), or load a checkpoint "
        f"of this model."
    )


def _target(p: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.dtype, torch.device]:
    want = dtype if dtype is not None and p.dtype.is_floating_point else p.dtype
    return want, (torch.device("cpu") if p.device.type == "meta" else p.device)


def _read_into(f: BinaryIO, buffer: torch.Tensor, offset: int, file: str) -> None:
    view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{file!r} ends early: it is truncated or not a safetensors file.")
        done += n


def _read_rows(f: BinaryIO, stored: _Stored, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of dim 0 of a stored tensor, in its own dtype (a scalar whole)."""
    if not stored.shape:
        raw = torch.empty((), dtype=stored.dtype)
        _read_into(f, raw, stored.start, stored.file)
        return raw
    row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
    raw = torch.empty((stop - start, *stored.shape[1:]), dtype=stored.dtype)
    if raw.numel():
        _read_into(f, raw, stored.start + start * row_bytes, stored.file)
    return raw


def _read_block(
    f: BinaryIO,
    stored: _Stored,
    layout: Layout,
    coord: dict[str, int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``coord``'s padded block, reading only the rows of dim 0 that it owns."""
    slices, pads = layout.owned(coord)
    shape = stored.shape
    if not shape:
        raw = torch.empty((), dtype=stored.dtype)
        _read_into(f, raw, stored.start, stored.file)
        return raw.to(device=device, dtype=dtype)
    rows = slices[0]
    row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
    raw = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=stored.dtype)
    if raw.numel():
        _read_into(f, raw, stored.start + rows.start * row_bytes, stored.file)
    piece = raw[(slice(None), *slices[1:])]
    if not any(pads) and piece.dtype == dtype and piece.shape == raw.shape:
        return raw.to(device)  # the rows read are the block: no copy
    block = torch.zeros(layout.local_shape, dtype=dtype, device=device)
    block[tuple(slice(0, s.stop - s.start) for s in slices)] = piece
    return block


def load_safetensors(
    sm: Any,
    path: str | os.PathLike[str],
    *,
    rename: Rename = None,
    dtype: torch.dtype | None = None,
    names: Collection[str] | None = None,
) -> dict[str, Sharded]:
    """Read a safetensors checkpoint into ``sm``'s sharded layout, each rank its own rows.

    Every rank reads only the byte range of the rows it owns (plain file reads, no mmap, so
    untouched rows never enter the process), so peak memory per rank is about Ψ/N plus one
    tensor's rows, never Ψ. ``sm.module`` may be on the ``meta`` device; values then land on
    the CPU (or on the module's device otherwise). No communication.

    Args:
        sm: the :class:`~functional_fsdp.FSDP` description (module, mesh, specs).
        path: a directory written by ``save_pretrained`` (``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards), an index file, or one
            ``.safetensors`` file.
        rename: maps the module's parameter names to the checkpoint's keys: a function
            (``lambda name: "model." + name``) or a dict (missing names stay as they are).
        dtype: the dtype of floating parameters (default: the module parameter's dtype).
        names: read only these parameters (default: all), e.g. the frozen base of a LoRA
            model whose adapters are not in the checkpoint; combine the result with the
            others (``{**initialised, **loaded}``).

    Returns:
        ``{name: Sharded}`` with the keys and layouts of ``sm.shard()`` (those in ``names``).

    Raises:
        ValueError: the path does not exist; a key is missing (named, with the files and close
            matches) or has another shape than the module's parameter.
        TypeError: a checkpoint dtype cannot be cast to the parameter's dtype.

    Example:
        >>> import tempfile, torch, functional_fsdp as ff
        >>> from safetensors.torch import save_file
        >>> model = torch.nn.Linear(3, 5)
        >>> folder = tempfile.mkdtemp()
        >>> save_file({"weight": torch.ones(5, 3), "bias": torch.zeros(5)}, folder + "/model.safetensors")
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     params = ff.checkpoint.load_safetensors(ff.fsdp(model, mesh), folder)
        ...     params["weight"]
        Sharded(shape=(5, 3), dtype=torch.float32, spec=P('dp'), mesh=Mesh(dp=2), local=(3, 3))
    """
    what = "load_safetensors"
    stored, where = safetensors_index(path, what)
    rename_fn = renamer(rename)
    module_params = dict(sm.module.named_parameters())
    specs = sm.param_specs()
    sizes = axis_sizes(sm.mesh)
    plan = []
    wanted = None if names is None else set(names)
    unknown = sorted(wanted - set(module_params)) if wanted is not None else []
    if unknown:
        raise ValueError(
            f"{what}: names= lists {unknown[:5]}, which are not parameters of "
            f"{type(sm.module).__name__} (names look like {list(module_params)[:3]})."
        )
    quantized = []  # a quantized base's layers: read unquantized, quantized shard-wise
    for name, alias_names in aliases(sm.module).items():
        if wanted is not None and name not in wanted:
            continue
        found = stored_param(sm.module, name)
        if found is not None and not found.is_weight:
            continue  # the quantization state is made with its weight
        key = _find(what, alias_names, rename_fn, stored, where)
        entry, p = stored[key], module_params[name]
        if found is not None:
            shape = tuple(found.format.dense(found.layer)[0])
            if entry.shape != shape and not found.format.saved_quantized(key, stored):
                raise ValueError(
                    f"{what}: {key!r} in {entry.file!r} has shape {entry.shape}, but the model's "
                    f"quantized layer {name!r} was {shape}. Check rename= and that the "
                    f"checkpoint belongs to this model's config."
                )
            quantized.append((name, key, found.format, found.layer))
            continue
        if entry.shape != tuple(p.shape):
            raise ValueError(
                f"{what}: {key!r} in {entry.file!r} has shape {entry.shape}, but the model's "
                f"parameter {name!r} has shape {tuple(p.shape)}. Check rename= and that the "
                f"checkpoint belongs to this model's config."
            )
        want, device = _target(p, dtype)
        check_castable(what, key, repr(entry.file), entry.dtype, want)
        plan.append((name, entry, Layout.make(entry.shape, specs[name], sizes), want, device))
    out: dict[str, Sharded] = {}
    files: dict[str, BinaryIO] = {}
    try:
        for name, entry, layout, want, device in plan:
            if entry.file not in files:
                files[entry.file] = open(entry.file, "rb")  # noqa: SIM115 (closed below)
            f = files[entry.file]
            local = per_coordinate(
                sm.mesh,
                lambda c, e=entry, lay=layout, w=want, d=device: _read_block(f, e, lay, c, w, d),
            )
            out[name] = Sharded(local, entry.shape, layout.spec, sm.mesh)
        for name, key, fmt, layer in quantized:

            def read(k: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
                """Rows ``start:stop`` (default: all) of the stored tensor ``k``."""
                e = stored[k]
                if e.file not in files:
                    files[e.file] = open(e.file, "rb")  # noqa: SIM115 (closed below)
                rows = e.shape[0] if e.shape else 0
                return _read_rows(files[e.file], e, start or 0, rows if stop is None else stop)

            out.update(fmt.load(sm, name, layer, key, set(stored), read, dtype))
    finally:
        for f in files.values():
            f.close()
    return mark_frozen(out, sm)


def load_dcp_state_dict(
    sm: Any,
    path: str | os.PathLike[str],
    *,
    rename: Rename = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Sharded]:
    """Read a DCP checkpoint of a model state dict into ``sm``'s sharded layout.

    For checkpoints written by ``torch.distributed.checkpoint.save`` of a plain state dict,
    of torch FSDP2's ``get_model_state_dict``, or by torchtitan (whose keys may carry a
    prefix: use ``rename``). DCP's planner reads, for every rank, only the saved chunks that
    overlap the rows it owns. A collective call: every rank of ``sm.mesh`` calls it.

    Args:
        sm: the :class:`~functional_fsdp.FSDP` description.
        path: the checkpoint directory (it holds ``.metadata``).
        rename: maps the module's parameter names to the checkpoint's keys (function or dict).
        dtype: the dtype of floating parameters (default: the module parameter's dtype).

    Returns:
        ``{name: Sharded}`` with the keys and layouts of ``sm.shard()``.

    Raises:
        ValueError: the path is not a DCP checkpoint; a key is missing or has another shape.
        TypeError: a checkpoint dtype cannot be cast to the parameter's dtype.

    Example:
        >>> params = ff.checkpoint.load_dcp_state_dict(sm, "fsdp2-ckpt")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    what = "load_dcp_state_dict"
    path = check_path_exists(what, path)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(
            f"{what}: {path!r} is not a DCP checkpoint (it has no .metadata file). Pass the "
            f"directory given to torch.distributed.checkpoint.save as checkpoint_id."
        )
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    where = f"the DCP checkpoint {path!r}"
    rename_fn = renamer(rename)
    module_params = dict(sm.module.named_parameters())
    specs = sm.param_specs()
    sizes = axis_sizes(sm.mesh)
    state_dict: dict[str, Any] = {}
    names_by_key: dict[str, str] = {}
    for name, names in aliases(sm.module).items():
        key = _find(what, names, rename_fn, metadata, where)
        meta, p = metadata[key], module_params[name]
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{what}: {key!r} in {where} is not a tensor ({type(meta).__name__}).")
        if tuple(meta.size) != tuple(p.shape):
            raise ValueError(
                f"{what}: {key!r} in {where} has shape {tuple(meta.size)}, but the model's "
                f"parameter {name!r} has shape {tuple(p.shape)}. Check rename= and that the "
                f"checkpoint belongs to this model's config."
            )
        want, device = _target(p, dtype)
        check_castable(what, key, where, meta.properties.dtype, want)
        layout = Layout.make(tuple(p.shape), specs[name], sizes)
        local = per_coordinate(
            sm.mesh,
            lambda c, lay=layout, w=want, d=device: torch.zeros(lay.local_shape, dtype=w, device=d),
        )
        state_dict[key] = Sharded(local, layout.global_shape, layout.spec, sm.mesh).to_dtensor()
        names_by_key[key] = name
    dcp.load(state_dict, checkpoint_id=path)
    return {names_by_key[k]: Sharded.from_dtensor(v) for k, v in state_dict.items()}
