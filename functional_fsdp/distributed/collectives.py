"""Differentiable collectives over named mesh axes: the tensor collectives of the library.

Each collective is an ``autograd.Function`` with ``setup_context`` built on the c10d
functional ops, so it works under plain autograd and inside ``torch.func.grad``,
``grad_and_value`` and ``vjp``. Transposes:

* :func:`all_gather` and :func:`reduce_scatter` are each other's transpose.
* :func:`all_reduce` (forward psum, backward identity) and :func:`all_reduce_grad`
  (forward identity, backward psum) are each other's transpose; ``ff.reduce_from`` and
  ``ff.copy_to`` are Megatron's names for them over ``"tp"``.

Every call is recorded by the active :func:`count_comms` counters (:mod:`.accounting`). A
collective over an axis of size 1 is skipped and not counted.

Failures are named. A collective that times out or loses a peer raises
:class:`CollectiveError` (:mod:`.failures`), which says which collective, over which mesh
axis, with which shape and dtype, what usually causes it and how to change the timeout. With
:func:`check_collectives` (or ``FUNCTIONAL_FSDP_CHECK=1``) every rank first checks that all
ranks of the group issue the same collective with the same shapes and dtypes, and
:func:`check_same_on_ranks` checks that values meant to be replicated are (both in
:mod:`.checks`; when it is off, a collective reads only its switch).

The names of those modules that the rest of the library uses are re-exported here.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from . import checks
from .accounting import CommCounter as CommCounter
from .accounting import CommRecord as CommRecord
from .accounting import Counters as Counters
from .accounting import active_counters as active_counters
from .accounting import count_comms as count_comms
from .accounting import current_label, labelled, record
from .axes import axis_sizes, check_axes, local_coordinate
from .checks import check_collective
from .checks import check_collectives as check_collectives
from .checks import check_same_on_ranks as check_same_on_ranks
from .failures import CollectiveError as CollectiveError
from .failures import What, failure, wait_tensor
from .simulate import check_alive, is_simulated

ReduceOp = Literal["sum", "mean"]


def __getattr__(name: str) -> Any:
    if name == "_CHECK":  # the debug switch lives in .checks; read it there, never a copy
        return checks._CHECK
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- raw ops


def _tag(out: torch.Tensor, what: What) -> torch.Tensor:
    """Remember what an async result is, so that :func:`wait` can name it if it fails."""
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out._ff_what = what  # type: ignore[attr-defined]
    return out


def _group(mesh: DeviceMesh, axis: str) -> Any:
    try:
        return mesh.get_group(axis)
    except RuntimeError:  # a mesh whose simulation has ended: say so, and how to fix it
        check_alive(mesh, f"a collective over {axis!r}")
        raise


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    # A simulated LocalTensor's .contiguous() is an autograd.Function that torch.func
    # transforms refuse, even when there is nothing to do: skip it when already contiguous.
    return x if x.is_contiguous() else x.contiguous()


def _group_name(mesh: DeviceMesh, axis: str) -> str:
    return _group(mesh, axis).group_name


def _issued(out: torch.Tensor, what: What) -> torch.Tensor:
    """Wrap a c10d functional op's result so that it waits on first use (or in :func:`wait`).

    Under ``torch.func`` transforms the result is a functorch wrapper, and an
    ``AsyncCollectiveTensor`` inside it would never be unwrapped: it would leak into the
    gradients that ``torch.func.grad`` returns (hiding a simulated value's per-rank tensors).
    There the collective is waited on at once.
    """
    if torch._C._functorch.is_functorch_wrapped_tensor(out):
        return wait_tensor(out, what)
    return _tag(funcol._maybe_wrap_tensor(out), what)


def raw_all_gather(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """All-gather ``x`` over ``axis`` along a new leading dim: ``[size(axis), *x.shape]``.

    Not differentiable; returns an async tensor that waits on first use. ``meta`` describes
    the values packed in ``x`` (e.g. their shapes and specs) for the debug check of
    :func:`check_collectives`; it is not read otherwise.
    """
    n = axis_sizes(mesh)[axis]
    if n == 1:
        return x.unsqueeze(0)
    if checks._CHECK:
        check_collective("all_gather", mesh, axis, x, None, meta)
    x = _contiguous(x)
    record("all_gather", axis, n, _nbytes(x) * n, x.dtype, counters)
    what: What = ("all_gather", mesh, axis, x.shape, x.dtype)
    with torch.no_grad():
        out = _issued(
            torch.ops._c10d_functional.all_gather_into_tensor(
                x.reshape(-1), n, _group_name(mesh, axis)
            ),
            what,
        )
    return _tag(out.view(n, *x.shape), what)


def raw_all_gather_parts(
    parts: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    axis: str,
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """All-gather the concatenation of ``parts`` (each flattened) over ``axis``:
    ``[size(axis), total numel]``. Not differentiable; returns an async tensor.

    On real processes the parts are copied straight into this rank's row of the output,
    which is gathered in place (as FSDP2 does): no separate input buffer is held while the
    collective is in flight. On gloo that is one op (:func:`_gloo_all_gather`), traced steps
    included. Simulated, or traced on another backend, the parts are concatenated first
    (:func:`raw_all_gather`). ``meta`` as for :func:`raw_all_gather`.
    """
    n = axis_sizes(mesh)[axis]
    gloo = n > 1 and not is_simulated() and _is_gloo(mesh, axis)
    flat_parts = [p.reshape(-1) for p in parts]
    if n == 1 or is_simulated() or (torch.compiler.is_compiling() and not gloo):
        return raw_all_gather(torch.cat(flat_parts), mesh, axis, counters=counters, meta=meta)
    total, dtype = sum(p.numel() for p in parts), parts[0].dtype
    if checks._CHECK:  # the check reads the shape and dtype only
        check_collective(
            "all_gather", mesh, axis, parts[0].new_empty(total, device="meta"), None, meta
        )
    record("all_gather", axis, n, total * parts[0].element_size() * n, dtype, counters)
    what: What = ("all_gather", mesh, axis, torch.Size([total]), dtype)
    group = _group_name(mesh, axis)
    with torch.no_grad():
        if gloo:
            out = torch.ops.functional_fsdp.gloo_all_gather(flat_parts, n, group)
        else:
            out = parts[0].new_empty(n * total)
            row = out.narrow(0, local_coordinate(mesh)[axis] * total, total)
            torch.cat(flat_parts, out=row)
            out = torch.ops._c10d_functional.all_gather_into_tensor_out(row, n, group, out=out)
    return _tag(_issued(out, what).view(n, total), what)


@torch.library.custom_op("functional_fsdp::gloo_all_gather", mutates_args=())
def _gloo_all_gather(parts: list[torch.Tensor], n: int, group_name: str) -> torch.Tensor:
    """Issue the all-gather of the concatenated ``parts`` over a gloo group; return its
    ``[n * total]`` output, which holds the result once ``wait_tensor`` has returned.

    The concatenation is written straight into this rank's row, and each rank's row is
    broadcast in place (gloo's own all-gather would receive into a buffer of its own and copy
    it out: the output twice while in flight; the same bytes go over the wire, and one group
    runs the broadcasts in turn). One op, so that a traced step keeps the packing where the
    gather is issued and holds no separate input buffer.
    """
    group = c10d._resolve_process_group(group_name)
    total = sum(p.numel() for p in parts)
    out = parts[0].new_empty(n * total)
    torch.cat(parts, out=out.narrow(0, group.rank() * total, total))
    for source in range(n):
        torch.ops._c10d_functional.broadcast_(
            out.narrow(0, source * total, total), source, group_name
        )
    return out


@_gloo_all_gather.register_fake
def _(parts: list[torch.Tensor], n: int, group_name: str) -> torch.Tensor:
    return parts[0].new_empty(n * sum(p.numel() for p in parts))


GLOO_ALL_GATHER = _gloo_all_gather._opoverload  # the op a traced graph holds


def raw_reduce_scatter(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    op: ReduceOp = "sum",
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """Reduce ``x`` (shape ``[size(axis), *rest]``) over ``axis`` and keep row ``index(axis)``.

    Not differentiable; the result may be an async tensor that waits on first use. ``meta``
    as for :func:`raw_all_gather`.
    """
    n = axis_sizes(mesh)[axis]
    if x.shape[0] != n:
        raise ValueError(f"reduce_scatter over {axis!r} needs a leading dim of {n}, got {x.shape}")
    if n == 1:
        out = x[0]
    else:
        if checks._CHECK:
            check_collective("reduce_scatter", mesh, axis, x, op, meta)
        x = _contiguous(x)
        record("reduce_scatter", axis, n, _nbytes(x), x.dtype, counters)
        what: What = ("reduce_scatter", mesh, axis, x.shape, x.dtype)
        ops, group = torch.ops._c10d_functional, _group_name(mesh, axis)
        with torch.no_grad():
            if _direct_reduce_scatter(mesh, axis):  # see raw_reduce_scatter_start
                rows = [x[0].numel()] * n
                received = ops.all_to_all_single(x.reshape(-1), rows, rows, group)
                out = wait(_issued(received, what)).view(x.shape).sum(0)
                release(received)
            else:
                out = _issued(ops.reduce_scatter_tensor(x.reshape(-1), "sum", n, group), what)
                out = _tag(out.view(x.shape[1:]), what)
    return wait(out) / n if op == "mean" else out


def raw_reduce_scatter_start(
    x: torch.Tensor, mesh: DeviceMesh, axis: str, *, counters: Counters = None, meta: Any = None
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Start a sum reduce-scatter of ``x`` (``[size(axis), *rest]``); return ``(out, finish)``.

    ``out`` holds the result only after ``finish()`` (call it exactly once; it blocks until
    the collective is done, and raises :class:`CollectiveError` if it failed). For callers
    that overlap the collective with other work and hand ``out`` on before it is ready. Not
    differentiable; pass plain tensors. ``meta`` as for :func:`raw_all_gather`.
    """
    n = axis_sizes(mesh)[axis]
    if x.shape[0] != n:
        raise ValueError(f"reduce_scatter over {axis!r} needs a leading dim of {n}, got {x.shape}")
    if n == 1:
        return x[0], lambda: None
    if checks._CHECK:
        check_collective("reduce_scatter", mesh, axis, x, "sum", meta)
    x = _contiguous(x)
    record("reduce_scatter", axis, n, _nbytes(x), x.dtype, counters)
    what: What = ("reduce_scatter", mesh, axis, x.shape, x.dtype)
    ops, group = torch.ops._c10d_functional, _group_name(mesh, axis)
    with torch.no_grad():
        if not _direct_reduce_scatter(mesh, axis):
            raw = ops.reduce_scatter_tensor(x.reshape(-1), "sum", n, group)

            def wait_raw() -> None:
                wait_tensor(raw, what)

            return raw.view(x.shape[1:]), wait_raw
        # gloo has no reduce-scatter of its own: it all-reduces a copy of the whole input
        # (twice the traffic). An all-to-all and a local sum send (n-1)/n of it once.
        rows = [x[0].numel()] * n
        received = ops.all_to_all_single(x.reshape(-1), rows, rows, group)
        out = x.new_empty(x.shape[1:])

    def finish() -> None:
        with torch.no_grad():
            wait_tensor(received, what)
            torch.sum(received.view(n, -1), dim=0, out=out.view(-1))
        release(received)

    return out, finish


def receives_copy(mesh: DeviceMesh, axis: str) -> bool:
    """Whether a reduce-scatter started over ``axis`` (:func:`raw_reduce_scatter_start`) holds
    a receive buffer as large as its input until it is finished (gloo's all-to-all)."""
    return axis_sizes(mesh)[axis] > 1 and _direct_reduce_scatter(mesh, axis)


def _direct_reduce_scatter(mesh: DeviceMesh, axis: str) -> bool:
    """gloo lacks a reduce-scatter of its own (see :func:`raw_reduce_scatter_start`)."""
    return _is_gloo(mesh, axis)


def _is_gloo(mesh: DeviceMesh, axis: str) -> bool:
    return dist.get_backend(_group(mesh, axis)) == "gloo"


def raw_all_reduce(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str | tuple[str, ...],
    op: ReduceOp | Literal["max"] = "sum",
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """Sum (average, or take the largest of) ``x`` over one or several axes. Not
    differentiable.

    ``meta`` as for :func:`raw_all_gather`.
    """
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    sizes = axis_sizes(mesh)
    total, issued = 1, 0
    for a in axes:
        n = sizes[a]
        total *= n
        if n == 1:
            continue
        if issued:  # the next axis reduces this one's result: wait here, where it has a name
            x = wait(x)
        if checks._CHECK:
            check_collective("all_reduce", mesh, a, x, op, meta)
        record("all_reduce", a, n, _nbytes(x), x.dtype, counters)
        what: What = ("all_reduce", mesh, a, x.shape, x.dtype)
        with torch.no_grad():
            x = _issued(
                torch.ops._c10d_functional.all_reduce(
                    _contiguous(x), "max" if op == "max" else "sum", _group_name(mesh, a)
                ),
                what,
            )
        issued += 1
    return wait(x) / total if op == "mean" else x


_MESH_GROUPS: weakref.WeakKeyDictionary[DeviceMesh, str] = weakref.WeakKeyDictionary()


def _mesh_group_name(mesh: DeviceMesh) -> str:
    """The process group over all of ``mesh``'s ranks, in row-major coordinate order.

    A 1-D mesh's own group; for more axes, the mesh flattened into one (``DeviceMesh._flatten``
    makes a new group: a collective over the mesh the first time, cached with the mesh).
    """
    names = axis_sizes(mesh)
    if len(names) == 1:
        return _group_name(mesh, next(iter(names)))
    name = _MESH_GROUPS.get(mesh)
    if name is None:
        flat = mesh._flatten("+".join(names))
        name = _MESH_GROUPS[mesh] = flat.get_group().group_name
    return name


def raw_all_to_all(
    x: torch.Tensor,
    mesh: DeviceMesh,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    *,
    counters: Counters = None,
    meta: Any = None,
) -> torch.Tensor:
    """Send consecutive chunks of the flat ``x``, ``send_sizes[k]`` elements to the mesh's
    ``k``-th rank, and receive ``recv_sizes[k]`` elements from each: one all-to-all over all
    of ``mesh``'s axes at once (ranks in row-major coordinate order). Waits; not
    differentiable.

    Recorded as kind ``"all_to_all"`` over the axes joined by ``+`` (``"dp+tp"``), with the
    bytes this rank sends to the others (its own chunk stays). ``meta`` is accepted for the
    signature of the other raw collectives; the debug check of :func:`check_collectives`
    does not cover all-to-alls (their sizes differ by rank by design).
    """
    sizes = axis_sizes(mesh)
    n = math.prod(sizes.values())
    if len(send_sizes) != n or len(recv_sizes) != n or sum(send_sizes) != x.numel():
        raise ValueError(
            f"all_to_all over {'+'.join(sizes)}: {len(send_sizes)} send and {len(recv_sizes)} "
            f"receive sizes for {n} ranks, {sum(send_sizes)} elements to send of {x.numel()}"
        )
    if n == 1:
        return x.reshape(-1)
    axis = "+".join(sizes)
    if len(set(send_sizes)) == 1:  # the same to every rank (no coordinate: simulated too)
        sent = (n - 1) * send_sizes[0] * x.element_size()
    else:
        me = local_coordinate(mesh)
        index = 0
        for name, size in sizes.items():
            index = index * size + me[name]
        sent = (sum(send_sizes) - send_sizes[index]) * x.element_size()
    record("all_to_all", axis, n, sent, x.dtype, counters)
    what: What = ("all_to_all", mesh, axis, x.shape, x.dtype)
    with torch.no_grad():
        out = torch.ops._c10d_functional.all_to_all_single(
            _contiguous(x.reshape(-1)), list(recv_sizes), list(send_sizes), _mesh_group_name(mesh)
        )
        return wait_tensor(out, what)


def release(*buffers: torch.Tensor) -> None:
    """Free finished collectives' buffers now, on this thread.

    gloo's worker holds a collective's tensors until it drops the finished work, so the last
    reference to a buffer can die there: later than the code that used it, and out of sight of
    torch's profiler (``ff.tensor_peak``). Only for buffers this library allocated and no
    longer reads; real tensors only (traced or simulated values are left to their owners).
    """
    for b in buffers:
        if releasable(b):
            b.untyped_storage().resize_(0)


def releasable(t: torch.Tensor) -> bool:
    """Whether :func:`release` frees ``t``: a real host tensor, outside traces and simulations
    (gloo's worker is the one that would free it late)."""
    return (
        type(t) is torch.Tensor
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        and t.device.type == "cpu"
        and not is_simulated()
        and not torch.compiler.is_compiling()
    )


def wait(x: torch.Tensor) -> torch.Tensor:
    """Block until an async collective result is ready, and unwrap it (plain tensors pass).

    The result is never an ``AsyncCollectiveTensor``: such wrappers must not leak into
    user-visible values (simulated per-rank values would be hidden behind them).

    Raises:
        CollectiveError: if the collective failed (timed out, or a peer went away), naming
            the collective, its mesh axis, shape and dtype.
    """
    if isinstance(x, funcol.AsyncCollectiveTensor):
        try:
            return x.wait()
        except RuntimeError as e:
            raise failure(getattr(x, "_ff_what", None), e) from e
    return x


# --------------------------------------------------------------------------- differentiable


def _move_leading(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``[n, d0, .., dk, ..] -> [d0, .., n*dk, ..]``: merge the group dim into ``dim``."""
    if dim == 0:
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    x = x.movedim(0, dim)
    return x.reshape(*x.shape[:dim], x.shape[dim] * x.shape[dim + 1], *x.shape[dim + 2 :])


def _split_leading(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`_move_leading`: ``[.., n*dk, ..] -> [n, .., dk, ..]``."""
    x = x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :])
    return x.movedim(dim, 0)


def _check_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> None:
    for axis in axes:
        check_axes(mesh, (axis,), f"{name} over {axis!r}")


def _check_dim(x: torch.Tensor, dim: int, n: int, name: str, axis: str) -> None:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{name}: dim {dim} is out of range for a tensor of shape {x.shape}")
    if name == "reduce_scatter" and x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter over {axis!r} (size {n}) needs dim {dim} of shape "
            f"{tuple(x.shape)} to divide by {n}; pad it first"
        )


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int) -> torch.Tensor:  # type: ignore[override]
        return _move_leading(wait(raw_all_gather(x, mesh, axis)), dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axis, ctx.dim = inputs
        ctx.label = current_label()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        n = axis_sizes(ctx.mesh)[ctx.axis]
        with labelled(ctx.label):
            out = raw_reduce_scatter(_split_leading(grad, n, ctx.dim), ctx.mesh, ctx.axis)
        return wait(out), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int, op: str) -> torch.Tensor:  # type: ignore[override]
        n = axis_sizes(mesh)[axis]
        return wait(raw_reduce_scatter(_split_leading(x, n, dim), mesh, axis, op))  # type: ignore[arg-type]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axis, ctx.dim, ctx.op = inputs
        ctx.label = current_label()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        n = axis_sizes(ctx.mesh)[ctx.axis]
        with labelled(ctx.label):
            gathered = raw_all_gather(grad, ctx.mesh, ctx.axis)
        out = _move_leading(wait(gathered), ctx.dim)
        return (out / n if ctx.op == "mean" else out), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str) -> torch.Tensor:  # type: ignore[override]
        return wait(raw_all_reduce(x, mesh, axes, op))  # type: ignore[arg-type]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axes, ctx.op = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.op == "mean":
            sizes = axis_sizes(ctx.mesh)
            for a in ctx.axes:
                grad = grad / sizes[a]
        return grad, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.mesh, ctx.axes, ctx.op = inputs
        ctx.label = current_label()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        with labelled(ctx.label):
            out = raw_all_reduce(grad, ctx.mesh, ctx.axes, ctx.op)
        return wait(out), None, None, None


