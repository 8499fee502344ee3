"""What the Hugging Face readers and writers share: names, aliases, units, dtypes, files.

Private: the public functions live in :mod:`.hf_load`, :mod:`.hf_export` and :mod:`.lora`.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..distributed import process
from ..distributed.axes import axis_names, axis_sizes, rank_at
from ..distributed.simulate import is_simulated
from ..fsdp.layout import unit_of as unit_of
from ..sharded import Sharded
from ..spec import format_mesh

Rename = Callable[[str], str] | Mapping[str, str] | None

# safetensors' dtype names (https://github.com/huggingface/safetensors, format.md).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def renamer(rename: Rename) -> Callable[[str], str]:
    """``rename`` as a function from the module's names to the checkpoint's names."""
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda name: table.get(name, name)
    if not callable(rename):
        raise TypeError(
            f"rename must map the module's parameter names to the checkpoint's names: a "
            f"function such as lambda name: 'model.' + name, or a dict; got {rename!r} "
            f"({type(rename).__name__})."
        )
    return rename


def aliases(module: nn.Module) -> dict[str, list[str]]:
    """``{first name: every name}`` of each parameter (tied ones have several names)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that ``module.state_dict()`` holds (the persistent ones), by name."""
    out: dict[str, torch.Tensor] = {}
    for path, m in module.named_modules():
        skip = getattr(m, "_non_persistent_buffers_set", set())
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in skip:
                out[f"{path}.{name}" if path else name] = b
    return out


def close_matches(key: str, keys: list[str]) -> str:
    found = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    return f"; close matches: {found}" if found else ""


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a checkpoint's ``src`` values may be loaded as ``dst`` (same kind or wider)."""
    if src == dst:
        return True
    if src.is_floating_point and dst.is_floating_point:
        return True
    return bool(torch.can_cast(src, dst))


def check_castable(what: str, key: str, where: str, src: torch.dtype, dst: torch.dtype) -> None:
    if not castable(src, dst):
        raise TypeError(
            f"{what}: {key!r} in {where} has dtype {src}, which cannot be cast to {dst} (the "
            f"model's parameter dtype) without losing its kind. Load it into a model whose "
            f"parameter has a compatible dtype, or convert the checkpoint."
        )


def check_params(what: str, sm: Any, params: Mapping[str, Any]) -> dict[str, list[str]]:
    """Refuse ``params`` that are not ``sm.shard()``-shaped for the module; return its aliases."""
    names = aliases(sm.module)
    missing = [n for n in names if n not in params]
    unexpected = [n for n in params if n not in names]
    if missing or unexpected:
        raise ValueError(
            f"{what}: params do not match {type(sm.module).__name__}'s parameters: missing "
            f"{missing[:5]}{close_matches(missing[0], list(params)) if missing else ''}, "
            f"unexpected {unexpected[:5]}. Pass the dict that sm.shard() or "
            f"ff.checkpoint.load_safetensors(sm, ...) returns (keys are the module's "
            f"named_parameters() names, tied parameters once)."
        )
    module_params = dict(sm.module.named_parameters())
    for name, value in params.items():
        if not isinstance(value, Sharded):
            raise TypeError(
                f"{what}: params[{name!r}] is a {type(value).__name__}, not a Sharded value; "
                f"pass the dict that sm.shard() returns."
            )
        want = tuple(module_params[name].shape)
        if tuple(value.global_shape) != want:
            raise ValueError(
                f"{what}: params[{name!r}] has global shape {value.global_shape} "
                f"({value.spec.trimmed()} on {format_mesh(axis_sizes(value.mesh))}), but "
                f"{type(sm.module).__name__}.{name} has shape {want}. Export the params of "
                f"this very model."
            )
    return names


def first_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: on a simulated mesh, rank 0's value of a per-rank tensor."""
    per_rank = getattr(t, "_local_tensors", None)
    if per_rank is None:
        return t
    return per_rank[min(per_rank)]


def is_writer(mesh: Any) -> bool:
    """Whether this process writes files: the rank at coordinate 0 (every simulated one)."""
    if is_simulated():
        return True
    return process.rank() == rank_at(mesh, dict.fromkeys(axis_names(mesh), 0))


def check_path_exists(what: str, path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        near = sorted(os.listdir(parent))[:8] if os.path.isdir(parent) else []
        raise ValueError(
            f"{what}: the checkpoint path {path!r} does not exist"
            + (f" ({parent!r} holds {near})" if near else "")
            + ". Pass the directory that save_pretrained or dcp.save wrote, or a file in it."
        )
    return path


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: readers never see a partial file."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path: str, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")

    write_atomic(path, write)
