"""Formats of frozen weights: a quantized base is stored, sharded and gathered packed.

A format is one adapter (:class:`Format`) in one file: it recognises its layers, turns one into
a *storage copy* (a shallow copy of the layer whose weight is a plain tensor of whole
quantization blocks, one block per row, with the block's scale in the same row, and whose
forward dequantizes inside the unit), dequantizes for export, and quantizes rows for
shard-wise loading. The engine sees ordinary frozen integer parameters: it shards them at rest
over the data axes (rows, so blocks and their scales stay together), all-gathers the packed
bytes per unit and frees them after use; nothing else in the engine knows about formats.

The rest of the library asks a format only through :class:`Format` and :class:`Stored` (which
parameter of a storage copy is its weight, the full weight's shape and dtype, whether a
checkpoint holds it already quantized, its dequantization): no file outside this package
knows a format's parameter names, state or serialisation.

Registered: :mod:`~functional_fsdp.formats.bnb4` (bitsandbytes NF4/FP4, with or without double
quantization). A second format is one more file and one line in ``_formats``. torchao's
``NF4Tensor`` (torchtune's QLoRA) would be one: torchao 0.18.0 installs from PyPI, and its
``to_nf4``/``linear_nf4`` quantize, dequantize and run forward and backward on CPU with torch
2.13 (checked outside this repository's environment). It is not added yet: it is a tensor
subclass built with ``_make_wrapper_subclass``, so its storage copy must rebuild the weight
from plain gathered tensors without constructing the subclass inside a ``torch.func``
transform (what broke bitsandbytes' ``Params4bit``); its double quantization needs the
mean of all of a tensor's scalers (a collective, as for bitsandbytes) and a scaler count
divisible by 256 per tensor; and no model in this repository's dependencies (torchtune is
not one) holds ``NF4Tensor`` weights, so the tests would have to build one by hand. That is
a file of the size of ``bnb4.py`` with its own tests, not a cheap addition.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from .._modules import shallow_copy as shallow_copy


class Format(Protocol):
    """What a format adapter provides (see :mod:`functional_fsdp.formats.bnb4`)."""

    name: str

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is a layer of this format, quantized and ready."""
        ...

    def refuse(self, module: nn.Module, path: str) -> None:
        """Raise a clear error for a layer of this family that is not supported."""
        ...

    def dense(self, module: nn.Module) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype of the full weight that storage copy ``module`` dequantizes to
        (what a checkpoint holds unquantized, what an export writes)."""
        ...

    def saved_quantized(self, key: str, keys: Collection[str]) -> bool:
        """Whether a checkpoint with ``keys`` holds the weight ``key`` already quantized
        (this format's serialisation) rather than unquantized."""
        ...

    def replicated(self, module: nn.Module) -> tuple[torch.Tensor, ...]:
        """What storage copy ``module`` holds whole on every rank besides its parameters
        (code tables): part of its bytes at rest (see :func:`replicated_bytes`)."""
        ...

    def storage(self, module: nn.Module, path: str) -> nn.Module:
        """A shallow copy of ``module`` (at ``path``, for errors) whose weight holds whole
        blocks, one per row. Never changes ``module``."""
        ...

    def load(
        self,
        sm: Any,
        name: str,
        module: nn.Module,
        key: str,
        keys: Collection[str],
        read: Callable[..., torch.Tensor],
        dtype: torch.dtype | None,
    ) -> dict[str, Any]:
        """``{name: Sharded, ...}``: the layer's parameters read shard-wise from a checkpoint
        (``key`` its weight's key among ``keys``; ``read(key, start, stop)`` reads rows of a
        stored tensor): quantized by each rank from an unquantized weight (in ``dtype``,
        default the layer's), or read as saved quantized. A collective call."""
        ...

    def dequantize(self, module: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The full weight (``module`` a storage copy, ``params`` its gathered parameters
        by attribute name, e.g. ``{"weight": rows, "weight_nested": ...}``)."""
        ...


def _formats() -> list[Format]:
    from . import bnb4

    return [bnb4.FORMAT]


def is_stored(module: nn.Module) -> bool:
    """Whether ``module`` is a storage copy made by a format (its weight is packed rows)."""
    return getattr(module, "_ff_format", None) is not None


class Stored(NamedTuple):
    """A parameter of a storage copy. The copy's ``weight`` is the packed rows; its other
    parameters (if any) are quantization state, loaded, dequantized and exported with it."""

    format: Format
    layer: nn.Module  # the storage copy
    attr: str  # the parameter's attribute on it

    @property
    def is_weight(self) -> bool:
        return self.attr == "weight"

    def names(self, name: str) -> tuple[str, ...]:
        """All the copy's parameter names, weight first, from ``name`` (one of them)."""
        prefix = name[: len(name) - len(self.attr)]
        attrs = sorted(a for a, p in self.layer._parameters.items() if p is not None)
        return tuple(prefix + a for a in sorted(attrs, key=lambda a: a != "weight"))

    def dequantize(self, name: str, gathered: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full weight from ``gathered`` (by parameter name, holding :meth:`names`)."""
        prefix = name[: len(name) - len(self.attr)]
        mine = {n[len(prefix) :]: gathered[n] for n in self.names(name) if n in gathered}
        return self.format.dequantize(self.layer, mine)


def stored_param(module: nn.Module, name: str) -> Stored | None:
    """:class:`Stored` when parameter ``name`` of ``module`` belongs to a storage copy (its
    packed weight or quantization state); else ``None``."""
    path, _, attr = name.rpartition(".")
    try:
        layer = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    fmt = getattr(layer, "_ff_format", None)
    return None if fmt is None else Stored(fmt, layer, attr)


def replicated_bytes(module: nn.Module) -> int:
    """Bytes every rank holds whole for the storage copies in ``module`` besides their
    parameters (each tensor once: layers may share a code table).

    Example:
        >>> import torch
        >>> replicated_bytes(torch.nn.Linear(2, 2))  # nothing quantized
        0
    """
    seen: dict[int, int] = {}
    for m in module.modules():
        fmt = getattr(m, "_ff_format", None)
        if fmt is not None:
            for t in fmt.replicated(m):
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def quantized_layers(module: nn.Module) -> dict[str, Format]:
    """``{path: format}`` of the quantized layers of ``module`` (storage copies included)."""
    found: dict[str, Format] = {}
    formats = _formats()
    for path, m in module.named_modules():
        fmt = getattr(m, "_ff_format", None)
        if fmt is not None:
            found[path] = fmt
            continue
        for f in formats:
            f.refuse(m, path)
            if f.matches(m):
                found[path] = f
    return found


def storage_view(module: nn.Module, wrappers: Sequence[tuple[str, Any]] = ()) -> nn.Module:
    """``module`` itself when it has no quantized layer; otherwise a shallow copy of its tree
    in which every quantized layer is its format's storage copy (the user's module is never
    changed: parameters, buffers and unquantized modules are shared, only the module objects
    on the way to a quantized layer are copied). The copies remember their originals:
    :func:`sync_view` brings them up to date with what was set on the user's modules since.

    Raises:
        ValueError: if a wrapper (a tensor-parallel style) targets a quantized layer, or a
            layer of a quantized family is not supported (e.g. 8-bit).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> storage_view(model) is model  # nothing quantized
        True
    """
    layers = {p: f for p, f in quantized_layers(module).items() if not is_stored(_get(module, p))}
    for path, _ in wrappers:
        for q in quantized_layers(module):
            if path == q or path.startswith(q + ".") or (path and q.startswith(path + ".")):
                raise ValueError(
                    f"tensor parallelism over a 4-bit layer is not supported: {q!r} is "
                    f"quantized ({type(_get(module, q)).__name__}) and a tensor-parallel style "
                    f"targets {path!r}. Leave the quantized layers out of the tensor-parallel "
                    f"plan (shard them over the data axes only), or load the base unquantized."
                )
    if not layers:
        return module
    copies: dict[str, nn.Module] = {}
    for path, fmt in layers.items():
        copies[path] = fmt.storage(_get(module, path), path)
    links: list[_Link] = []
    view = _rebuild(module, "", copies, links)
    view.__dict__["_ff_links"] = _Links(links)
    return view


class _Links(tuple):  # type: ignore[type-arg]
    """A view's :class:`_Link` s. A deep copy of the view (e.g. ``ff.init_sharded``'s private
    copy) is no view of the user's module: it gets none (and copies no original)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Links:
        return _Links()


class _Link(NamedTuple):
    """A copied module of a storage view, its original, and the original's state (its
    attributes but children, parameters and buffers) as last copied to it."""

    copy: nn.Module
    original: nn.Module
    seen: dict[str, Any]


_STRUCTURE = frozenset({"_modules", "_parameters", "_buffers"})
_MISSING = object()


def _state(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.__dict__.items() if k not in _STRUCTURE}


def sync_view(module: nn.Module) -> None:
    """Bring a storage view's copied modules up to date with the user's modules: every
    attribute (``training``, peft's disabled and active adapters, hooks, any attribute a
    forward reads) that changed on the user's module since the view last read it is copied
    to the view (children, parameters and buffers stay the view's). What was set on the view
    itself (``sm.module.eval()``) stays, unless the user's module changed it since. Nothing
    for a module that is not a storage view; ``ff.fsdp``'s ``apply`` calls it at every call.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> sync_view(model)  # nothing quantized: no view, nothing to do
    """
    for copy, original, seen in module.__dict__.get("_ff_links", ()):
        now, mine = original.__dict__, copy.__dict__
        stored = is_stored(copy)
        for k, v in now.items():
            if k in _STRUCTURE or seen.get(k, _MISSING) is v:
                continue
            seen[k] = v
            if k.startswith("_ff_") or (stored and k in ("forward", "_is_hf_initialized")):
                continue  # the storage copy's own
            if k == "forward" and isinstance(v, types.MethodType) and v.__self__ is original:
                v = types.MethodType(v.__func__, copy)  # as shallow_copy binds it
            mine[k] = v
        for k in [k for k in seen if k not in now]:
            del seen[k]
            if not k.startswith("_ff_") and not (stored and k == "forward"):
                mine.pop(k, None)


def _get(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def _rebuild(
    module: nn.Module, path: str, copies: dict[str, nn.Module], links: list[_Link]
) -> nn.Module:
    """A copy of ``module`` with the modules at ``copies``' paths replaced (shared modules
    are copied once per path; modules on no replaced path are shared); each copy and its
    original are added to ``links`` (for :func:`sync_view`)."""
    if path in copies:
        c = copies[path]
        links.append(_Link(c, module, _state(module)))
        return c
    prefix = path + "." if path else ""
    if not any(p.startswith(prefix) for p in copies):
        return module
    c = shallow_copy(module)
    links.append(_Link(c, module, _state(module)))
    for name, child in module._modules.items():
        if child is not None:
            c._modules[name] = _rebuild(child, prefix + name, copies, links)
    return c


__all__ = [
    "Format",
    "Stored",
    "is_stored",
    "quantized_layers",
    "replicated_bytes",
    "shallow_copy",
    "storage_view",
    "stored_param",
    "sync_view",
]
