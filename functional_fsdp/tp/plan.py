"""Tensor-parallel plans, composed with FSDP.

TP is specs plus the Megatron conjugate operations in the forward. A *plan* maps
module-path patterns (fnmatch, like torchtitan's TP plans) to styles
(:mod:`functional_fsdp.tp.styles`). :func:`tensor_parallel` resolves a plan against a module
and returns the parameter specs (the TP split, with FSDP over the data axes as the minor
split of dim 0) and the forward wrappers, ready for :func:`functional_fsdp.fsdp`::

    tp = ff.tensor_parallel(model, mesh, ff.gpt_plan(cfg))
    sharded = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)

No module is changed: the wrappers run only inside ``FSDP.apply``. Each wrapper is called
per call as ``wrapper(module, forward) -> forward`` with the module it wraps, and reads
parameters and sets per-rank attributes (``Style.local_attributes``) on that module only, for
the duration of its call. The parents of colwise linears also get a wrapper that turns a
reshape failure (a global head count meeting a head-split tensor) into an error that says
how to fix it.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.mesh import axis_names, axis_sizes
from ..spec import P, format_mesh
from .styles import (
    ColwiseParallel,
    Forward,
    LocalAttributes,
    PrepareInput,
    Style,
    _attributes_set,
)
from .torch_styles import from_torch_plan, is_torch_plan
from .verify import Checks, _head_counts, block_checks

ModuleWrapper = Callable[[nn.Module, Forward], Forward]

# --------------------------------------------------------------------------- wrappers


@dataclass(frozen=True, eq=False)
class StyleWrapper:
    """``(module, forward) -> forward``: a style's forward, with its per-rank attributes set.

    ``module`` is the module being called (per call, the engine may pass a clone of it); the
    style's parameters are read from it, and its :meth:`Style.local_attributes` hold on it
    for the duration of each call, then the previous values come back.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from functional_fsdp.tp.styles import LocalAttributes
        >>> attn = torch.nn.Module()
        >>> attn.n_heads = 4
        >>> with ff.simulated_mesh({"tp": 2}) as mesh:
        ...     w = StyleWrapper("attn", LocalAttributes(("n_heads",)), mesh, "tp", 2)
        ...     w(attn, lambda: attn.n_heads)(), attn.n_heads
        (2, 4)
    """

    path: str
    style: Style
    mesh: DeviceMesh
    axis: str
    tp: int

    def __call__(self, module: nn.Module, forward: Forward) -> Forward:
        wrapped = self.style.wrap(module, self.mesh, self.axis)(forward)
        values = self.style.local_attributes(module, self.tp)
        if not values:
            return wrapped

        def with_local_attributes(*args: Any, **kwargs: Any) -> Any:
            with _attributes_set(module, values):
                return wrapped(*args, **kwargs)

        return with_local_attributes


_RESHAPE = re.compile(
    r"shape '\[([-\d, ]*)\]' is invalid for input of size \d+"
    r"|sizes \[([-\d, ]*)\] don't multiply up to the size"
)


@dataclass(frozen=True, eq=False)
class _ReshapeHint:
    """Around a parent of colwise linears: a failed view/reshape becomes an error naming
    the per-rank attribute feature (``PrepareInput(per_rank=...)``, ``LocalAttributes``)."""

    path: str
    colwise: tuple[tuple[str, int], ...]  # (child name, global output features)
    tp: int
    style: Style | None

    def __call__(self, module: nn.Module, forward: Forward) -> Forward:
        def hinted(*args: Any, **kwargs: Any) -> Any:
            try:
                return forward(*args, **kwargs)
            except RuntimeError as e:
                found = _RESHAPE.search(str(e))
                if found is None:
                    raise
                raise ValueError(self.message(module, str(e), found, e.__traceback__)) from e

        return hinted

    def message(self, module: nn.Module, error: str, found: re.Match[str], tb: Any = None) -> str:
        shape = [int(v) for v in re.findall(r"-?\d+", found.group(1) or found.group(2) or "")]
        path, holder = _reshaping_module(module, self.path, tb)
        ints = {
            n: v
            for n, v in vars(holder).items()
            if isinstance(v, int) and not isinstance(v, bool) and not n.startswith("_")
        }
        names = [n for n, v in ints.items() if v in shape and v > 1 and v % self.tp == 0]
        heads = [n for n in names if n in _head_counts(holder, self.tp)] or names
        attrs = tuple(heads) or ("n_heads",)
        linears = ", ".join(f"{c!r} ({out // self.tp} of {out})" for c, out in self.colwise)
        style = self.style if path == self.path else None
        kind = type(style).__name__ if style is not None else None
        if isinstance(style, PrepareInput):
            fix = f"PrepareInput(per_rank={attrs!r}, ...)"
        else:
            fix = f"LocalAttributes(per_rank={attrs!r})"
        already = (
            f" (its {kind} sets {[n for n, _ in style.per_rank]} per rank already)"
            if isinstance(style, (PrepareInput, LocalAttributes)) and style.per_rank
            else ""
        )
        return (
            f"tensor_parallel: {type(holder).__name__} {path!r} failed to reshape on tp="
            f"{self.tp}: {error.splitlines()[0]}. Its colwise linears give each rank a block of "
            f"their output features: {linears}, so code that reshapes with a global size, such "
            f"as a head count in q.view(b, t, self.n_heads, head_dim), does not fit{already}. "
            f"Read the local size from the shape (q.view(b, t, -1, head_dim)), or set the "
            f"attribute per rank for the call: give {path!r} {fix} in the plan "
            f"(attributes {list(attrs)}; values divided by tp, or {{name: rule(value, tp)}})."
        )


def _reshaping_module(module: nn.Module, path: str, tb: Any) -> tuple[str, nn.Module]:
    """The module (and its path) whose code raised: the innermost frame of ``tb`` whose
    ``self`` is ``module`` or one of its submodules; ``module`` itself if none is."""
    inside = {id(m): f"{path}.{p}" if path and p else path or p for p, m in module.named_modules()}
    found = (path, module)
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in inside:
            found = (inside[id(owner)], owner)
        tb = tb.tb_next
    return found


def _has_forward(m: nn.Module) -> bool:
    return type(m).forward is not nn.Module.forward


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
        wrappers: ``(module path, wrapper)`` pairs, ``wrapper(module, forward) -> forward``
            (:class:`StyleWrapper`); pass to ``ff.fsdp(wrappers=...)``.
        blocks: the paths of the blocks checked against the unsharded module at the first
            call (``verify=True``; each distinct block once).
        checks: what the checks did so far (:class:`~functional_fsdp.tp.verify.Checks`:
            the blocks compared and the seconds it took), ``None`` with ``verify=False``.

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
    wrappers: tuple[tuple[str, ModuleWrapper], ...] = field(repr=False)
    blocks: tuple[str, ...] = ()
    checks: Checks | None = field(default=None, repr=False)


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
    verify: bool = True,
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
        verify: check each distinct block of the plan (an attention or MLP module around
            its colwise and rowwise linears, a vocabulary-parallel embedding, ...) once
            against the unsharded block, on the first ``FSDP.apply`` that runs it, and raise
            naming the block and the fix if they differ (:mod:`functional_fsdp.tp.verify`).
            ``False`` skips the check.

    Raises:
        ValueError: a pattern matches no module, two patterns give one module different
            styles, tp does not divide a split dim (or a head count), or a parameter shared
            by several modules (a tied embedding and head) would get conflicting specs. With
            ``verify``, the first ``FSDP.apply`` raises if a block gives a result other than
            the unsharded block's.

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
    if is_torch_plan(plan):  # torch's parallelize_module styles and nested plans
        plan = from_torch_plan(module, plan, tp)
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
    _check_beside_split_outputs(chosen, modules, tp, sizes)
    tp_specs = _param_specs(module, chosen, axis, mesh)
    params = dict(module.named_parameters())
    specs = {n: _with_fsdp(tp_specs[n], params[n].ndim, fsdp_axes) for n in params}
    wrappers: list[tuple[str, ModuleWrapper]] = [
        (p, StyleWrapper(p, s, mesh, axis, tp)) for p, (_, s) in chosen.items()
    ]
    state = Checks() if verify else None
    checks = (
        block_checks(module, chosen, tp_specs, mesh, axis, tp, StyleWrapper, state)
        if state is not None
        else []
    )
    return TensorParallel(
        mesh=mesh,
        axis=axis,
        data_axes=tuple(a for a in names if a != axis),
        styles={p: s for p, (_, s) in chosen.items()},
        tp_specs={n: tp_specs[n] for n in params},
        specs=specs,
        wrappers=(*wrappers, *_reshape_hints(chosen, modules, tp), *checks),
        blocks=tuple(p for p, _ in checks),
        checks=state,
    )


def _reshape_hints(
    chosen: dict[str, tuple[str, Style]], modules: dict[str, nn.Module], tp: int
) -> list[tuple[str, ModuleWrapper]]:
    """A :class:`_ReshapeHint` around the nearest module with its own forward above each
    colwise linear with sharded outputs (through containers such as ``nn.ModuleDict``)."""
    parents: dict[str, list[tuple[str, int]]] = {}
    for path, (_, style) in chosen.items():
        if isinstance(style, ColwiseParallel) and style.output == "sharded" and path:
            parent = path.rpartition(".")[0]
            while parent and not _has_forward(modules[parent]):
                parent = parent.rpartition(".")[0]
            child = path[len(parent) + 1 :] if parent else path
            m = modules[path]
            out = getattr(getattr(m, "base_layer", m), "out_features", 0)
            parents.setdefault(parent, []).append((child, out))
    return [
        (p, _ReshapeHint(p, tuple(c), tp, chosen[p][1] if p in chosen else None))
        for p, c in parents.items()
    ]


def _check_beside_split_outputs(
    chosen: dict[str, tuple[str, Style]],
    modules: dict[str, nn.Module],
    tp: int,
    sizes: Mapping[str, int],
) -> None:
    """Refuse a module with parameters but no style beside colwise linears with split outputs.

    Such a module (a q/k norm in an attention block) most likely reads their split output:
    with replicated parameters its gradient would be partial on each rank (a silent error),
    or its shapes would not fit. It must say how it runs: ``ReplicatedParallel()`` (summed
    gradients) or a gathered input.
    """
    parents: dict[str, list[str]] = {}
    for path, (_, style) in chosen.items():
        sharded = isinstance(style, ColwiseParallel) and style.output == "sharded"
        if sharded and not style.padded and "." in path:  # padded: logits, read by the loss
            parent, _, child = path.rpartition(".")
            parents.setdefault(parent, []).append(child)
    for parent, split in parents.items():
        for name, child in modules[parent].named_children():
            path = f"{parent}.{name}"
            styled = any(p == path or p.startswith(path + ".") for p in chosen)
            params = [(n, tuple(v.shape)) for n, v in child.named_parameters()]
            if styled or not params:
                continue
            raise ValueError(
                f"tensor_parallel: module {path!r} ({type(child).__name__}, parameters "
                f"{params[:3]}) has no plan entry, but sits beside colwise linears {split} of "
                f"{parent!r} whose outputs are split over tp={tp} on {format_mesh(sizes)}. If it "
                f"reads their split output (a q/k norm), its replicated parameters would get a "
                f"partial gradient on each rank, or its shapes would not fit. Say how it runs: "
                f"ReplicatedParallel() if it works per head (its gradient is summed over tp); "
                f"ColwiseParallel(output='replicated') on {split} and "
                f"RowwiseParallel(input='replicated') after them if it needs the whole "
                f"features; LocalAttributes() if it reads only replicated values."
            )


def _prepared_above(path: str, chosen: dict[str, tuple[str, Style]]) -> bool:
    return any(
        isinstance(s, PrepareInput) and (p == "" or path.startswith(p + "."))
        for p, (_, s) in chosen.items()
    )


def _param_specs(
    module: nn.Module, chosen: dict[str, tuple[str, Style]], axis: str, mesh: DeviceMesh
) -> dict[str, P]:
    """TP spec per parameter (by first name), checking tied parameters agree."""
    modules = dict(module.named_modules())
    styled: dict[str, tuple[P, str, str, Style]] = {}  # name -> (spec, module path, pattern, style)
    for path, (pattern, style) in chosen.items():
        for local, spec in style.param_specs(modules[path], axis).items():
            styled[f"{path}.{local}" if path else local] = (spec, path, pattern, style)
    by_id: dict[int, list[tuple[str, P]]] = {}  # parameter -> [(alias, spec)]
    for name, p in module.named_parameters(remove_duplicate=False):
        spec = styled[name][0] if name in styled else P()
        by_id.setdefault(id(p), []).append((name, spec.padded(p.ndim)))
    out: dict[str, P] = {}
    for name, p in module.named_parameters():
        aliases = by_id[id(p)]
        first_name, first = aliases[0]
        for other_name, other in aliases[1:]:
            if other != first:
                raise ValueError(
                    f"tensor_parallel: the parameter {first_name!r} is shared with "
                    f"{other_name!r} (shape {tuple(p.shape)}), but gets {first} from "
                    f"{_describe(first_name, styled)} and {other} from "
                    f"{_describe(other_name, styled)} on {format_mesh(axis_sizes(mesh))}; one "
                    f"tensor has one layout. Give both modules styles that split it the same "
                    f"way (e.g. VocabParallelEmbedding() for the embedding and ColwiseParallel() "
                    f"for the tied head, whose vocab-sharded logits go to "
                    f"vocab_parallel_cross_entropy), or untie the weights."
                )
        out[name] = first
    return out


def _describe(name: str, styled: dict[str, tuple[P, str, str, Style]]) -> str:
    if name in styled:
        _, path, pattern, style = styled[name]
        return f"plan entry {pattern!r} ({type(style).__name__} on {path!r})"
    return f"no plan entry for {name.rpartition('.')[0]!r} (replicated)"
