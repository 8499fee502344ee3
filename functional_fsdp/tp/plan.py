"""Tensor-parallel plans, composed with FSDP.

TP is specs plus the Megatron conjugate operations in the forward. A *plan* maps
module-path patterns (fnmatch, like torchtitan's TP plans) to styles
(:mod:`functional_fsdp.tp.styles`). :func:`tensor_parallel` resolves a plan against a module
and returns the parameter specs (the TP split, with FSDP over the data axes as the minor
split of dim 0) and the forward wrappers, ready for :func:`functional_fsdp.fsdp`::

    tp = ff.tensor_parallel(model, mesh, ff.gpt_plan(cfg))
    sharded = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)

No module is changed: the wrappers run only inside ``FSDP.apply``.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..dist.mesh import axis_names, axis_sizes
from ..spec import P, format_mesh
from .styles import (
    ColwiseParallel,
    Forward,
    PrepareInput,
    Style,
)

# --------------------------------------------------------------------------- plans


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """A plan resolved against a module and mesh. Build it with :func:`tensor_parallel`.

    Attributes:
        mesh: the mesh.
        axis: the tensor-parallel mesh axis.
        data_axes: the other mesh axes (they split the batch); pass to ``ff.fsdp``.
        styles: ``{module path: style}`` for every module a plan entry matched.
        tp_specs: ``{parameter name: P}``, the split over ``axis`` alone.
        specs: ``tp_specs`` with the FSDP axes added as the minor split of dim 0, e.g.
            ``P(("tp", "dp"), None)`` for a colwise weight, ``P("dp", "tp")`` for a rowwise
            one, ``P("dp")`` for a replicated one. Pass to ``ff.fsdp(specs=...)``.
        wrappers: ``(module path, wrapper)`` pairs; pass to ``ff.fsdp(wrappers=...)``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8))
        >>> with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ...     tp = tensor_parallel(model, mesh, {"0": ff.ColwiseParallel()})
        ...     tp.tp_specs["0.weight"], tp.specs["0.weight"], tp.data_axes
        (P('tp', None), P(('tp', 'dp'), None), ('dp',))
    """

    mesh: DeviceMesh
    axis: str
    data_axes: tuple[str, ...]
    styles: dict[str, Style]
    tp_specs: dict[str, P]
    specs: dict[str, P]
    wrappers: tuple[tuple[str, Callable[[nn.Module, Forward], Forward]], ...] = field(repr=False)


def _with_fsdp(spec: P, ndim: int, fsdp_axes: tuple[str, ...]) -> P:
    if ndim == 0 or not fsdp_axes:
        return spec.padded(ndim)
    spec = spec.padded(ndim)
    return P((*spec.entry(0), *fsdp_axes), *list(spec)[1:])


def _match(
    module: nn.Module, plan: Mapping[str, Style], mesh: DeviceMesh
) -> dict[str, tuple[str, Style]]:
    paths = [p for p, _ in module.named_modules()]
    chosen: dict[str, tuple[str, Style]] = {}
    for pattern, style in plan.items():
        if not isinstance(style, Style):
            raise TypeError(
                f"tensor_parallel: plan entry {pattern!r} maps to {style!r} "
                f"({type(style).__name__}), not a Style; use ColwiseParallel(), "
                f"RowwiseParallel(), VocabParallelEmbedding(), SequenceParallel(), ..."
            )
        hits = [p for p in paths if (p or pattern == "") and fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, [p for p in paths if p], n=3)
            raise ValueError(
                f"tensor_parallel: plan pattern {pattern!r} matches no module of "
                f"{type(module).__name__} on {format_mesh(axis_sizes(mesh))}. Patterns are "
                f"fnmatch patterns over module paths, e.g. 'blocks.*.attn.wq'; "
                + (f"did you mean {close}?" if close else f"paths look like {paths[1:7]}.")
            )
        for path in hits:
            if path in chosen and chosen[path][1] != style:
                other, first = chosen[path]
                raise ValueError(
                    f"tensor_parallel: module {path!r} is matched by plan patterns {other!r} "
                    f"({first}) and {pattern!r} ({style}); a module takes one style. Make the "
                    f"patterns disjoint."
                )
            chosen[path] = (pattern, style)
    return chosen


def tensor_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, Style],
    *,
    axis: str = "tp",
    fsdp_axes: Sequence[str] | None = None,
) -> TensorParallel:
    """Resolve a TP plan against ``module``: parameter specs and forward wrappers.

    Args:
        module: any ``nn.Module``; it is never modified.
        mesh: a mesh with a tensor-parallel axis, e.g. ``{"dp": 2, "tp": 2}``.
        plan: ``{module path pattern: Style}``; fnmatch patterns such as ``"blocks.*.mlp.fc1"``.
        axis: the tensor-parallel axis.
        fsdp_axes: data axes that shard parameters, added as the minor split of dim 0.
            Default: every axis but ``axis`` and ``"replicate"`` (what ``ff.fsdp`` shards by
            default). ``()`` keeps parameters replicated over the data axes (DDP + TP).

    Raises:
        ValueError: a pattern matches no module, two patterns give one module different
            styles, tp does not divide a split dim (or a head count), or a parameter shared
            by several modules (a tied embedding and head) would get conflicting specs.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> plan = {"0": ff.ColwiseParallel(), "2": ff.RowwiseParallel()}
        >>> with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ...     tp = tensor_parallel(model, mesh, plan)
        ...     print(tp.specs)
        ...     f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        ...     y = f.apply(f.shard(), torch.ones(3, 4))
        ...     torch.allclose(ff.rank_values(y)[0], model(torch.ones(3, 4)), atol=1e-6)
        {'0.weight': P(('tp', 'dp'), None), '0.bias': P(('tp', 'dp')), '2.weight': P('dp', 'tp'), '2.bias': P('dp')}
        True
    """
    names, sizes = axis_names(mesh), axis_sizes(mesh)
    if axis not in names:
        raise ValueError(
            f"tensor_parallel: the mesh {format_mesh(sizes)} has no tensor-parallel axis "
            f"{axis!r}; build it with one, e.g. make_mesh({{'dp': 2, {axis!r}: 2}}), or pass "
            f"axis= one of {names}."
        )
    if fsdp_axes is None:
        fsdp_axes = tuple(a for a in names if a not in (axis, "replicate"))
    fsdp_axes = tuple(fsdp_axes)
    bad = [a for a in fsdp_axes if a not in names or a == axis]
    if bad:
        raise ValueError(
            f"tensor_parallel: fsdp_axes {fsdp_axes} names {bad[0]!r}, which is not a data "
            f"axis of {format_mesh(sizes)}; name axes of the mesh other than {axis!r}."
        )
    tp = sizes[axis]
    chosen = _match(module, plan, mesh)
    modules = dict(module.named_modules())
    for path, (pattern, style) in chosen.items():
        m = modules[path]
        problem = style.problem(m, tp)
        prepared = isinstance(style, ColwiseParallel) and style.input == "prepared"
        if problem is None and prepared and not _prepared_above(path, chosen):
            problem = (
                "input='prepared' needs a PrepareInput() style on an enclosing module "
                "(e.g. the attention block); add one, or use input='replicated'"
            )
        if problem:
            shape = (
                tuple(m.weight.shape)
                if isinstance(getattr(m, "weight", None), torch.Tensor)
                else None
            )
            raise ValueError(
                f"tensor_parallel: plan entry {pattern!r} gives module {path!r} "
                f"({type(m).__name__}" + (f", weight {shape}" if shape else "") + f") {style} on "
                f"{format_mesh(sizes)}, but {problem}"
            )
    tp_specs = _param_specs(module, chosen, axis, mesh)
    params = dict(module.named_parameters())
    specs = {n: _with_fsdp(tp_specs[n], params[n].ndim, fsdp_axes) for n in params}
    return TensorParallel(
        mesh=mesh,
        axis=axis,
        data_axes=tuple(a for a in names if a != axis),
        styles={p: s for p, (_, s) in chosen.items()},
        tp_specs={n: tp_specs[n] for n in params},
        specs=specs,
        wrappers=tuple((p, _StyleWrapper(s, mesh, axis)) for p, (_, s) in chosen.items()),
    )


@dataclass(frozen=True)
class _StyleWrapper:
    """``(module, forward) -> forward``: a style applied to the per-call copy of a module."""

    style: Style
    mesh: DeviceMesh
    axis: str

    def __call__(self, module: nn.Module, forward: Forward) -> Forward:
        return self.style.wrap(module, self.mesh, self.axis)(forward)


def _prepared_above(path: str, chosen: dict[str, tuple[str, Style]]) -> bool:
    return any(
        isinstance(s, PrepareInput) and (p == "" or path.startswith(p + "."))
        for p, (_, s) in chosen.items()
    )


def _param_specs(
    module: nn.Module, chosen: dict[str, tuple[str, Style]], axis: str, mesh: DeviceMesh
) -> dict[str, P]:
    """TP spec per parameter (by first name), checking tied parameters agree."""
    by_id: dict[int, list[tuple[str, P]]] = {}  # parameter -> [(alias, spec)]
    for path, m in module.named_modules(remove_duplicate=False):
        styled = chosen.get(path)
        split = styled[1].param_specs(m, axis) if styled else {}
        for local, p in m.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{path}.{local}" if path else local
            by_id.setdefault(id(p), []).append((name, split.get(local, P()).padded(p.ndim)))
    out: dict[str, P] = {}
    for name, p in module.named_parameters():
        aliases = by_id[id(p)]
        first_name, first = aliases[0]
        for other_name, other in aliases[1:]:
            if other != first:
                raise ValueError(
                    f"tensor_parallel: the parameter {first_name!r} is shared with "
                    f"{other_name!r} (shape {tuple(p.shape)}), but gets {first} from "
                    f"{_describe(first_name, chosen)} and {other} from "
                    f"{_describe(other_name, chosen)} on {format_mesh(axis_sizes(mesh))}; one "
                    f"tensor has one layout. Give both modules styles that split it the same "
                    f"way (e.g. VocabParallelEmbedding() for the embedding and ColwiseParallel() "
                    f"for the tied head, whose vocab-sharded logits go to "
                    f"vocab_parallel_cross_entropy), or untie the weights."
                )
        out[name] = first
    return out


def _describe(name: str, chosen: dict[str, tuple[str, Style]]) -> str:
    path = name.rpartition(".")[0]
    if path in chosen:
        pattern, style = chosen[path]
        return f"plan entry {pattern!r} ({type(style).__name__} on {path!r})"
    return f"no plan entry for {path!r} (replicated)"
