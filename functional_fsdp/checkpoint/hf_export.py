"""Export sharded parameters as a plain checkpoint that ``from_pretrained`` loads.

:func:`export_safetensors` streams: it walks the units in order and gathers a few tensors at
a time (``ff.gather``, a collective every rank joins: a large tensor alone, small neighbours of
one unit together), and the writing rank appends their bytes to a safetensors file whose
header it wrote first (the shapes are known up front). So no rank ever holds more than its
shards plus about the largest tensor, however large the file. Files, index and
``config.json`` follow ``save_pretrained``'s layout; each is written under a temporary name
and renamed, so a reader never sees half a file.

:func:`full_state_dict` is the opposite trade: the whole state dict with every tied name and
the buffers, on every rank (Ψ per rank), for ``module.load_state_dict(sd, strict=True)``.

Example:
    >>> ff.checkpoint.export_safetensors(sm, params, "out")  # doctest: +SKIP
    >>> LlamaForCausalLM.from_pretrained("out")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..distributed.mesh import axis_names
from ..distributed.simulate import is_simulated
from ..resharding import gather
from ..sharded import Sharded
from ._common import (
    DTYPE_NAMES,
    Rename,
    aliases,
    check_params,
    first_value,
    is_writer,
    persistent_buffers,
    renamer,
    unit_of,
    write_atomic,
    write_json_atomic,
)
from .hf_load import INDEX_NAME, WEIGHTS_NAME

_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an export: its key, what to gather, and how to compute it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    unit: str  # tensors of one unit, next to each other, are gathered together
    needs: tuple[str, ...]  # parameter names to gather
    make: Callable[[dict[str, torch.Tensor]], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """``"5GB"``, ``"500MiB"`` or a number of bytes, as ``save_pretrained`` reads them."""
    if isinstance(size, int):
        return size
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    for suffix, scale in units.items():
        if size.upper().endswith(suffix) and size[: -len(suffix)].strip().isdigit():
            return int(size[: -len(suffix)]) * scale
    raise ValueError(f"max_shard_size={size!r}: write a number of bytes or e.g. '5GB', '500MiB'.")


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.dtype.is_floating_point else t.dtype


def plain_outputs(
    sm: Any,
    params: Mapping[str, Sharded],
    *,
    rename: Rename,
    dtype: torch.dtype | None,
    buffers: Mapping[str, torch.Tensor] | None,
) -> list[OutTensor]:
    """The model's state dict as ``save_pretrained`` writes it: a tied parameter under its
    first name only (``from_pretrained`` ties the others), persistent buffers included."""
    rename_fn = renamer(rename)
    first = {a: names[0] for names in aliases(sm.module).values() for a in names}
    kept = persistent_buffers(sm.module)
    outs = []
    for key, value in sm.module.state_dict(keep_vars=True).items():
        if key in first:
            if first[key] != key:
                continue
            p = params[key]
            outs.append(
                OutTensor(
                    rename_fn(key),
                    p.global_shape,
                    _cast(p.local, dtype),
                    unit_of(key, sm.units),
                    (key,),
                    lambda g, k=key: g[k],
                )
            )
        elif key in kept:
            b = buffers[key] if buffers is not None and key in buffers else value
            if b.is_meta:
                raise ValueError(
                    f"export: the buffer {key!r} (shape {tuple(b.shape)}) is on the meta device, "
                    f"so it has no value to write. Pass buffers={{{key!r}: tensor, ...}}."
                )
            outs.append(
                OutTensor(rename_fn(key), tuple(b.shape), _cast(b, dtype), "", (), lambda g, t=b: t)
            )
    return outs


def _header(outs: list[OutTensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for out in outs:
        header[out.key] = {
            "dtype": DTYPE_NAMES[out.dtype],
            "shape": list(out.shape),
            "data_offsets": [offset, offset + out.nbytes],
        }
        offset += out.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as safetensors does
    return len(raw).to_bytes(8, "little") + raw


def _plan_files(outs: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    files: list[list[OutTensor]] = [[]]
    size = 0
    for out in outs:
        if files[-1] and size + out.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(out)
        size += out.nbytes
    return files


def _gather_groups(outs: list[OutTensor]) -> list[list[OutTensor]]:
    """Consecutive tensors of one unit that are gathered with one collective.

    A tensor of at least a quarter of the largest tensor's bytes is gathered alone: one
    tensor's gather returns a view of the collective's output, so it costs its own bytes.
    Smaller ones are gathered together up to that size (their outputs are copies out of the
    collective's buffer: about 2.5 times the group's bytes). Either way a rank holds at most
    about the largest tensor beyond its shards, not a whole unit.
    """
    budget = max((o.nbytes for o in outs), default=0) // 4
    groups: list[list[OutTensor]] = []
    size = 0
    for out in outs:
        alone = out.nbytes >= budget
        joins = (
            groups
            and not alone
            and groups[-1][-1].unit == out.unit
            and groups[-1][-1].nbytes < budget
            and size + out.nbytes <= budget
        )
        if joins:
            groups[-1].append(out)
            size += out.nbytes
        else:
            groups.append([out])
            size = out.nbytes
    return groups


class _Writer:
    """The writing rank's side of a streamed export; remembers the first error."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.error: BaseException | None = None
        self.handle: BinaryIO | None = None
        self.tmp = ""

    def run(self, fn: Callable[[], None]) -> None:
        if self.active and self.error is None:
            try:
                fn()
            except Exception as e:  # keep joining the gathers; every rank raises at the end
                self.error = e
                self.abort()

    def open(self, path: str, header: bytes) -> None:
        self.tmp = os.path.join(
            os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}"
        )
        self.handle = open(self.tmp, "wb")  # noqa: SIM115 (closed in close/abort)
        self.handle.write(header)

    def write(self, t: torch.Tensor) -> None:
        if self.handle is not None and t.numel():
            self.handle.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

    def close(self, path: str) -> None:
        if self.handle is None:
            return
        self.handle.close()
        self.handle = None
        os.replace(self.tmp, path)

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.tmp and os.path.exists(self.tmp):
            os.remove(self.tmp)


