"""``shard``, ``gather`` and ``reshard``: pure functions on pytrees of tensors.

Gathering many tensors is bucketed: one collective per mesh axis (and dtype, or per
size-capped bucket) over a flat buffer, never one per tensor. ``gather`` is differentiable;
its gradient is the bucketed reduce-scatter of the incoming gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from ._buckets import (
    Round,
    issue_gather,
    pack_grads,
    plan_rounds,
    unpack_gathered,
    unpack_reduced,
)
from ._tree import dotted, keystr
from .distributed import agreement
from .distributed import collectives as C
from .distributed.axes import check_axes, describe_mesh, same_mesh
from .distributed.mesh import axis_names, axis_sizes, check_mesh, local_coordinate, rank_at
from .distributed.simulate import (
    check_alive,
    is_shapes_only,
    is_simulated,
    on_rank,
    per_coordinate,
)
from .sharded import Sharded, block_of, local_shape_problem
from .spec import Layout, P, format_mesh, spec_problem

SpecRule = Callable[[str, torch.Tensor], P | None]
Specs = P | SpecRule | Any


# --------------------------------------------------------------------------- tree plumbing


def _flatten(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any], optree.PyTreeSpec]:
    # Without the namespace a Sharded is a leaf; None is a leaf so specs can line up with it.
    return optree.tree_flatten_with_path(tree, none_is_leaf=True)


def resolve_specs(tree: Any, specs: Specs) -> list[P | None]:
    """One spec per leaf of ``tree`` (``None`` for leaves that are not tensors).

    ``specs`` may be a single ``P`` (used for every tensor), a rule
    ``fn(dotted_path, tensor) -> P | None``, or a tree of ``P`` matching ``tree`` or a prefix
    of it. ``None`` in a spec tree or from a rule means replicated, ``P()``.
    """
    paths, leaves, _ = _flatten(tree)
    if isinstance(specs, P):
        per_leaf: list[Any] = [specs] * len(leaves)
    elif callable(specs) and not isinstance(specs, (dict, list, tuple)):
        per_leaf = [
            specs(dotted(p), x) if isinstance(x, (torch.Tensor, Sharded)) else None
            for p, x in zip(paths, leaves)
        ]
    else:
        try:
            broadcast = optree.tree_broadcast_prefix(
                specs, tree, is_leaf=lambda s: isinstance(s, P) or s is None, none_is_leaf=True
            )
        except ValueError as e:
            where = _first_mismatch(specs, tree, ()) or f"{e}"
            raise ValueError(
                f"the specs do not match the tree {where}. Give specs with the same structure "
                f"as the tree, or a prefix of it (one P for a whole subtree), a single P for "
                f"every tensor, or a rule fn(path, tensor) -> P."
            ) from None
        per_leaf = optree.tree_leaves(broadcast, is_leaf=_is_spec, none_is_leaf=True)
    out: list[P | None] = []
    for path, leaf, spec in zip(paths, leaves, per_leaf):
        if not isinstance(leaf, (torch.Tensor, Sharded)):
            out.append(None)
        elif spec is None:
            out.append(P())
        elif isinstance(spec, P):
            out.append(spec)
        else:
            raise TypeError(
                f"the spec for {keystr(path)} (shape {tuple(leaf.shape)}) is {spec!r} "
                f"({type(spec).__name__}); specs must be P objects, e.g. P('dp', None). Write "
                f"P(*entries) instead of a tuple or a string."
            )
    return out


def _is_spec(s: Any) -> bool:
    return isinstance(s, P) or s is None


def _one_level(node: Any) -> tuple[list[Any], list[Any], optree.PyTreeSpec]:
    paths, children, treedef = optree.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node, none_is_leaf=True
    )
    return ([] if treedef.is_leaf() else [p[0] for p in paths]), children, treedef


def _describe(x: Any) -> str:
    if isinstance(x, Sharded):
        return f"a Sharded value of shape {x.global_shape} ({x.spec.trimmed()})"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    keys, _, treedef = _one_level(x)
    if treedef.is_leaf():
        return f"{x!r} ({type(x).__name__})"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(keys)}"
    return f"a {type(x).__name__} with keys {keys}"


def _first_mismatch(specs: Any, tree: Any, path: tuple[Any, ...]) -> str | None:
    """Where a specs tree stops being a prefix of ``tree``, described for an error message."""
    if _is_spec(specs):
        return None
    spec_keys, spec_children, spec_def = _one_level(specs)
    keys, children, treedef = _one_level(tree)
    if (
        spec_def.is_leaf()
        or treedef.is_leaf()
        or spec_def.type is not treedef.type
        or (spec_keys != keys)
    ):
        hint = ""
        if isinstance(specs, (tuple, list)) and isinstance(tree, (torch.Tensor, Sharded)):
            hint = (
                " (a tuple or list in a specs tree is structure, not a spec: write P('dp', None))"
            )
        return (
            f"at {keystr(path)}: the tree has {_describe(tree)}, but the specs have "
            f"{_describe(specs)}{hint}"
        )
    for key, s, t in zip(keys, spec_children, children):
        found = _first_mismatch(s, t, (*path, key))
        if found:
            return found
    return None


def _checked_layout(
    path: tuple[Any, ...], shape: Sequence[int], spec: P, mesh: DeviceMesh
) -> Layout:
    sizes = axis_sizes(mesh)
    problem = spec_problem(shape, spec, sizes)
    if problem:
        raise ValueError(
            f"cannot lay out {keystr(path)} (shape {tuple(shape)}) with {spec} on "
            f"{format_mesh(sizes)}: {problem}."
        )
    return Layout.make(shape, spec, sizes)


# --------------------------------------------------------------------------- shard


def shard(tree: Any, mesh: DeviceMesh, specs: Specs, *, check: bool = True) -> Any:
    """Split every tensor in ``tree`` into ``Sharded`` blocks laid out by ``specs``.

    Each rank must hold the same full values (e.g. created from the same seed, or loaded
    from the same file); it keeps its own blocks. Non-tensor leaves pass through unchanged.
    ``shard`` is not differentiable: it places values, ``gather``/``reshard`` move them.

    By default it checks that the ranks agree: one small all-gather (per mesh axis) of a
    checksum of the whole tree, not one per tensor, then it raises ``ValueError`` naming the
    tensors that differ, their shapes and specs, the mesh and the ranks. Without the check, a
    tensor drawn differently on each rank is split silently, and gathering it returns
    blocks that no rank had. Reading the values for the checksum costs about a tenth of
    copying them. On a simulated mesh the check is local and free: only a per-rank value (a
    tensor drawn inside the simulation from an explicit ``torch.Generator``) can differ.
    The check's all-gather is not counted by :func:`count_comms`.

    Args:
        tree: any pytree (dicts, lists, tuples, namedtuples) of tensors.
        mesh: a ``DeviceMesh`` with named axes.
        specs: a ``P`` for every tensor, a tree of ``P`` matching ``tree`` (or a prefix of
            it), or a rule ``fn(dotted_path, tensor) -> P | None``.
        check: compare the values between the ranks first. ``False`` skips it, for values
            that are meant to differ between ranks: each rank keeps its block of its own
            value.

    Raises:
        ValueError: if the values differ between ranks (with ``check``), a spec does not fit
            its tensor or the mesh, or a tensor is on the meta device.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     params = {"w": torch.ones(5, 3), "b": torch.zeros(3), "n": 7}
        ...     sharded = ff.shard(params, mesh, {"w": ff.P("dp"), "b": ff.P(), "n": None})
        ...     sharded["w"].local.shape, sharded["n"]
        (torch.Size([3, 3]), 7)
    """
    check_mesh(mesh, "shard(tree, mesh, specs)")
    paths, leaves, treedef = _flatten(tree)
    check_alive(mesh, "shard()")
    shapes_only = is_shapes_only(mesh)
    per_leaf = resolve_specs(tree, specs)
    out = list(leaves)
    layouts: dict[int, Layout] = {}
    for i, (path, leaf, spec) in enumerate(zip(paths, leaves, per_leaf)):
        if isinstance(leaf, Sharded):
            raise TypeError(
                f"{keystr(path)} is already Sharded ({leaf.spec}); use ff.reshard(tree, specs) "
                f"to change its layout."
            )
        if spec is None:
            if type(leaf).__module__ == "numpy" and hasattr(leaf, "shape"):
                raise TypeError(
                    f"shard(): {keystr(path)} is a numpy array of shape {tuple(leaf.shape)}, "
                    f"not a torch.Tensor, so it would pass through unsharded. Convert it first: "
                    f"torch.from_numpy(array), or ff.tree_map(torch.as_tensor, tree)."
                )
            continue
        if leaf.is_meta and not shapes_only:
            raise ValueError(
                f"shard(): {keystr(path)} (shape {tuple(leaf.shape)}) is on the meta device: "
                f"it has a shape but no values to shard. Materialise it first (for a module "
                f"built on meta: params, buffers = ff.init_sharded(ff.fsdp(module, mesh)))."
            )
        layouts[i] = _checked_layout(path, leaf.shape, spec, mesh)
    if check and not shapes_only:
        _check_same_values(mesh, paths, leaves, per_leaf)
    for i, layout in layouts.items():
        leaf, spec = leaves[i], per_leaf[i]
        if shapes_only:  # no values: this rank's block as a meta tensor
            local = torch.empty(layout.local_shape, dtype=leaf.dtype, device="meta")
            out[i] = Sharded(local, layout.global_shape, spec, mesh)
            continue
        with torch.no_grad():
            full = leaf.detach()
            local = per_coordinate(
                mesh, lambda c, t=full, lay=layout: block_of(on_rank(t, rank_at(mesh, c)), lay, c)
            )
        out[i] = Sharded(local, layout.global_shape, spec, mesh)
    return optree.tree_unflatten(treedef, out)


def _check_same_values(
    mesh: DeviceMesh, paths: list[tuple[Any, ...]], leaves: list[Any], specs: list[P | None]
) -> None:
    """Raise unless every rank holds the same tensors to shard (one all-gather per axis)."""
    named = [
        (keystr(p), t, str(s.trimmed()))
        for p, t, s in zip(paths, leaves, specs)
        if s is not None and isinstance(t, torch.Tensor)
    ]
    if torch.compiler.is_compiling():
        return
    if is_simulated():
        per_rank = agreement.simulated_details([(p, t, s) for p, t, s in named])
        if per_rank:
            raise ValueError(_differs_message(mesh, per_rank, simulated=True))
        return
    sizes = axis_sizes(mesh)
    if all(n == 1 for n in sizes.values()):
        return
    per_rank = agreement.differences(mesh, named, "shard()")
    if per_rank is not None:
        raise ValueError(_differs_message(mesh, per_rank, simulated=False))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _differs_message(
    mesh: DeviceMesh, per_rank: dict[int, list[agreement.Detail]], *, simulated: bool
) -> str:
    """What differs between the ranks' trees for ``shard()``, and how to fix it."""
    where = f"the {'simulated ' if simulated else ''}ranks of {format_mesh(axis_sizes(mesh))}"
    fix = (
        "shard() takes the full value, the same on every rank, and each rank keeps its own "
        "block of it, so gathering would return blocks that no rank had. "
    )
    if simulated:
        fix += (
            "Create the values outside simulated_mesh(), or with torch.manual_seed instead of "
            "an explicit torch.Generator (simulated ranks draw from a generator in turn)"
        )
    else:
        fix += (
            "Seed every rank the same before creating the values (torch.manual_seed(seed), "
            "one seed on every rank, before building the model), or load them from one file "
            "on every rank (ff.checkpoint.load, ff.checkpoint.load_safetensors)"
        )
    fix += (
        "; if the values are meant to differ between ranks (each rank's own data), pass "
        "ff.shard(..., check=False) and each rank keeps its block of its own value."
    )
    first, differ = agreement.first_difference(per_rank)
    if first is None:
        counts = {r: f"{len(t)} tensors" for r, t in per_rank.items()}
        return (
            f"shard(): the ranks hold trees with different numbers of tensors, over {where}:"
            f"\n{agreement.by_rank(counts)}\n{fix}"
        )
    path, shape, dtype, spec, _ = next(iter(per_rank.values()))[first]
    kinds = {t[first][:4] for t in per_rank.values()}
    rows = {}
    for r, t in per_rank.items():
        p, s, d, sp, sums = t[first]
        if len(kinds) > 1:  # different tensors, not only different values
            rows[r] = f"{p} {d} {s} {sp}"
        else:
            rows[r] = f"checksum {agreement.short(sums)}" if sums else "the same value"
    if len(kinds) > 1:
        fix = "Build the same tree on every rank (the same model and configuration). " + fix
    others = [next(iter(per_rank.values()))[i][0] for i in differ[1:]]
    more = (
        f" ({len(others)} more differ: {', '.join(others[:5])}{' ...' if len(others) > 5 else ''})"
        if others
        else ""
    )
    return (
        f"shard(): {path} ({dtype} {shape}, {spec}) differs between {where}{more}:\n"
        f"{agreement.by_rank(rows)}\n{fix}"
    )


