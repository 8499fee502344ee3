"""A faster ``LocalTensorMode``: the same per-rank computation with less bookkeeping per op.

``torch.distributed._local_tensor.LocalTensorMode`` runs every op once per simulated rank
through one generic loop. For each op and rank it rebuilds the arguments with pytree and
saves and restores that rank's random-number state; its ``LocalTensor`` wrappers answer every
``stride()`` and ``storage_offset()`` query (autograd and ``torch.func`` ask several per op)
through the same loop; and the storage aliasing of a view op's output runs its queries in a
fresh ``LocalTensorMode`` each time. A small GPT step spends most of its time there.

:class:`SimulationMode` keeps the same per-rank calls and drops that bookkeeping where it
cannot change a result: for ``aten`` ops that draw no random numbers, on per-rank and plain
tensors, it maps the arguments once per rank, skips the random-number state (restoring the
generator to where ``LocalTensorMode`` leaves it), answers metadata queries directly and
handles the aliasing queries itself. Everything else (collectives, random ops, factories,
per-rank sizes, other tensor subclasses) goes to ``LocalTensorMode`` unchanged. The values
are bitwise those of ``LocalTensorMode`` (tested on every training strategy).

This module imports torch's private simulation: import it only where one is needed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed._local_tensor as lt
from torch._ops import OpOverload
from torch.utils._python_dispatch import (
    _pop_mode,
    _push_mode,
    get_alias_info,
    return_and_correct_aliasing,
)

aten = torch.ops.aten
LocalTensor = lt.LocalTensor
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_METADATA = frozenset(
    {
        aten.sym_stride.default,
        aten.sym_storage_offset.default,
        aten.sym_numel.default,
        aten.is_contiguous.default,
        aten.is_contiguous.memory_format,
    }
)
# The tensor methods that answer those queries on a plain tensor, without the dispatcher.
_QUERIES = {
    aten.sym_stride.default: lambda t: list(t.stride()),  # a list, as the op returns
    aten.sym_storage_offset.default: torch.Tensor.storage_offset,
    aten.sym_numel.default: torch.Tensor.numel,
    aten.is_contiguous.default: torch.Tensor.is_contiguous,
}
# Ops LocalTensorMode treats specially: always left to it.
_GENERIC = frozenset({aten.split.Tensor, aten.hash_tensor.default})


class _OpInfo(NamedTuple):
    fast: bool  # runs on the fast path (when its arguments allow)
    metadata: bool  # a query of tensor metadata, not a computation
    inplace: bool  # LocalTensorMode's in-place test: returns its first argument
    inplace_view: bool  # changes its first argument's metadata
    aliasing: bool  # needs return_and_correct_aliasing (views, in-place, out=)


_OPS: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OPS.get(func)
    if info is None:
        fast = (
            isinstance(func, OpOverload)
            and func.namespace == "aten"
            and func not in _GENERIC
            and torch.Tag.nondeterministic_seeded not in func.tags
        )
        aliasing = False
        if fast and func not in _METADATA:
            schema = get_alias_info(func)
            aliasing = bool(
                schema.read_only_alias_match_indexes
                or schema.is_inplace_view_op
                or schema.outs_write_aliases is not None
            )
        info = _OPS[func] = _OpInfo(
            fast=fast,
            metadata=func in _METADATA,
            inplace=lt._is_inplace_op(func),
            inplace_view=isinstance(func, OpOverload) and torch.Tag.inplace_view in func.tags,
            aliasing=aliasing,
        )
    return info


def _kind(x: Any) -> int:
    """1: holds a per-rank tensor; 0: holds none; -1: something only LocalTensorMode handles."""
    if isinstance(x, LocalTensor):
        return 1
    if isinstance(x, torch.Tensor):
        return 0 if type(x) in _PLAIN else -1
    if isinstance(x, (list, tuple)):
        found = 0
        for y in x:
            if type(y) is int or y is None:  # the common case: sizes, dims, absent tensors
                continue
            kind = _kind(y)
            if kind < 0:
                return -1
            found |= kind
        return found
    return -1 if isinstance(x, _SYMBOLIC) else 0


def _on_rank(x: Any, r: int) -> Any:
    if isinstance(x, LocalTensor):
        return x._local_tensors[r]
    if isinstance(x, (list, tuple)):
        return type(x)(_on_rank(y, r) for y in x)
    return x


def _split(values: Any, ranks: list[int]) -> list[list[Any]]:
    """``values`` (a sequence) once per rank, each per-rank tensor replaced by its part."""
    rows = [list(values) for _ in ranks]
    try:
        for i, v in enumerate(values):
            if isinstance(v, LocalTensor):
                parts = v._local_tensors
                for row, r in zip(rows, ranks):
                    row[i] = parts[r]
            elif isinstance(v, (list, tuple)) and _kind(v) == 1:
                for row, r in zip(rows, ranks):
                    row[i] = _on_rank(v, r)
    except KeyError as e:
        raise _foreign(e.args[0], len(ranks)) from None
    return rows


def _foreign(rank: int, n: int) -> ValueError:
    return ValueError(
        f"a value with one tensor per rank holds no tensor for rank {rank} of this {n}-rank "
        f"simulation: it was made in another simulation, which has ended. Values live only "
        f"as long as their simulation: keep the mesh alive with `mesh = "
        f"ff.simulated_mesh(..., persistent=True)`, or create and use the values inside one "
        f"`with ff.simulated_mesh(...) as mesh:` block. A model (or batch) meant for several "
        f"simulations must be built before any starts (outside ff.simulated_mesh), so that "
        f"it holds plain tensors."
    )


def _wrap(ranks: list[int], parts: list[Any]) -> Any:
    """Per-rank results as one value, as ``LocalTensor``'s own combination gives it.

    Tensors of one shape, stride and kind on every rank (nearly all) are wrapped directly:
    ``LocalTensor(...)`` works out the wrapper's metadata in Python, dim by dim and rank by
    rank, which costs more than the op itself for small tensors.
    """
    first = parts[0]
    if isinstance(first, (list, tuple)):  # several outputs (foreach ops, layer norm, ...)
        n = len(first)
        if all(len(p) == n for p in parts):
            return type(first)(_wrap_one(ranks, [p[i] for p in parts]) for i in range(n))
        return lt._combine_rank_results(dict(zip(ranks, parts)), None)
    return (
        _wrap_one(ranks, parts)
        if isinstance(first, torch.Tensor)
        else (lt._combine_rank_results(dict(zip(ranks, parts)), None))
    )


def _wrap_one(ranks: list[int], parts: list[Any]) -> Any:
    first = parts[0]
    if type(first) is torch.Tensor and not first.requires_grad:
        shape, stride = first.shape, first.stride()
        dtype, layout, conj, neg = first.dtype, first.layout, first.is_conj(), first.is_neg()
        plain = not (conj or neg) and layout == torch.strided
        for t in parts[1:]:
            if (
                type(t) is not torch.Tensor
                or t.shape != shape
                or t.stride() != stride
                or t.dtype != dtype
                or t.requires_grad
                or not (plain and t.layout == torch.strided and not t.is_conj() and not t.is_neg())
            ):
                break
        else:
            size = list(shape)
            out = torch.Tensor._make_wrapper_subclass(
                LocalTensor,
                size,
                strides=list(stride),
                dtype=dtype,
                device=first.device,
                layout=layout,
                dispatch_sizes_strides_policy="sizes",
                requires_grad=False,
                _extra_dispatch_keys=lt._get_extra_dispatch_keys(first),
            )
            torch._C._set_throw_on_mutable_data_ptr(out)
            out._local_tensors = dict(zip(ranks, parts))
            out._ranks = frozenset(ranks)
            out._size = size
            return out
    return lt._combine_any_rank_results(dict(zip(ranks, parts)))


def _same(values: list[Any]) -> Any:
    """The common value of ``values``, or ``None`` if they differ."""
    first = values[0]
    for v in values[1:]:
        if v != first:
            return None
    return first


class SimulationMode(lt.LocalTensorMode):  # type: ignore[misc]
    """``LocalTensorMode`` over ``ranks`` with a fast path for common ``aten`` ops."""

    def __init__(self, ranks: int) -> None:
        super().__init__(ranks)
        self._rank_order = sorted(self.ranks)
        # The output whose storage aliasing is being corrected, with its known metadata.
        self._fresh: tuple[Any, dict[Any, Any]] | None = None

    def __torch_dispatch__(
        self,
        func: Any,
        types: tuple[Any, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kind = _kind(args)
        if kind >= 0 and kwargs:
            more = _kind(tuple(kwargs.values()))
            kind = -1 if more < 0 else kind | more
        if kind == 0 and self._disable:  # switched off, plain tensors only: run as is
            return func(*args, **(kwargs or {}))
        if kind == 1 and (func is aten.sym_size.default or func is aten.dim.default):
            size = args[0]._size  # what LocalTensorMode answers, without its pytree pass
            return tuple(size) if func is aten.sym_size.default else len(size)
        info = _op_info(func)
        if kind != 1 or self._disable or not info.fast:
            return super().__torch_dispatch__(func, types, args, kwargs)
        ranks = self._rank_order
        if info.metadata:
            fresh = self._fresh
            if fresh is not None and args[0] is fresh[0] and func in fresh[1]:
                return fresh[1][func]
            query = _QUERIES.get(func)
            if query is not None and len(args) == 1 and isinstance(args[0], LocalTensor):
                parts = args[0]._local_tensors
                if len(parts) != len(ranks):
                    raise _foreign(next(r for r in ranks if r not in parts), len(ranks))
                results = [query(parts[r]) for r in ranks]
            else:
                results = [func(*a) for a in _split(args, ranks)]
            same = _same(results)
            if same is not None:
                return same
            return lt._combine_rank_results(dict(zip(ranks, results)), None)
        rank_args = _split(args, ranks)
        if kwargs:
            keys = list(kwargs)
            rank_kwargs = [dict(zip(keys, v)) for v in _split(list(kwargs.values()), ranks)]
            results = [func(*a, **k) for a, k in zip(rank_args, rank_kwargs)]
        else:
            results = [func(*a) for a in rank_args]
        if self._per_rank_rng_states:
            # LocalTensorMode leaves the generator at the last rank's state after any op.
            lt._set_rng_state(*self._per_rank_rng_states[ranks[-1]])
        if info.inplace:
            out = args[0]
            if info.inplace_view:
                out._sync_meta()
            return out
        out = _wrap(ranks, results)
        if not info.aliasing:
            return out
        fresh = None
        if isinstance(out, LocalTensor):
            stride = _same([list(t.stride()) for t in results])
            offset = _same([t.storage_offset() for t in results])
            fresh = {}
            if stride is not None:
                fresh[aten.sym_stride.default] = stride
            if offset is not None:
                fresh[aten.sym_storage_offset.default] = offset
        # The aliasing correction queries the output's metadata: answer here (from the
        # per-rank results when they agree) instead of in a fresh LocalTensorMode per query.
        saved, self._fresh = self._fresh, (out, fresh) if fresh else None
        _push_mode(self)
        try:
            return return_and_correct_aliasing(func, args, kwargs or {}, out)
        finally:
            _pop_mode()
            self._fresh = saved
