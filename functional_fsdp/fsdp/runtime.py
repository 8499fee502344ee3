"""The machinery under :meth:`FSDP.apply <functional_fsdp.FSDP.apply>` (private).

* Plans: which bucketed all-gather rounds rebuild a unit's full parameters from its shards.
* Per-call state: a :class:`Unit` per unit and :meth:`apply` call (shards, prefetched
  all-gathers), a :class:`Call` per invocation of the unit (the gathered tensors, freed and
  gathered again in place), and the reduce-scatters left in flight (:class:`InFlight`).
* Autograd functions: the gather (whose backward reduce-scatters), the pre-backward hook that
  gathers a unit again, the fence that finishes the reductions in flight, and checkpointing.

Communication goes through :mod:`functional_fsdp.dist.collectives`; bookkeeping runs on plain
tensors below any ``torch.func`` level.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..dist import collectives as C
from ..dist.mesh import axis_sizes
from ..dist.simulate import is_simulated
from ..spec import Layout, gather_schedule
from .memory import EventKind, MemoryTracker, Phase

if TYPE_CHECKING:
    from .api import Policy


# --------------------------------------------------------------------------- gather plans


@dataclass(frozen=True)
class Piece:
    """One parameter's part in a round: its block before the gather, and the dim it joins."""

    index: int  # position in the unit's parameter list
    local_shape: tuple[int, ...]
    dim: int
    gathered_len: int  # length of ``dim`` after the gather, padding cut
    chunked: bool  # dim 0, laid out as torch.chunk pads it: one fused copy in and out

    def padded_shape(self, n: int) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.dim] *= n
        return tuple(shape)


@dataclass(frozen=True)
class Round:
    """One bucketed all-gather: ``axis`` out of the listed parameters, all of one dtype."""

    axis: str
    size: int  # of the axis
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    first: bool  # every input is a shard (not the output of an earlier round): prefetchable


@dataclass(frozen=True)
class UnitPlan:
    """A unit's parameters and how to gather them (built once per parameter layout)."""

    name: str
    names: tuple[str, ...]  # parameter names (first alias)
    aliases: tuple[tuple[str, ...], ...]  # every name of each parameter (tied weights)
    layouts: tuple[Layout, ...]  # not the Sharded values: a plan is cached, they are not
    dtypes: tuple[torch.dtype, ...]  # of the shards
    rounds: tuple[Round, ...]
    last_round: tuple[int, ...]  # per parameter: the round that completes it (-1: none)
    replicated: tuple[tuple[str, ...], ...]  # per parameter: data axes it is replicated over
    gathered_bytes: int  # of the full (padded) parameters, in the gather dtypes