# --------------------------------------------------------------------------- bucketed gather


class _GatherRound(torch.autograd.Function):
    """One bucketed round: an all-gather of several blocks over one axis; backward, the
    reduce-scatter of their gradients (both packed by :mod:`functional_fsdp._buckets`)."""

    @staticmethod
    def forward(mesh: DeviceMesh, rnd: Round, *locals_: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        gathered = C.wait(issue_gather(locals_, mesh, rnd, meta=rnd.pieces))  # [n, total]
        (first, *rest) = rnd.pieces
        if not rest and first.dim == 0 and rnd.size > 1:
            # One value gathered on dim 0: the [n, numel] buffer already is its padded full
            # tensor (rank r's block at rows r), so no second copy is held at the peak.
            full = gathered.view(first.padded_shape(rnd.size))
            return (full.narrow(0, 0, first.gathered_len),)
        # Fresh padded full tensors (never aliasing an input shard, also where n == 1).
        outs = [gathered.new_empty(p.padded_shape(rnd.size)) for p in rnd.pieces]
        unpack_gathered(gathered, rnd, outs)
        return tuple(o.narrow(p.dim, 0, p.gathered_len) for p, o in zip(rnd.pieces, outs))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.mesh, ctx.rnd = inputs[:2]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rnd: Round = ctx.rnd
        # Plain differentiable ops (no fused copy): this may run inside torch.func transforms.
        flat = pack_grads(grads, rnd.pieces, rnd.size, fused=False)
        reduced = C.wait(C.raw_reduce_scatter(flat, ctx.mesh, rnd.axis))
        return (None, None, *unpack_reduced(reduced, rnd.pieces))


def _gather_values(
    values: list[Sharded], wanted: list[set[str]], bucket_bytes: int | None
) -> list[Sharded | torch.Tensor]:
    """Gather ``wanted[i]`` axes out of ``values[i]``, minor axes first, bucketed per axis.

    An axis is gathered only once every value that still wants it has it minor-most, so that
    each axis takes one bucketed collective (per dtype, or per ``bucket_bytes``) wherever the
    specs allow it: the rounds of :func:`functional_fsdp._buckets.plan_rounds`, the same
    that the FSDP engine runs. Values whose spec becomes empty are returned as plain tensors
    of their global shape.
    """
    if not values:
        return []
    mesh = values[0].mesh
    rounds = plan_rounds(
        [v.layout for v in values],
        axis_sizes(mesh),
        wanted,
        [v.dtype for v in values],
        bucket_bytes=bucket_bytes,
        skip_size_one=False,  # a size-1 round copies: no output aliases an input shard
    )
    current = [v.local for v in values]
    specs = [v.spec for v in values]
    for rnd in rounds:
        outs = _GatherRound.apply(mesh, rnd, *(current[p.index] for p in rnd.pieces))
        for p, out in zip(rnd.pieces, outs):
            current[p.index] = out
            specs[p.index] = specs[p.index].without(rnd.axis)
    results: list[Sharded | torch.Tensor] = []
    for v, local, spec in zip(values, current, specs):
        if spec == v.spec:
            results.append(v)
        elif not spec.axes:
            results.append(local)
        else:
            results.append(Sharded._unchecked(local, v.global_shape, spec, mesh))
    return results


def _check_bucket_bytes(bucket_bytes: Any, what: str) -> None:
    if bucket_bytes is None:
        return
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(
            f"{what}(bucket_bytes={bucket_bytes!r}): the cap on one bucket's local bytes must be "
            f"a positive int (e.g. bucket_bytes=25 * 2**20), or None for one bucket per dtype."
        )


def _check_values(paths: list[tuple[Any, ...]], values: list[Sharded], what: str) -> None:
    """All values on one mesh and one device, each with a local block of its layout's shape.

    Checked before any collective, so a bad leaf is named by its path instead of failing
    inside c10d.
    """
    check_alive(values[0].mesh, f"{what}()")
    for path, v in zip(paths, values):
        problem = local_shape_problem(tuple(v.local.shape), v.global_shape, v.spec, v.mesh)
        if problem:
            raise ValueError(f"{what}(): {keystr(path)}: {problem}")
    first = values[0]
    for path, v in zip(paths[1:], values[1:]):
        if v.local.device != first.local.device:
            raise ValueError(
                f"{what}() got values on different devices: {keystr(paths[0])} is on "
                f"{first.local.device} but {keystr(path)} (shape {v.global_shape}) is on "
                f"{v.local.device}. Move them to one device first, e.g. "
                f"ff.tree_map(lambda t: t.to({str(first.local.device)!r}), tree)."
            )
    if first.local.is_meta and not is_shapes_only(first.mesh):  # shapes-only: meta is right
        raise ValueError(
            f"{what}(): {keystr(paths[0])} (shape {first.global_shape}, "
            f"{first.spec.trimmed()}) is on the meta device: it has no values to communicate. "
            f"Materialise it first (ff.init_sharded for a module built on meta, or "
            f"ff.checkpoint.load)."
        )
    for path, v in zip(paths[1:], values[1:]):
        if not same_mesh(v.mesh, first.mesh):
            raise ValueError(
                f"{what}() got values on different meshes: {keystr(paths[0])} is on "
                f"{describe_mesh(first.mesh)} but {keystr(path)} is on {describe_mesh(v.mesh)}. "
                f"Call {what}() once per mesh, or reshard the values onto one mesh first."
            )


def gather(
    tree: Any,
    axes: str | Sequence[str] | None = None,
    *,
    bucket_bytes: int | None = None,
    check: bool = True,
) -> Any:
    """Gather ``Sharded`` values over mesh axes (all of them by default).

    A value gathered over every axis of its spec becomes a plain tensor of its global shape
    (padding removed); otherwise it stays ``Sharded`` with those axes removed from its spec.
    Values whose specs do not use the requested axes are returned unchanged. The gather is
    bucketed (one collective per axis and dtype, or per ``bucket_bytes``), and differentiable:
    the gradient of each gathered value is reduce-scattered back onto its shards.

    Args:
        tree: a pytree containing ``Sharded`` values (other leaves pass through).
        axes: the mesh axes to gather, or ``None`` for all.
        bucket_bytes: cap on one bucket's local bytes; ``None`` means one bucket per dtype.
        check: first check that every rank of the gathered axes' groups gathers the same
            values (global shapes, specs and dtypes, in the same order): one small
            all-gather per call (per gathered axis), for the whole tree, not counted by
            :func:`count_comms`. Without it, ranks holding tensors of different shapes with
            equal block sizes get garbage without an error. ``False`` skips it, in a loop
            that gathers the same tree every step (FSDP's own steps never run it).

    Raises:
        ValueError: if the values live on different meshes, an axis to gather is major to
            an axis that stays (gather the minor axis too, or reshard), or (with ``check``)
            the ranks hold different values to gather.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ...     w = ff.shard(torch.arange(12.0).reshape(6, 2), mesh, ff.P(("tp", "dp")))
        ...     ff.gather(w, "dp")
        Sharded(shape=(6, 2), dtype=torch.float32, spec=P('tp'), mesh=Mesh(dp=2, tp=2), local=(3, 2))
    """
    paths, leaves, treedef = _flatten(tree)
    _check_bucket_bytes(bucket_bytes, "gather")
    if axes is not None and not (
        isinstance(axes, str)
        or (
            isinstance(axes, (list, tuple, set, frozenset))
            and all(isinstance(a, str) for a in axes)
        )
    ):
        raise TypeError(
            f"gather(axes={axes!r}): axes names mesh axes: a string ('dp'), a sequence of them "
            f"(('dp', 'tp')), or None for all; got {type(axes).__name__}."
        )
    idx = [i for i, x in enumerate(leaves) if isinstance(x, Sharded)]
    if not idx:
        return tree
    values: list[Sharded] = [leaves[i] for i in idx]
    _check_values([paths[i] for i in idx], values, "gather")
    wanted_axes = None if axes is None else ({axes} if isinstance(axes, str) else set(axes))
    if wanted_axes is not None:
        given = sorted(wanted_axes, key=str)
        names = axis_names(values[0].mesh)
        check_axes(
            values[0].mesh,
            given,
            f"gather(axes={given})",
            f"name some of its axes {names}, or pass axes=None to gather all of them",
        )
    wanted = [
        set(v.spec.axes) if wanted_axes is None else wanted_axes & set(v.spec.axes) for v in values
    ]
    for i, v, w in zip(idx, values, wanted):
        for dim in range(v.ndim):
            entry = v.spec.entry(dim)
            stays = [a for a in entry if a not in w]
            if stays and any(entry.index(a) < entry.index(stays[-1]) for a in w if a in entry):
                raise ValueError(
                    f"cannot gather {sorted(w & set(entry))} out of {keystr(paths[i])} "
                    f"(shape {v.global_shape}, {v.spec}, {format_mesh(axis_sizes(v.mesh))}): "
                    f"dim {dim} is split major-to-minor over {entry}, and gathering a major "
                    f"axis while keeping a minor one does not give a contiguous block. Gather "
                    f"{stays[-1]!r} as well, or reshard to the target spec."
                )
    if check:
        _check_same_layouts("gather", [paths[i] for i in idx], values, wanted, bucket_bytes)
    gathered = _gather_values(values, wanted, bucket_bytes)
    for i, out in zip(idx, gathered):
        leaves[i] = out.local if isinstance(out, Sharded) and not out.spec.axes else out
    return optree.tree_unflatten(treedef, leaves)


def _check_same_layouts(
    what: str,
    paths: list[tuple[Any, ...]],
    values: list[Sharded],
    wanted: list[set[str]],
    bucket_bytes: int | None,
) -> None:
    """Raise unless every rank that takes part in the gathers gathers the same values.

    The ranks compare a hash of what decides the collectives: every value's global shape,
    dtype and spec, the axes gathered out of it, and the bucket cap (one all-gather per
    gathered axis, for the whole tree).
    """
    mesh = values[0].mesh
    sizes = axis_sizes(mesh)
    axes = [a for a in sizes if sizes[a] > 1 and any(a in w for w in wanted)]
    if not axes or is_simulated() or torch.compiler.is_compiling():
        return  # no collective; or one program for every simulated rank
    mine: list[agreement.Detail] = [
        (
            keystr(p),
            tuple(v.global_shape),
            _dtype_name(v.dtype),
            f"{v.spec.trimmed()} gathering {sorted(w, key=str)}",
            None,
        )
        for p, v, w in zip(paths, values, wanted)
    ]
    row = [len(mine), agreement.layout_hash([(m[1:4]) for m in mine] + [bucket_bytes])]
    device = agreement.device(mesh)
    if agreement.rows_agree(mesh, torch.tensor(row, device=device), f"{what}()", axes):
        return
    per_rank = agreement.details(mesh, mine, axes)
    first, differ = agreement.first_difference(per_rank)
    mesh_text = format_mesh(sizes)
    fix = (
        f"Every rank of the gathered axes {axes} must call {what}() with the same values (the "
        f"same global shapes, specs and dtypes, in the same order): the collective joins the "
        f"ranks' blocks, and blocks of different tensors would be mixed without an error. Look "
        f"for a model or configuration built differently on some rank (a branch on the rank, "
        f"per-rank arguments)."
    )
    if first is None:
        counts = {r: f"{len(t)} Sharded values" for r, t in per_rank.items()}
        if len(set(counts.values())) == 1:  # only bucket_bytes differs
            counts = {r: f"bucket_bytes={bucket_bytes}" for r in per_rank}
        return_text = agreement.by_rank(counts)
        raise ValueError(
            f"{what}(): the ranks of {mesh_text} gather different trees:\n{return_text}\n{fix}"
        )
    rows = {
        r: f"{t[first][0]} {t[first][2]} {t[first][1]} {t[first][3]}" for r, t in per_rank.items()
    }
    path = next(iter(per_rank.values()))[first][0]
    more = f" ({len(differ) - 1} more differ)" if len(differ) > 1 else ""
    raise ValueError(
        f"{what}(): {path} differs between the ranks of {mesh_text}{more}:\n"
        f"{agreement.by_rank(rows)}\n{fix}"
    )


# --------------------------------------------------------------------------- reshard


def reshard(tree: Any, specs: Specs, *, bucket_bytes: int | None = None, check: bool = True) -> Any:
    """Change the layout of every ``Sharded`` value in ``tree`` to ``specs``.

    Axes that the new spec drops or moves are gathered (bucketed); axes it adds are sliced
    locally, without communication. Plain tensors in ``tree`` are left alone (use
    :func:`shard` for them). Differentiable, like :func:`gather`. When something is
    gathered, ``check`` first compares the values' layouts between the ranks, as
    :func:`gather` does (``check=False`` skips it).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = ff.shard(torch.arange(6.0).reshape(2, 3), mesh, ff.P("dp"))
        ...     ff.reshard(w, ff.P(None, "dp")).local.shape
        torch.Size([2, 2])
    """
    paths, leaves, treedef = _flatten(tree)
    _check_bucket_bytes(bucket_bytes, "reshard")
    per_leaf = resolve_specs(tree, specs)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, Sharded)]
    if not idx:
        for path, leaf, spec in zip(paths, leaves, per_leaf):
            if isinstance(leaf, torch.Tensor) and spec is not None and spec.axes:
                raise TypeError(
                    f"reshard(): {keystr(path)} (shape {tuple(leaf.shape)}) is a plain tensor, "
                    f"not Sharded, so reshard() would leave it as it is instead of laying it "
                    f"out with {spec}. Split full tensors with ff.shard(tree, mesh, specs); "
                    f"reshard() changes the layout of Sharded values."
                )
        return tree
    values: list[Sharded] = [leaves[i] for i in idx]
    _check_values([paths[i] for i in idx], values, "reshard")
    targets = []
    wanted = []
    for i, v in zip(idx, values):
        target = per_leaf[i] or P()
        _checked_layout(paths[i], v.global_shape, target, v.mesh)
        target = target.padded(v.ndim)
        targets.append(target)
        drop: set[str] = set()
        for dim in range(v.ndim):
            src, dst = v.spec.entry(dim), target.entry(dim)
            keep = 0
            while keep < min(len(src), len(dst)) and src[keep] == dst[keep]:
                keep += 1
            drop.update(src[keep:])
        wanted.append(drop)
    if check:
        _check_same_layouts("reshard", [paths[i] for i in idx], values, wanted, bucket_bytes)
    gathered = _gather_values(values, wanted, bucket_bytes)
    for i, v, target, out in zip(idx, values, targets, gathered):
        leaves[i] = _slice_to(out, v, target)
    return optree.tree_unflatten(treedef, leaves)