def _write_group(
    params: Mapping[str, Sharded], group: list[OutTensor], writer: _Writer, what: str
) -> None:
    """Gather what ``group`` needs (every rank), compute its tensors and write them."""
    needs = list(dict.fromkeys(k for out in group for k in out.needs))
    gathered = gather({k: params[k] for k in needs}) if needs else {}
    for out in group:
        value = first_value(out.make(gathered)).detach().to("cpu", out.dtype)
        if tuple(value.shape) != out.shape:
            raise ValueError(
                f"{what}: {out.key!r} came out with shape {tuple(value.shape)}, but "
                f"{out.shape} was planned; this is a bug in the export's recipe."
            )
        writer.run(lambda v=value: writer.write(v))


def _agree(mesh: Any, failed: bool) -> bool:
    """Whether any rank failed (a tiny all-reduce; also keeps ranks from returning early)."""
    if is_simulated():
        return failed
    from ..distributed.collectives import all_reduce

    flag = torch.tensor([1.0 if failed else 0.0], device=mesh.device_type)
    return bool(all_reduce(flag, mesh, axis_names(mesh)).item() > 0)


def write_streamed(
    sm: Any,
    params: Mapping[str, Sharded],
    outs: list[OutTensor],
    path: str,
    *,
    max_shard_size: int | str,
    what: str,
    extra: Callable[[str], None] | None = None,
) -> None:
    """Write ``outs`` as safetensors shards (+ index) under ``path``, a few tensors per gather."""
    max_bytes = parse_size(max_shard_size)
    files = _plan_files(outs, max_bytes)
    n = len(files)
    names = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    writer = _Writer(is_writer(sm.mesh))
    writer.run(lambda: os.makedirs(path, exist_ok=True))
    for name, file_outs in zip(names, files):
        target = os.path.join(path, name)
        writer.run(lambda t=target, o=file_outs: writer.open(t, _header(o)))
        for group in _gather_groups(file_outs):
            _write_group(params, group, writer, what)  # its tensors are freed on return
        writer.run(lambda t=target: writer.close(t))

    def finish() -> None:
        stale = {WEIGHTS_NAME, INDEX_NAME} | {
            f for f in os.listdir(path) if _SHARD_FILE.fullmatch(f)
        }
        if n > 1:
            weight_map = {out.key: name for name, fo in zip(names, files) for out in fo}
            index = {
                "metadata": {
                    "total_parameters": sum(math.prod(o.shape) for o in outs),
                    "total_size": sum(o.nbytes for o in outs),
                },
                "weight_map": dict(sorted(weight_map.items())),
            }
            write_json_atomic(os.path.join(path, INDEX_NAME), index)
        for f in stale - set(names) - ({INDEX_NAME} if n > 1 else set()):
            if os.path.exists(os.path.join(path, f)):
                os.remove(os.path.join(path, f))
        if extra is not None:
            extra(path)

    writer.run(finish)
    if _agree(sm.mesh, writer.error is not None):
        if writer.error is not None:
            raise writer.error
        raise RuntimeError(
            f"{what}: writing {path!r} failed on the writing rank (global rank "
            f"{int(sm.mesh.mesh.flatten()[0])}); its error names the cause."
        )