def plan_rounds(
    layouts: list[Layout],
    mesh: DeviceMesh,
    data_axes: Sequence[str],
    gather_dtypes: Sequence[torch.dtype],
) -> tuple[Round, ...]:
    """The all-gather rounds that rebuild each parameter from its shard.

    Each round gathers one data axis that is minor in a dim of the parameters it lists (a
    dim split over two data axes takes two rounds), bucketed by gather dtype.
    """
    sizes = axis_sizes(mesh)
    # Gathering over an axis of size 1 moves nothing: the shard is already the full block.
    layouts = list(layouts)
    for i, lay in enumerate(layouts):
        for a in lay.spec.axes:
            if a in data_axes and sizes[a] == 1:
                layouts[i] = layouts[i].gathered(a)
    wanted = [[a for a in lay.spec.axes if a in data_axes] for lay in layouts]
    touched = [False] * len(layouts)
    rounds: list[Round] = []
    for axis, ready in gather_schedule(layouts, wanted):
        n = sizes[axis]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in ready:
            by_dtype.setdefault(gather_dtypes[i], []).append(i)
        for dtype, idx in by_dtype.items():
            pieces = []
            for i in idx:
                lay = layouts[i]
                dim = lay.spec.dim_of(axis)
                if dim is None:  # pragma: no cover - the schedule only lists sharded dims
                    raise RuntimeError(f"internal: {axis!r} shards no dim of {lay}")
                length = lay.block_sizes(dim)[-2]
                chunked = dim == 0 and -(-length // n) == lay.local_shape[0]
                pieces.append(Piece(i, lay.local_shape, dim, length, chunked))
            rounds.append(Round(axis, n, dtype, tuple(pieces), not any(touched[i] for i in idx)))
        for i in ready:
            layouts[i] = layouts[i].gathered(axis)
            touched[i] = True
    return tuple(rounds)


# --------------------------------------------------------------------------- per-call state


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any ``torch.func`` wrappers (for communication outside autograd)."""
    func = torch._C._functorch
    while func.is_functorch_wrapped_tensor(t):
        t = func.get_unwrapped(t)
    return t


def _as_leading(t: torch.Tensor, piece: Piece, n: int) -> torch.Tensor:
    """View a padded full tensor as ``[n, *local_shape]``: rank ``r``'s block at index ``r``."""
    d, shape = piece.dim, piece.local_shape
    return t.view(*shape[:d], n, shape[d], *shape[d + 1 :]).movedim(d, 0)


_TOKENS = itertools.count()


class Unit:
    """A unit's state during one ``apply`` call and its backward (never shared between calls).

    Holds the shards and the all-gathers issued ahead (prefetch). Each invocation of the unit
    (a module may run several times in one forward) gets its own :class:`Call`.
    """

    def __init__(
        self,
        plan: UnitPlan,
        mesh: DeviceMesh,
        policy: Policy,
        data_axes: tuple[str, ...],
        shards: list[torch.Tensor],
        trackers: tuple[MemoryTracker, ...],
        in_flight: InFlight,
    ):
        self.plan, self.mesh, self.policy, self.data_axes = plan, mesh, policy, data_axes
        self.shards = shards  # the locals, as passed to the gather (maybe torch.func-wrapped)
        # Reductions in flight, shared by the units of one apply: finished by the next
        # unit's backward (one in flight at a time) or by the fence (ReduceFence).
        self.in_flight = in_flight
        self.defer = False  # reduce-scatters may be left in flight (set by apply)
        self.calls = 0  # invocations in this step's forward
        self.prefetched: dict[int, torch.Tensor] = {}  # round index -> async all-gather result
        self.trackers = trackers
        self.token = next(_TOKENS)  # names this unit's prefetched buffers in memory trackers
        self.simulated = is_simulated()
        self.sync = True  # reduce gradients over the data axes (False inside FSDP.no_sync())

    def note(self, kind: EventKind, phase: Phase, key: int, replaces: int | None = None) -> None:
        for tracker in self.trackers:
            tracker._record(kind, self.plan.name, phase, self.plan.gathered_bytes, key, replaces)

    def gather_dtype(self, t: torch.Tensor) -> torch.dtype:
        pd = self.policy.mixed_precision.param_dtype
        return pd if pd is not None and t.is_floating_point() else t.dtype

    def prefetch(self, phase: Phase) -> None:
        """Issue the first-round all-gathers asynchronously (no wait)."""
        if self.prefetched or not self.plan.rounds:
            return
        plain = [_plain(s) for s in self.shards]
        with torch.no_grad(), torch._C._DisableFuncTorch():
            for r, rnd in enumerate(self.plan.rounds):
                if rnd.first:
                    inputs = [plain[p.index] for p in rnd.pieces]
                    self.prefetched[r] = self._issue(rnd, [t.to(rnd.dtype) for t in inputs])
        self.note("prefetch", phase, self.token)

    def drop_prefetch(self, phase: Phase) -> None:
        """Wait for and discard an all-gather issued ahead for a call that did not come."""
        if self.prefetched:
            for pending in self.prefetched.values():
                C.wait(pending)
            self.prefetched.clear()
            self.note("free", phase, self.token)

    def _issue(self, rnd: Round, inputs: list[torch.Tensor]) -> torch.Tensor:
        flat = (
            inputs[0].reshape(-1)
            if len(inputs) == 1
            else torch.cat([t.reshape(-1) for t in inputs])
        )
        return C.raw_all_gather(flat, self.mesh, rnd.axis)

    def gather(
        self, shards: Sequence[torch.Tensor], into: Sequence[torch.Tensor | None] | None = None
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """All gather rounds on plain tensors: ``(padded full tensors, parameters)``.

        The parameters are the padded full tensors with the padding cut off (views), or
        the shards themselves where nothing is gathered. ``into`` gives the padded full
        tensors to write (the regather in backward); otherwise they are allocated.
        """
        plan = self.plan
        current = [
            s if s.dtype == self.gather_dtype(s) else s.to(self.gather_dtype(s)) for s in shards
        ]
        full: list[torch.Tensor | None] = [None] * len(current)
        for r, rnd in enumerate(plan.rounds):
            pending = self.prefetched.pop(r, None)
            if pending is None:
                pending = self._issue(rnd, [current[p.index] for p in rnd.pieces])
            gathered = C.wait(pending)  # [n, sum of the pieces' local numels]
            n = rnd.size
            if len(rnd.pieces) == 1 and rnd.pieces[0].dim == 0 and into is None and n > 1:
                outs = [gathered.view(rnd.pieces[0].padded_shape(n))]  # already in place
            else:
                outs = [
                    into[p.index]  # type: ignore[misc]
                    if into is not None and plan.last_round[p.index] == r
                    else gathered.new_empty(p.padded_shape(n))
                    for p in rnd.pieces
                ]
                _copy_out(gathered, rnd, outs)
            for p, out in zip(rnd.pieces, outs):
                full[p.index] = out
                padded = out.shape[p.dim] != p.gathered_len
                current[p.index] = out.narrow(p.dim, 0, p.gathered_len) if padded else out
        self.prefetched.clear()
        return full, current

    def reduce(
        self, grads: list[torch.Tensor | None], dtypes: Sequence[torch.dtype]
    ) -> list[torch.Tensor | None]:
        """Reduce-scatter (and all-reduce) plain gradients onto the shards' layouts.

        When the unit needs one reduce-scatter and nothing after it, the reduce-scatter is left
        in flight (``self.in_flight``) and the returned gradients are filled in when it is
        finished; :class:`ReduceFence` makes sure nothing reads them before.
        """
        plan, mesh, policy = self.plan, self.mesh, self.policy
        mp = policy.mixed_precision
        reduce_dtype = mp.reduce_dtype or mp.param_dtype
        sizes = axis_sizes(mesh)
        mean = policy.grad_reduce == "mean" and self.sync
        scale = math.prod(sizes[a] for a in self.data_axes) if mean else 1
        incoming = {id(g) for g in grads}
        current = [
            g.to(reduce_dtype)
            if g is not None and reduce_dtype is not None and g.is_floating_point()
            else g
            for g in grads
        ]
        needed = [i for i, g in enumerate(current) if g is not None]
        if not needed:
            return current
        rounds = [rnd for rnd in reversed(plan.rounds) if any(i in needed for i in _indices(rnd))]
        all_reduce = self.sync and any(sizes[a] > 1 for i in needed for a in plan.replicated[i])
        # Deferred only for a unit called once: the gradients of several calls are summed
        # (read) by autograd as soon as they arrive.
        defer = (
            self.defer
            and self.calls == 1
            and len(rounds) == 1
            and not all_reduce
            and all(current[i].dtype == dtypes[i] for i in needed)  # type: ignore[union-attr]
        )
        for rnd in rounds:
            pieces = [p for p in rnd.pieces if current[p.index] is not None]
            n = rnd.size
            inputs: list[torch.Tensor] = [current[p.index] for p in pieces]  # type: ignore[misc]
            if all(p.chunked for p in pieces):
                flat = torch._chunk_cat(inputs, dim=0, num_chunks=n)  # pads, one copy
            else:
                rows = []
                for p, g in zip(pieces, inputs):
                    full = g.new_zeros(p.padded_shape(n))
                    full.narrow(p.dim, 0, p.gathered_len).copy_(g)
                    rows.append(_as_leading(full, p, n).reshape(n, -1))
                flat = torch.cat(rows, dim=1)
            if defer:
                reduced, finish = C.raw_reduce_scatter_start(flat, mesh, rnd.axis)
                self.in_flight.add(_finisher(finish, reduced, scale))
            else:
                reduced = C.wait(C.raw_reduce_scatter(flat, mesh, rnd.axis))
            offset = 0
            for p in pieces:
                numel = math.prod(p.local_shape)
                current[p.index] = reduced[offset : offset + numel].view(p.local_shape)
                offset += numel
        if defer:
            return current
        if self.sync:
            _all_reduce_replicated(current, plan.replicated, mesh)
        if scale != 1:
            mine = [g for g in current if g is not None and id(g) not in incoming]
            torch._foreach_div_(mine, scale)  # our own buffers: in place, one call
            current = [g / scale if g is not None and id(g) in incoming else g for g in current]
        return current


class InFlight:
    """Reductions left in flight by the units of one ``apply`` (finished in issue order).

    An object, not a list: ``torch.func`` rebuilds the containers among a Function's inputs.
    """

    def __init__(self) -> None:
        self.finishers: list[Callable[[], None]] = []

    def add(self, finisher: Callable[[], None]) -> None:
        self.finishers.append(finisher)

    def finish(self) -> None:
        while self.finishers:
            self.finishers.pop(0)()


def _indices(rnd: Round) -> list[int]:
    return [p.index for p in rnd.pieces]


def _finisher(finish: Callable[[], None], out: torch.Tensor, scale: int) -> Callable[[], None]:
    def done() -> None:
        with torch.no_grad(), torch._C._DisableFuncTorch():
            finish()
            if scale != 1:
                out.div_(scale)

    return done


class Call:
    """One invocation of a unit: its gathered parameters, freed and gathered again in place."""

    def __init__(self, unit: Unit, position: int):
        self.unit, self.position = unit, position  # position: index in the call sequence
        self.token = next(_TOKENS)
        self.full: list[torch.Tensor | None] = []  # padded full tensors (own their storage)
        self.nbytes: list[int] = []
        self.freed = False
        self.hooked = False  # a pre-backward hook will gather it again

    def gather(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        unit = self.unit
        unit.calls += 1
        prefetched = bool(unit.prefetched)
        self.full, params = unit.gather(shards)
        real = not unit.simulated
        self.nbytes = [
            t.untyped_storage().nbytes() if t is not None and real else 0 for t in self.full
        ]
        self.freed = False
        if unit.plan.rounds:
            unit.note("gather", "forward", self.token, unit.token if prefetched else None)
        return params

    def free(self, phase: Phase) -> None:
        """Release the gathered storage (autograd keeps the tensors as empty shells)."""
        if self.freed or not self.unit.plan.rounds:
            self.freed = True
            return
        if not self.unit.simulated:
            for t in self.full:
                if t is not None:
                    t.untyped_storage().resize_(0)
        self.freed = True
        self.unit.note("free", phase, self.token)

    def regather(self) -> None:
        """Gather again, in place, into the tensors autograd saved in forward."""
        if not self.freed:
            return
        unit = self.unit
        prefetched = bool(unit.prefetched)
        full = [t for t in self.full if t is not None]
        # The gathered tensors sit below any torch.func level; write them outside the transform.
        with torch.no_grad(), torch._C._DisableFuncTorch():
            if not unit.simulated:
                for t, nbytes in zip(self.full, self.nbytes):
                    if t is not None:
                        t.untyped_storage().resize_(nbytes)
            with torch.autograd._unsafe_preserve_version_counter(tuple(full)):
                unit.gather([_plain(s) for s in unit.shards], into=self.full)
        self.freed = False
        unit.note("gather", "backward", self.token, unit.token if prefetched else None)


def _copy_out(gathered: torch.Tensor, rnd: Round, outs: list[torch.Tensor]) -> None:
    """Copy an all-gather's ``[n, total]`` output into each piece's padded full tensor."""
    n = rnd.size
    if all(p.dim == 0 for p in rnd.pieces):
        sizes = [math.prod(p.local_shape) for p in rnd.pieces]
        torch.split_with_sizes_copy(gathered, sizes, dim=1, out=[o.view(n, -1) for o in outs])
        return
    offset = 0
    for p, out in zip(rnd.pieces, outs):
        numel = math.prod(p.local_shape)
        _as_leading(out, p, n).copy_(gathered[:, offset : offset + numel].view(n, *p.local_shape))
        offset += numel


# --------------------------------------------------------------------------- autograd functions


class UnitGather(torch.autograd.Function):
    """Gather one unit's parameters; backward reduce-scatters (and all-reduces) the grads."""

    @staticmethod
    def forward(call: Call, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        params = call.gather(shards)
        # Outputs are views, never the tensors the call keeps: an output holds this node, and
        # the node's ctx holds the call, a reference cycle that Python's collector cannot
        # see through autograd nodes (it would keep the step's tensors alive for ever).
        return tuple(t.view_as(t) for t in params)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.call = inputs[0]
        ctx.dtypes = [t.dtype for t in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        call: Call = ctx.call
        needs = [ctx.needs_input_grad[1 + i] for i in range(len(grads))]
        # Communication and bookkeeping on plain tensors, below any torch.func level: the
        # returned gradients are constants to outer transforms (FSDP is not differentiated
        # twice), and the transforms' per-op overhead is avoided.
        with torch.no_grad(), torch._C._DisableFuncTorch():
            call.unit.in_flight.finish()  # the previous unit's reduce-scatter: one in flight
            plain = [_plain(g) if need else None for g, need in zip(grads, needs)]
            reduced = call.unit.reduce(plain, ctx.dtypes)
            out = [
                g if g is None or g.dtype == dtype else g.to(dtype)
                for g, dtype in zip(reduced, ctx.dtypes)
            ]
        call.free("backward")
        return (None, *out)


def _all_reduce_replicated(
    grads: list[torch.Tensor | None], replicated: Sequence[tuple[str, ...]], mesh: DeviceMesh
) -> None:
    """All-reduce each gradient over the data axes its parameter is replicated on (bucketed)."""
    axes = sorted({a for rep, g in zip(replicated, grads) if g is not None for a in rep})
    for axis in axes:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (rep, g) in enumerate(zip(replicated, grads)):
            if g is not None and axis in rep:
                by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():
            parts = [grads[i] for i in idx]
            flat = torch.cat([g.reshape(-1) for g in parts])  # type: ignore[union-attr]
            flat = C.wait(C.raw_all_reduce(flat, mesh, axis))
            offset = 0
            for i, g in zip(idx, parts):
                grads[i] = flat[offset : offset + g.numel()].view(g.shape)  # type: ignore[union-attr]
                offset += g.numel()  # type: ignore[union-attr]


class PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; in backward, gathers the unit again before it runs."""

    @staticmethod
    def forward(hook: Callable[[], None], *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.hook = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


class ReduceFence(torch.autograd.Function):
    """Identity on all the shards; in backward, finishes the reductions left in flight.

    Applied before anything else in ``apply``, so its backward node is the oldest and runs
    last: the gradients that a unit's gather returned, possibly before its reduce-scatter
    finished, reach the shards only through it (and are complete by then).
    """

    @staticmethod
    def forward(in_flight: InFlight, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(s.view_as(s) for s in shards)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.in_flight = inputs[0]  # (not the units: they hold this node's outputs, a cycle)
        ctx.set_materialize_grads(False)  # a shard whose unit did not run keeps no gradient

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.in_flight.finish()
        return (None, *grads)


def attach_pre_backward(out: Any, hook: Callable[[], None]) -> tuple[Any, bool]:
    """``out`` with ``hook`` run before backward reaches it; and whether any output needs grad."""
    leaves, treedef = torch_pytree.tree_flatten(out)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return out, False
    wrapped = PreBackward.apply(hook, *(leaves[i] for i in idx))
    for i, w in zip(idx, wrapped):
        leaves[i] = w
    return torch_pytree.tree_unflatten(leaves, treedef), True


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast the floating tensors of ``tree`` (as torch's pytree sees it: ``ModelOutput`` too)."""
    if dtype is None:
        return tree
    return torch_pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


# --------------------------------------------------------------------------- checkpoint


class Checkpoint(torch.autograd.Function):
    """Run ``fn(*flat)`` without keeping activations; recompute them in backward.

    Written as a plain ``autograd.Function`` because torch's checkpoint relies on saved-tensor
    hooks (refused inside ``torch.func`` transforms) or lacks ``setup_context``.
    """

    @staticmethod
    def forward(fn: Callable[..., Any], *flat: Any) -> Any:  # type: ignore[override]
        with torch.no_grad():
            return fn(*flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.fn = inputs[0]
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs[1:]]
        ctx.save_for_backward(*(x for x in inputs[1:] if isinstance(x, torch.Tensor)))
        ctx.others = [x for x in inputs[1:] if not isinstance(x, torch.Tensor)]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        flat = [next(tensors) if is_t else next(others) for is_t in ctx.is_tensor]
        diff = [i for i, is_t in enumerate(ctx.is_tensor) if is_t and ctx.needs_input_grad[1 + i]]

        def recompute(*xs: torch.Tensor) -> Any:
            args = list(flat)
            for i, x in zip(diff, xs):
                args[i] = x
            return ctx.fn(*args)

        # torch.func.vjp works both under plain autograd and inside torch.func transforms.
        out, vjp_fn = torch.func.vjp(recompute, *(flat[i] for i in diff))
        got = vjp_fn(grads if isinstance(out, tuple) else grads[0])
        result: list[Any] = [None] * len(flat)
        for i, g in zip(diff, got):
            result[i] = g
        return (None, *result)


def checkpointed(
    original: Callable[..., Any],
    names: list[str],
    params: list[torch.Tensor],
    accessor: NamedMemberAccessor,
    args: Any,
    kwargs: Any,
) -> Any:
    flat, treedef = optree.tree_flatten((list(params), args, kwargs), none_is_leaf=True)

    def fn(*leaves: Any) -> Any:
        ps, a, kw = optree.tree_unflatten(treedef, list(leaves))
        previous, _ = accessor.swap_tensors_dict(dict(zip(names, ps)))
        try:
            return original(*a, **kw)
        finally:
            accessor.swap_tensors_dict(previous)

    return Checkpoint.apply(fn, *flat)