def _slice_to(value: Sharded | torch.Tensor, original: Sharded, target: P) -> Sharded:
    """Split ``value`` further, locally, until its spec is ``target``.

    On real processes each rank cuts its own block with ``narrow`` and pads it: no index
    tensor, so nothing is built on the host or copied to the device. On a simulated mesh the
    per-rank cut is an ``index_select`` with per-rank indices built on the value's device
    (padding positions point at an appended zero slice), so the ops are the same on every
    rank and stay differentiable there too. Either way the result is a new compact tensor.
    """
    mesh = original.mesh
    spec, local = (value.spec, value.local) if isinstance(value, Sharded) else (P(), value)
    if spec.padded(original.ndim) == target:
        return Sharded._unchecked(local, original.global_shape, target, mesh)
    extra = P(*(target.entry(d)[len(spec.entry(d)) :] for d in range(original.ndim)))
    sub = Layout.make(tuple(local.shape), extra, axis_sizes(mesh))
    dims = [d for d in range(original.ndim) if extra.entry(d)]
    if is_simulated():
        for dim in dims:
            local = _select_block(local, sub, mesh, dim)
    else:
        local = _cut_block(local, sub, mesh, dims)
    return Sharded(local, original.global_shape, target, mesh)


def _cut_block(local: torch.Tensor, sub: Layout, mesh: DeviceMesh, dims: list[int]) -> torch.Tensor:
    """This rank's padded block of ``dims``: ``narrow`` and ``pad`` with Python ints."""
    slices, pads = sub.owned(local_coordinate(mesh))
    fresh = False
    for dim in dims:
        cut = slices[dim]
        local = local.narrow(dim, cut.start, cut.stop - cut.start)
        if pads[dim]:
            pad = [0, 0] * (local.ndim - 1 - dim) + [0, pads[dim]]
            local, fresh = torch.nn.functional.pad(local, pad), True
    # Never a view: it would alias the caller's value or pin a whole gathered buffer.
    return local if fresh else local.clone(memory_format=torch.contiguous_format)


def _select_block(local: torch.Tensor, sub: Layout, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Every simulated rank's block of ``dim`` by ``index_select`` with per-rank indices."""
    length = local.shape[dim]
    device = local.device
    index = per_coordinate(mesh, lambda c: _block_index(sub, c, dim, length, device))
    # Append one zero slot for the padding positions (also when ``local`` is empty).
    padded = torch.nn.functional.pad(local, [0, 0] * (local.ndim - 1 - dim) + [0, 1])
    return torch.index_select(padded, dim, index)


def _block_index(
    sub: Layout, coord: dict[str, int], dim: int, length: int, device: torch.device
) -> torch.Tensor:
    """Indices into a block of ``length`` (plus one zero slot) that cut out ``coord``'s piece."""
    slices, pads = sub.owned(coord)
    real = torch.arange(slices[dim].start, slices[dim].stop, device=device)
    return torch.cat([real, torch.full((pads[dim],), length, dtype=torch.long, device=device)])