def _axes(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def all_gather(x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, over the mesh axis ``axis``.

    The gradient is the reduce-scatter (sum) of the incoming gradient.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = ff.shard(torch.arange(4.0), mesh, ff.P("dp")).local
        ...     ff.rank_values(ff.all_gather(x, mesh, "dp"))[1].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    _check_axes(mesh, (axis,), "all_gather")
    _check_dim(x, dim, axis_sizes(mesh)[axis], "all_gather", axis)
    return _AllGather.apply(x, mesh, axis, dim % x.ndim)


def reduce_scatter(
    x: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int = 0, op: ReduceOp = "sum"
) -> torch.Tensor:
    """Sum (or average) ``x`` over ``axis`` and keep this rank's block of ``dim``.

    The gradient is the all-gather of the incoming gradient.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = torch.arange(4.0)  # the same on both ranks
        ...     [t.tolist() for t in ff.rank_values(ff.reduce_scatter(x, mesh, "dp"))]
        [[0.0, 2.0], [4.0, 6.0]]
    """
    _check_axes(mesh, (axis,), "reduce_scatter")
    _check_dim(x, dim, axis_sizes(mesh)[axis], "reduce_scatter", axis)
    return _ReduceScatter.apply(x, mesh, axis, dim % x.ndim, op)


def all_reduce(
    x: torch.Tensor, mesh: DeviceMesh, axis: str | tuple[str, ...], op: ReduceOp = "sum"
) -> torch.Tensor:
    """Sum (or average) ``x`` over one or more mesh axes (psum).

    Its transpose is the identity: the gradient passes through unchanged (divided by the
    group size for ``op="mean"``). This is Megatron's ``reduce_from``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = ff.shard(torch.tensor([1.0, 2.0]), mesh, ff.P("dp")).local
        ...     ff.rank_values(ff.all_reduce(x, mesh, "dp"))[0].tolist()
        [3.0]
    """
    _check_axes(mesh, _axes(axis), "all_reduce")
    return _AllReduce.apply(x, mesh, _axes(axis), op)


def all_reduce_grad(
    x: torch.Tensor, mesh: DeviceMesh, axis: str | tuple[str, ...], op: ReduceOp = "sum"
) -> torch.Tensor:
    """Identity in forward; the gradient is summed (or averaged) over ``axis`` in backward.

    The transpose of :func:`all_reduce`, Megatron's ``copy_to``. Data-parallel training uses
    it on parameters replicated over a data axis, so their gradients are reduced.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = torch.ones(2)
        ...     g = torch.func.grad(lambda w: ff.all_reduce_grad(w, mesh, "dp").sum())(w)
        ...     g.tolist()
        [2.0, 2.0]
    """
    _check_axes(mesh, _axes(axis), "all_reduce_grad")
    return _AllReduceGrad.apply(x, mesh, _axes(axis), op)
