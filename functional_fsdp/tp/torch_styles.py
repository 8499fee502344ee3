"""torch's tensor-parallel styles, read as this library's styles.

A plan written for ``torch.distributed.tensor.parallel.parallelize_module`` (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``, ``PrepareModuleOutput``,
``PrepareModuleInputOutput``; a plan that is one style, a ``{path: style}`` dict, or nested
dicts) is translated into ``{module path: Style}`` (:mod:`functional_fsdp.tp.styles`) with the
numbers of torch's DTensor run. The translation reads torch's semantics:

- Keys are matched as ``parallelize_module`` matches them: split at dots, each token an
  fnmatch pattern over the names of one level's children (``"layers.*.attention"``), ``""`` the
  module itself; a dict value is a plan for each matched module.
- ``ColwiseParallel`` on an ``nn.Linear`` splits its output features; on an ``nn.Embedding``
  its embedding dim (dim 1). ``RowwiseParallel`` on an ``nn.Linear`` splits its input features;
  on an ``nn.Embedding`` its rows (the vocabulary). ``input_layouts`` and ``output_layouts``
  choose where the activations are gathered, reduced or scattered, as DTensor's redistribute
  would.
- ``PrepareModuleInput`` that gathers a module's input (``Shard(1) -> Replicate()``) becomes
  :class:`~functional_fsdp.tp.styles.PrepareInput`, and the colwise linears inside the module
  take the prepared input (their input gradients are reduced once, as DTensor does).
- ``use_local_output`` changes nothing: activations here are always local tensors. Code that
  reshapes with ``-1`` (or per-rank attributes) runs as it does on DTensors.

Layouts with no equivalent (``Partial()``, an all-to-all such as ``Shard(1) -> Shard(2)``, a
redistribution of a module's second input, a style subclass such as torchao's
``Float8ColwiseParallel``) raise a ``ValueError`` naming the plan entry and the style's fields.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import style as torch_tp

from .ops import gather_from, scatter_to
from .styles import (
    ColwiseParallel,
    ForwardWrapper,
    PrepareInput,
    RowwiseParallel,
    ScatterInput,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
    _divides,
    _enter_sequence,
    _leave_sequence,
    _map_input,
    _wrong_type,
)

TorchStyle = torch_tp.ParallelStyle

_KNOWN = (
    torch_tp.ColwiseParallel,
    torch_tp.RowwiseParallel,
    torch_tp.SequenceParallel,
    torch_tp.PrepareModuleInput,
    torch_tp.PrepareModuleOutput,
    torch_tp.PrepareModuleInputOutput,
)


def is_torch_plan(plan: object) -> bool:
    """Whether ``plan`` holds torch TP styles or nested plans (and so needs translating).

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> is_torch_plan({"w1": ColwiseParallel()}), is_torch_plan({"w1": RowwiseParallel()})
        (True, False)
    """
    if isinstance(plan, TorchStyle):
        return True
    return isinstance(plan, Mapping) and any(
        isinstance(v, (TorchStyle, Mapping)) for v in plan.values()
    )


# --------------------------------------------------------------------------- extra styles


@dataclass(frozen=True, kw_only=True)
class ColwiseEmbedding(Style):
    """torch's ``ColwiseParallel`` on an ``nn.Embedding``: its embedding dim split over tp.

    Weight ``P(None, "tp")``; each rank looks up its block of every row's features.

    Attributes:
        output: ``"sharded"`` keeps the features split (``Shard(-1)``); ``"replicated"``
            all-gathers them (:func:`gather_from`).

    Example:
        >>> ColwiseEmbedding(output="replicated").param_specs(nn.Embedding(8, 4), "tp")
        {'weight': P(None, 'tp')}
    """

    output: Literal["sharded", "replicated"] = "sharded"

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, Any]:
        from ..spec import P

        return {"weight": P(None, axis)}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Embedding):
            return _wrong_type(self, module, nn.Embedding, lora=False)
        if module.max_norm is not None:
            return "max_norm is not supported; build the embedding without it"
        fix = "Use a tp that divides it, or RowwiseParallel (vocabulary-parallel) instead."
        return _divides("embedding features", module.embedding_dim, tp, fix)

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Any) -> Any:
            def embedding(*args: Any, **kwargs: Any) -> torch.Tensor:
                out = forward(*args, **kwargs)
                return gather_from(out, mesh, axis, -1) if self.output == "replicated" else out

            return embedding

        return wrapper


@dataclass(frozen=True, kw_only=True)
class GatherInput(Style):
    """All-gather a module's input along ``dim`` for replicated compute (:func:`gather_from`).

    torch's ``PrepareModuleInput(Shard(d) -> Replicate())`` on a module with no colwise
    linear inside: the gradient is the same on every rank, so backward keeps this rank's block.

    Example:
        >>> GatherInput(dim=1)
        GatherInput(dim=1, input_kwarg=None)
    """

    dim: int = 1
    input_kwarg: str | None = None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def gather(x: torch.Tensor) -> torch.Tensor:
            return _leave_sequence(gather_from(x, mesh, axis, self.dim))

        def wrapper(forward: Any) -> Any:
            def gathered(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = _map_input(self, module, self.input_kwarg, args, kwargs, gather)
                return forward(*args, **kwargs)

            return gathered

        return wrapper


@dataclass(frozen=True, kw_only=True)
class RedistributeOutput(Style):
    """Change the layout of a module's output (item ``index`` of a tuple output).

    torch's ``PrepareModuleOutput``: ``"scatter"`` keeps this rank's block along ``dim``
    (``Replicate() -> Shard(dim)``), ``"gather"`` all-gathers it (``Shard(dim) -> Replicate()``).

    Example:
        >>> RedistributeOutput(op="scatter", dim=1)
        RedistributeOutput(op='scatter', dim=1, index=0)
    """

    op: Literal["scatter", "gather"]
    dim: int = 1
    index: int = 0

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def change(y: torch.Tensor) -> torch.Tensor:
            if self.op == "scatter":
                return _enter_sequence(scatter_to(y, mesh, axis, self.dim))
            return _leave_sequence(gather_from(y, mesh, axis, self.dim))

        def wrapper(forward: Any) -> Any:
            def redistributed(*args: Any, **kwargs: Any) -> Any:
                out = forward(*args, **kwargs)
                if isinstance(out, tuple):
                    return (*out[: self.index], change(out[self.index]), *out[self.index + 1 :])
                return change(out)

            return redistributed

        return wrapper


@dataclass(frozen=True, kw_only=True)
class PrepareInputThen(PrepareInput):
    """:class:`PrepareInput` on a module's input, then ``output`` on its output
    (torch's ``PrepareModuleInputOutput``, or a ``PrepareModuleInput`` and a
    ``PrepareModuleOutput`` on one module).

    Example:
        >>> PrepareInputThen(sequence_dim=1, output=RedistributeOutput(op="scatter")).sequence_dim
        1
    """

    output: Style | None = None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        first = super().wrap(module, mesh, axis)
        if self.output is None:
            return first
        then = self.output.wrap(module, mesh, axis)
        return lambda forward: then(first(forward))


@dataclass(frozen=True)
class Composed(Style):
    """Several styles on one module, applied innermost first (an input style, then an output
    style).

    Example:
        >>> Composed((ScatterInput(dim=1), RedistributeOutput(op="gather"))).styles[0]
        ScatterInput(dim=1, input_kwarg=None)
    """

    styles: tuple[Style, ...]

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, Any]:
        return {k: v for s in self.styles for k, v in s.param_specs(module, axis).items()}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        return next((p for s in self.styles if (p := s.problem(module, tp))), None)

    def local_attributes(self, module: nn.Module, tp: int) -> dict[str, Any]:
        return {k: v for s in self.styles for k, v in s.local_attributes(module, tp).items()}

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        wrappers = [s.wrap(module, mesh, axis) for s in self.styles]

        def wrapper(forward: Any) -> Any:
            for w in wrappers:
                forward = w(forward)
            return forward

        return wrapper


# --------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class _Entry:
    key: str  # the plan entry as written; nested keys joined by " -> "
    path: str  # the module path it resolved to
    style: Any  # a torch ParallelStyle or this library's Style


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a and b else a or b


def _resolve(module: nn.Module, plan: Any, key: str, path: str, root: nn.Module) -> list[_Entry]:
    if isinstance(plan, (TorchStyle, Style)):
        return [_Entry(key or "''", path, plan)]
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"tensor_parallel: plan entry {key or repr('')} maps to {plan!r} "
            f"({type(plan).__name__}); a plan value is a torch ParallelStyle (ColwiseParallel(), "
            f"...), a Style of this library, or a nested {{path: style}} dict."
        )
    out: list[_Entry] = []
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"tensor_parallel: plan key {pattern!r} is not a module path string")
        entry = f"{key} -> {pattern!r}" if key else repr(pattern)
        if pattern == "":
            targets = [("", module)]
        elif isinstance(value, Style):  # this library's patterns: fnmatch over whole paths
            targets = [
                (p, m) for p, m in module.named_modules() if p and fnmatch.fnmatchcase(p, pattern)
            ]
        else:  # parallelize_module's: one fnmatch pattern per level of children
            targets = [("", module)]
            for token in pattern.split("."):
                targets = [
                    (_join(p, name), child)
                    for p, m in targets
                    for name, child in m.named_children()
                    if fnmatch.fnmatchcase(name, token)
                ]
        if not targets:
            paths = [p for p, _ in module.named_modules() if p]
            close = difflib.get_close_matches(pattern, paths, n=3)
            where = f" of {path!r}" if path else ""
            raise ValueError(
                f"tensor_parallel: plan entry {entry} matches no submodule{where} "
                f"({type(module).__name__}); torch's parallelize_module would skip it with a "
                f"warning, leaving those layers replicated. Keys are dotted paths whose parts "
                f"are fnmatch patterns over child names, e.g. 'layers.*.attention.wq'; "
                + (f"did you mean {close}?" if close else f"paths look like {paths[:6]}.")
            )
        for p, m in targets:
            out += _resolve(m, value, entry, _join(path, p), root)
    return out


# --------------------------------------------------------------------------- translation


def _fields(style: Any) -> str:
    return repr(style)


class _Refusal(ValueError):
    pass


def _refuse(why: str) -> _Refusal:
    return _Refusal(why)


def _is_last(p: Any) -> bool:
    return isinstance(p, Shard) and p.dim == -1


def _colwise(style: Any, module: nn.Module, tp: int, prepared: bool) -> Style:
    (inp,), (out,) = style.input_layouts, style.output_layouts
    if isinstance(inp, Partial) or isinstance(out, Partial):
        raise _refuse(
            "Partial() layouts have no equivalent here (a partial sum is always reduced by "
            "the rowwise layer that makes it); use Replicate() or Shard(d)"
        )
    if isinstance(module, nn.Embedding):
        if not isinstance(inp, Replicate):
            raise _refuse(
                f"its ids' layout is {inp!r}; this library looks up replicated ids: "
                f"input_layouts=Replicate()"
            )
        if not (isinstance(out, Replicate) or _is_last(out)):
            raise _refuse(
                f"output_layouts={out!r} would need an all-to-all; use Shard(-1) or Replicate()"
            )
        return ColwiseEmbedding(output="replicated" if isinstance(out, Replicate) else "sharded")
    if not isinstance(module, nn.Linear) and getattr(module, "base_layer", None) is None:
        raise _refuse(
            f"torch's ColwiseParallel takes an nn.Linear or an nn.Embedding, not a "
            f"{type(module).__name__}"
        )
    if isinstance(out, Replicate):
        output = "replicated"
    elif _is_last(out):
        output = "sharded"
    else:
        raise _refuse(
            f"output_layouts={out!r} would need an all-to-all of the feature-split output; "
            f"use Shard(-1) (the default) or Replicate()"
        )
    base = getattr(module, "base_layer", module)
    features = getattr(base, "out_features", 0)
    padded = output == "sharded" and features % tp != 0
    if isinstance(inp, Replicate):
        return ColwiseParallel(
            input="prepared" if prepared else "replicated", output=output, padded=padded
        )
    return ColwiseParallel(input="sequence", sequence_dim=inp.dim, output=output, padded=padded)


def _rowwise(style: Any, module: nn.Module) -> Style:
    (inp,), (out,) = style.input_layouts, style.output_layouts
    if isinstance(inp, Partial) or isinstance(out, Partial):
        raise _refuse(
            "Partial() layouts have no equivalent here (a rowwise output is always reduced); "
            "use Replicate() or Shard(d)"
        )
    if isinstance(module, nn.Embedding):
        if not isinstance(inp, Replicate):
            raise _refuse(
                f"its ids' layout is {inp!r} (torch's default for RowwiseParallel is Shard(-1), "
                f"which all-gathers the ids along their last dim); this library looks up "
                f"replicated ids: write input_layouts=Replicate()"
            )
        if isinstance(out, Replicate):
            return VocabParallelEmbedding()
        return VocabParallelEmbedding(output="sequence", sequence_dim=out.dim)
    if not isinstance(module, nn.Linear) and getattr(module, "base_layer", None) is None:
        raise _refuse(
            f"torch's RowwiseParallel takes an nn.Linear or an nn.Embedding, not a "
            f"{type(module).__name__}"
        )
    if isinstance(inp, Replicate):
        given = "replicated"
    elif _is_last(inp):
        given = "sharded"
    else:
        raise _refuse(
            f"input_layouts={inp!r} would need an all-to-all into the feature split; use "
            f"Shard(-1) (the default) or Replicate()"
        )
    if isinstance(out, Replicate):
        return RowwiseParallel(input=given)
    return RowwiseParallel(input=given, output="sequence", sequence_dim=out.dim)


def _input_change(style: Any) -> tuple[str, int | None, str | None] | None:
    """The one input redistribution of a PrepareModuleInput: (op, dim, keyword) or None.

    ``op`` is ``"enter"`` (Replicate -> Replicate), ``"gather"`` (Shard(d) -> Replicate) or
    ``"scatter"`` (Replicate -> Shard(d)).
    """
    pairs: list[tuple[str | int, Any, Any]] = []
    if style.input_layouts is not None:
        pairs += [
            (i, a, b)
            for i, (a, b) in enumerate(zip(style.input_layouts, style.desired_input_layouts))
        ]
    for name, a in style.input_kwarg_layouts.items():
        pairs.append((name, a, style.desired_input_kwarg_layouts.get(name)))
    changes = []
    for where, a, b in pairs:
        if a is None or b is None:
            continue
        if isinstance(a, Partial) or isinstance(b, Partial):
            raise _refuse(f"input {where!r}: Partial() layouts have no equivalent here")
        if isinstance(a, Shard) and isinstance(b, Shard):
            if a.dim != b.dim:
                raise _refuse(
                    f"input {where!r}: {a!r} -> {b!r} would need an all-to-all; gather "
                    f"(-> Replicate()) or keep the layout"
                )
            continue  # an annotation: nothing moves
        if isinstance(a, Shard):
            changes.append((where, "gather", a.dim))
        elif isinstance(b, Shard):
            changes.append((where, "scatter", b.dim))
        else:
            changes.append((where, "enter", None))
    if not changes:
        return None
    if len(changes) > 1 or (isinstance(changes[0][0], int) and changes[0][0] != 0):
        raise _refuse(
            f"it redistributes inputs {[w for w, _, _ in changes]}; this library prepares one "
            f"input of a module: the first positional one or one keyword (input_kwarg_layouts)"
        )
    where, op, dim = changes[0]
    return op, dim, where if isinstance(where, str) else None


def _output_change(style: Any) -> Style | None:
    changes = []
    for i, (a, b) in enumerate(zip(style.output_layouts, style.desired_output_layouts)):
        if a is None or b is None:
            continue
        if isinstance(a, Partial) or isinstance(b, Partial):
            raise _refuse(f"output {i}: Partial() layouts have no equivalent here")
        if isinstance(a, Shard) and isinstance(b, Shard):
            if a.dim != b.dim:
                raise _refuse(f"output {i}: {a!r} -> {b!r} would need an all-to-all")
            continue
        if isinstance(a, Shard):
            changes.append(RedistributeOutput(op="gather", dim=a.dim, index=i))
        elif isinstance(b, Shard):
            changes.append(RedistributeOutput(op="scatter", dim=b.dim, index=i))
    if len(changes) > 1:
        raise _refuse("it redistributes several outputs; this library changes one")
    return changes[0] if changes else None


def _error(entry: _Entry, module: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"tensor_parallel: plan entry {entry.key} gives module {entry.path!r} "
        f"({type(module).__name__}) torch's {_fields(entry.style)}, but {why}."
    )


def from_torch_plan(module: nn.Module, plan: Any, tp: int) -> dict[str, Style]:
    """Translate a ``parallelize_module`` plan into ``{module path: Style}``.

    Args:
        module: the module the plan is for (never modified).
        plan: a torch ``ParallelStyle``, a ``{path: style}`` dict, or nested dicts; values may
            also be this library's styles (matched with its own fnmatch over whole paths).
        tp: the tensor-parallel size (for uneven logits: ``padded=True``).

    Returns:
        ``{path: Style}`` with one key per module (paths escaped for fnmatch), ready for
        :func:`functional_fsdp.tensor_parallel`.

    Raises:
        ValueError: an entry matches nothing, has no equivalent here, or two entries give one
            module conflicting styles; the message names the entry and the style's fields.

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> from_torch_plan(mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}, 2)
        {'0': ColwiseParallel(input='replicated', output='sharded', sequence_dim=1, head_dim=None, input_kwarg=None, padded=False), '2': RowwiseParallel(output='replicated', sequence_dim=1, input_kwarg=None, input='sharded')}
    """
    entries = _resolve(module, plan, "", "", module)
    modules = dict(module.named_modules())
    by_path: dict[str, list[_Entry]] = {}
    for e in entries:
        if isinstance(e.style, TorchStyle) and type(e.style) not in _KNOWN:
            raise _error(
                e,
                modules[e.path],
                f"{type(e.style).__name__} is not one of torch's styles "
                f"({', '.join(c.__name__ for c in _KNOWN)}) and has no equivalent here; write "
                f"the entry with one of them or with this library's styles",
            )
        by_path.setdefault(e.path, []).append(e)

    # Each PrepareModuleInput's input redistribution, and the colwise linears that read it.
    inputs: dict[str, tuple[_Entry, tuple[str, int | None, str | None] | None]] = {}
    outputs: dict[str, tuple[_Entry, Style | None]] = {}
    for path, group in by_path.items():
        for e in group:
            prep_in = prep_out = None
            if isinstance(e.style, torch_tp.PrepareModuleInputOutput):
                prep_in, prep_out = e.style.prepare_module_input, e.style.prepare_module_output
            elif isinstance(e.style, torch_tp.PrepareModuleInput):
                prep_in = e.style
            elif isinstance(e.style, torch_tp.PrepareModuleOutput):
                prep_out = e.style
            try:
                if prep_in is not None:
                    if path in inputs:
                        raise _refuse(f"entry {inputs[path][0].key} prepares its input already")
                    inputs[path] = (e, _input_change(prep_in))
                if prep_out is not None:
                    if path in outputs:
                        raise _refuse(f"entry {outputs[path][0].key} prepares its output already")
                    outputs[path] = (e, _output_change(prep_out))
            except _Refusal as why:
                raise _error(e, modules[path], str(why)) from None

    def nearest_prepare(path: str) -> str | None:
        above = [p for p in inputs if p == "" or path.startswith(p + ".")]
        return max(above, key=len) if above else None

    readers: dict[str, list[str]] = {}
    for path, group in by_path.items():
        for e in group:
            colwise = isinstance(e.style, torch_tp.ColwiseParallel)
            if colwise and isinstance(e.style.input_layouts[0], Replicate):
                if isinstance(modules[path], nn.Embedding):
                    continue
                owner = nearest_prepare(path)
                change = inputs[owner][1] if owner is not None else None
                if change is not None and change[0] in ("enter", "gather"):
                    readers.setdefault(owner, []).append(path)  # type: ignore[arg-type]

    out: dict[str, Style] = {}
    for path, group in by_path.items():
        m = modules[path]
        styles: list[tuple[_Entry, Style]] = []
        for e in group:
            s = e.style
            try:
                if isinstance(s, Style):
                    styles.append((e, s))
                elif isinstance(s, torch_tp.ColwiseParallel):
                    prepared = any(path in r for r in readers.values())
                    styles.append((e, _colwise(s, m, tp, prepared)))
                elif isinstance(s, torch_tp.RowwiseParallel):
                    styles.append((e, _rowwise(s, m)))
                elif isinstance(s, torch_tp.SequenceParallel):
                    styles.append((e, SequenceParallel()))
            except _Refusal as why:
                raise _error(e, m, str(why)) from None
        first: Style | None = None
        if path in inputs and inputs[path][1] is not None:
            op, dim, kwarg = inputs[path][1]  # type: ignore[misc]
            if op == "scatter":
                first = ScatterInput(dim=dim or 0, input_kwarg=kwarg)
            elif path in readers:
                first = PrepareInput(sequence_dim=dim, input_kwarg=kwarg)
            elif op == "gather":
                first = GatherInput(dim=dim or 0, input_kwarg=kwarg)
            # "enter" with no colwise linear reading it: a DTensor annotation, nothing moves
        then = outputs[path][1] if path in outputs else None
        if isinstance(first, PrepareInput):
            styles.append(
                (
                    inputs[path][0],
                    PrepareInputThen(
                        sequence_dim=first.sequence_dim, input_kwarg=first.input_kwarg, output=then
                    ),
                )
            )
        elif first is not None or then is not None:
            parts = tuple(s for s in (first, then) if s is not None)
            prep = inputs.get(path, outputs.get(path))[0]  # type: ignore[index]
            styles.append((prep, parts[0] if len(parts) == 1 else Composed(parts)))
        if len(styles) > 1:
            (a, _), (b, _) = styles[:2]
            raise ValueError(
                f"tensor_parallel: module {path!r} ({type(m).__name__}) is given "
                f"{_fields(a.style)} by plan entry {a.key} and {_fields(b.style)} by plan entry "
                f"{b.key}; a module takes one style (a PrepareModuleInput and a "
                f"PrepareModuleOutput may share one). Make the entries disjoint."
            )
        if styles:
            out[_escape(path)] = styles[0][1]
    return out


def _escape(path: str) -> str:
    """``path`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)