def write_configs(module: Any, path: str, config: Any, dtype: torch.dtype | None) -> None:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them."""
    if config is False:
        return
    if config is None:
        config = getattr(module, "config", None)
        if not hasattr(config, "to_json_file"):
            return
    if isinstance(config, Mapping):
        write_json_atomic(os.path.join(path, "config.json"), dict(config))
        return
    config = copy.deepcopy(config)  # never change the user's config
    if hasattr(module, "can_generate"):  # a transformers model
        config.architectures = [type(module).__name__]
        floating = [p.dtype for p in module.parameters() if p.dtype.is_floating_point]
        main = dtype or (floating[0] if floating else None)
        if main is not None:
            config.dtype = str(main).split(".")[1]
    write_atomic(os.path.join(path, "config.json"), lambda tmp: config.to_json_file(tmp))
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", lambda: False)
    if generation is not None and can_generate():
        write_atomic(
            os.path.join(path, "generation_config.json"),
            lambda tmp: generation.to_json_file(tmp),
        )


def export_safetensors(
    sm: Any,
    params: Mapping[str, Sharded],
    path: str | os.PathLike[str],
    *,
    rename: Rename = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    max_shard_size: int | str = "50GB",
) -> None:
    """Write ``params`` as a plain safetensors checkpoint, gathering a few tensors at a time.

    The directory looks like ``save_pretrained``'s: ``model.safetensors`` (or
    ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json`` when the
    tensors exceed ``max_shard_size``), plus ``config.json`` and ``generation_config.json``
    when the module is a transformers model. A tied parameter is written once, under its first
    name (``model.embed_tokens.weight``, not ``lm_head.weight``), as ``save_pretrained`` does;
    ``from_pretrained`` ties it again. Persistent buffers are written too.

    A collective call: every rank calls it; the first rank of the mesh writes. Peak memory per
    rank is its shards plus about the largest tensor (never a whole unit). Files appear atomically (written under a temporary name,
    then renamed); shard files of an earlier export that this one does not use are removed.

    Args:
        sm: the :class:`~functional_fsdp.FSDP` description (module, mesh, units).
        params: ``{name: Sharded}`` as ``sm.shard()`` returns it (e.g. trained params).
        path: the output directory (created if needed).
        rename: maps the module's names to the names to write (a function or a dict).
        dtype: cast floating tensors to this dtype (default: as they are).
        config: the config to write as ``config.json``: ``None`` takes ``sm.module.config``
            when it has one, ``False`` writes none, a dict is written as JSON.
        buffers: values for the module's buffers (default: the module's own).
        max_shard_size: the largest file, in bytes or as ``"5GB"``/``"500MiB"``.

    Raises:
        ValueError: ``params`` miss or add a parameter, or one has another shape than the
            module's (the message names it).

    Example:
        >>> import tempfile, torch, functional_fsdp as ff
        >>> from safetensors.torch import load_file
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
        >>> folder = tempfile.mkdtemp()
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sm = ff.fsdp(model, mesh)
        ...     ff.checkpoint.export_safetensors(sm, sm.shard(), folder)
        >>> torch.equal(load_file(folder + "/model.safetensors")["1.weight"], model[1].weight)
        True
    """
    what = "export_safetensors"
    check_params(what, sm, params)
    path = os.fspath(path)
    outs = plain_outputs(sm, params, rename=rename, dtype=dtype, buffers=buffers)
    write_streamed(
        sm,
        params,
        outs,
        path,
        max_shard_size=max_shard_size,
        what=what,
        extra=lambda p: write_configs(sm.module, p, config, dtype),
    )


def full_state_dict(
    sm: Any,
    params: Mapping[str, Sharded],
    *,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The module's complete state dict from sharded ``params``: every name, every buffer.

    Unlike :func:`export_safetensors`, tied parameters appear under every name (all aliases
    of one tensor, as in ``module.state_dict()``), so ``module.load_state_dict(sd,
    strict=True)`` works. It gathers everything at once and returns it on every rank: it
    holds the whole model (Ψ) per rank. A collective call.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from functional_fsdp.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=1, vocab_size=16, n_embd=8, n_head=2))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sm = ff.fsdp(model, mesh)
        ...     sd = ff.checkpoint.full_state_dict(sm, sm.shard())
        >>> GPT(model.cfg).load_state_dict(sd, strict=True)
        <All keys matched successfully>
    """
    check_params("full_state_dict", sm, params)
    gathered = {k: first_value(v) for k, v in gather(dict(params)).items()}
    first = {a: names[0] for names in aliases(sm.module).values() for a in names}
    kept = persistent_buffers(sm.module)
    out = {}
    for key, value in sm.module.state_dict(keep_vars=True).items():
        if key in first:
            out[key] = gathered[first[key]]
        elif key in kept and buffers is not None and key in buffers:
            out[key] = buffers[key]
        else:
            out[key] = value.detach()
    return out
