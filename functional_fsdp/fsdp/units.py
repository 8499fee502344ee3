"""Per-call state of the FSDP engine (private): one :class:`CallState` per ``apply`` call.

* :class:`CallState`: everything one call creates and its backward uses, in one object that
  the interpreter (:func:`functional_fsdp.fsdp.runtime.run`) creates per call and drives;
  it dies with the call's autograd graph. Nothing survives from one call to the next.
* :class:`Context`: what the units of one call share (mesh, policy, accounting).
* :class:`Unit`: a unit's shards and the all-gathers issued ahead (prefetch); it gathers
  (bucketed rounds) and reduces (bucketed reduce-scatter, all-reduce over replicated data
  axes, FSDP2's division rule).
* :class:`Call`: one invocation of a unit: the gathered tensors, freed and gathered again in
  place.
* :class:`InFlight`: the reduce-scatters left in flight, finished by the next unit's backward,
  by the fence, or at the end of the backward pass at the latest.

Communication goes through :mod:`functional_fsdp.distributed.collectives`; everything here runs on
plain tensors below any ``torch.func`` level.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._buckets import issue_gather, pack_grads, unpack_gathered, unpack_reduced
from ..distributed import checks
from ..distributed import collectives as C
from ..distributed.axes import mesh_device
from ..distributed.simulate import is_simulated
from ..spec import format_mesh
from .float8_gather import Float8Gather, amax_to_scale, shard_amaxes
from .gradients import mean_divisor
from .layout import ModelLayout, Round, UnitLayout, gather_dtype
from .memory import EventKind, MemoryTracker, Phase
from .policy import Policy
from .quantized_gather import QuantizedGather


@dataclasses.dataclass(frozen=True)
class Context:
    """What every unit of one ``apply`` call shares: settings and the accounting it reports to."""

    mesh: DeviceMesh
    sizes: dict[str, int]
    policy: Policy
    data_axes: tuple[str, ...]
    counters: tuple[C.CommCounter, ...]  # read once, when the call starts
    trackers: tuple[MemoryTracker, ...]
    simulated: bool
    device: torch.device  # where units are gathered and computed (the mesh's device)

    @classmethod
    def for_call(
        cls,
        mesh: DeviceMesh,
        sizes: dict[str, int],
        policy: Policy,
        data_axes: tuple[str, ...],
        *,
        trackers: tuple[MemoryTracker, ...] = (),
    ) -> Context:
        """The context of a call starting now: the ``count_comms`` blocks open here record
        its collectives; ``trackers`` (``track_memory``) its units' gathered memory."""
        return cls(
            mesh=mesh,
            sizes=sizes,
            policy=policy,
            data_axes=data_axes,
            counters=C.active_counters(),
            trackers=trackers,
            simulated=is_simulated(),
            device=mesh_device(mesh),
        )

    @property
    def sync(self) -> bool:
        return self.policy.grad_reduce != "none"

    def to_device(self, shard: torch.Tensor) -> torch.Tensor:
        """A shard on the compute device: copied there when it lives elsewhere (offloaded to
        the host), and copied anyway under ``Policy(offload=True)`` so that the offload path
        runs, and is tested, on CPU-only machines too."""
        if shard.device != self.device:
            return shard.to(self.device, non_blocking=shard.is_pinned())
        return shard.clone() if self.policy.offload else shard


# --------------------------------------------------------------------------- per-call state


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any ``torch.func`` wrappers (for communication outside autograd)."""
    func = torch._C._functorch
    while func.is_functorch_wrapped_tensor(t):
        t = func.get_unwrapped(t)
    return t


def divide_factors(factor: int, dtype: torch.dtype) -> tuple[int, float]:
    """``(pre, post)``: divide gradients by ``pre`` before the reduction, ``post`` after.

    As FSDP2 does: fp32/bf16 cannot overflow a sum over ranks, so everything is divided
    after; narrower types (fp16) are divided by about ``sqrt(factor)`` on each side.
    """
    if factor == 1 or dtype in (torch.float32, torch.bfloat16, torch.float64):
        return 1, float(factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre, factor / pre


_TOKENS = itertools.count()


class Unit:
    """A unit's state during one ``apply`` call and its backward (never shared between calls).

    Holds the shards and the all-gathers issued ahead (prefetch). Each invocation of the unit
    (a module may run several times in one forward) gets its own :class:`Call`.
    """

    def __init__(
        self, layout: UnitLayout, ctx: Context, shards: list[torch.Tensor], in_flight: InFlight
    ):
        self.layout, self.ctx = layout, ctx
        self.shards = shards  # the locals, as passed to the gather (maybe torch.func-wrapped)
        # Reductions in flight, shared by the units of one apply: finished by the next
        # unit's backward (one in flight at a time), by the fence, or at the end of backward.
        self.in_flight = in_flight
        self.defer = False  # reduce-scatters may be left in flight (set by run)
        self.differentiated = any(s.requires_grad for s in shards)
        self.calls = 0  # invocations in this forward
        self.prefetched: dict[int, torch.Tensor] = {}  # round index -> async all-gather result
        self.token = next(_TOKENS)  # names this unit's prefetched buffers in memory trackers
        # ZeRO-1/2: the full values of the gathered parameters, held at rest by the caller
        # (set by run when every gathered parameter has one): used instead of all-gathers,
        # never freed; the backward still reduce-scatters onto the shards.
        self.replicas: list[torch.Tensor | None] | None = None
        # Float8Gather: per parameter, the float32 scale of its float8 cast (None: sent as
        # it is), set once per call (:func:`_float8_scales`); the backward's gather reuses it.
        self.scales: list[torch.Tensor | None] = [None] * len(shards)
        # hpZ: the parameters the backward gathers again (over the kept axis); None: all.
        keep = ctx.policy.secondary_axis
        self.regathered: set[int] | None = None
        if keep is not None:
            self.regathered = {
                p.index for rnd in layout.rounds if rnd.axis == keep for p in rnd.pieces
            }

    def note(self, kind: EventKind, phase: Phase, key: int, replaces: int | None = None) -> None:
        for tracker in self.ctx.trackers:
            tracker._record(
                kind, self.layout.name, phase, self.layout.gathered_bytes, key, replaces
            )

    def gather_dtype(self, t: torch.Tensor) -> torch.dtype:
        return gather_dtype(t.dtype, self.ctx.policy.mixed_precision.param_dtype)

    def prefetch(self, phase: Phase) -> None:
        """Issue the first-round all-gathers asynchronously (no wait)."""
        if self.prefetched or not self.layout.rounds or self.replicas is not None:
            return
        plain = [_plain(s) for s in self.shards]
        with torch.no_grad(), torch._C._DisableFuncTorch():
            for r, rnd in enumerate(self.layout.rounds):
                if rnd.first:
                    inputs = [self.ctx.to_device(plain[p.index]) for p in rnd.pieces]
                    if not isinstance(self._quantized(r), Float8Gather):  # casts from these
                        inputs = [t.to(rnd.dtype) for t in inputs]
                    self.prefetched[r] = self._issue(r, inputs)
        self.note("prefetch", phase, self.token)

    def drop_prefetch(self, phase: Phase) -> None:
        """Wait for and discard an all-gather issued ahead for a call that did not come."""
        if self.prefetched:
            for pending in self.prefetched.values():
                C.wait(pending)
            self.prefetched.clear()
            self.note("free", phase, self.token)

    def _quantized(self, r: int) -> QuantizedGather | Float8Gather | None:
        """The quantization of round ``r``'s all-gather: a first round of floating values
        under ``Policy(gather_quantization=...)`` (for float8, with a piece it casts), else
        ``None``."""
        q, rnd = self.ctx.policy.gather_quantization, self.layout.rounds[r]
        if q is None or not rnd.first or not rnd.dtype.is_floating_point:
            return None
        if isinstance(q, Float8Gather) and all(self.scales[p.index] is None for p in rnd.pieces):
            return None
        return q

    def _issue(self, r: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Issue round ``r``'s all-gather of ``inputs`` (its pieces' blocks, in order; under
        float8, the shards as they are at rest: the cast reads them, not a copy in the
        gather dtype)."""
        layout, ctx = self.layout, self.ctx
        q, rnd = self._quantized(r), layout.rounds[r]
        if isinstance(q, Float8Gather):  # float8 values (the scales every rank has)
            scales = [self.scales[p.index] for p in rnd.pieces]
            inputs = q.pack(
                [t if s is not None else t.to(rnd.dtype) for t, s in zip(inputs, scales)], scales
            )
        elif q is not None:  # int8 blocks and their scales, in one collective
            inputs = [q.pack(inputs)]
        return issue_gather(
            inputs, ctx.mesh, layout.rounds[r], counters=ctx.counters, meta=layout.labels[r]
        )

    def _received(self, r: int, gathered: torch.Tensor) -> torch.Tensor:
        """Round ``r``'s all-gather output as ``[n, sum of the pieces' local numels]``."""
        q = self._quantized(r)
        if q is None:
            return gathered
        rnd = self.layout.rounds[r]
        numels = [math.prod(p.local_shape) for p in rnd.pieces]
        if isinstance(q, Float8Gather):
            scales = [self.scales[p.index] for p in rnd.pieces]
            shapes = [(k, rnd.dtype) for k in numels]
            parts = q.unpack(gathered.view(rnd.size, -1), shapes, rnd.dtype, scales)
            out = torch.cat(parts, dim=1)
        else:
            out = q.unpack(gathered.view(rnd.size, -1), numels, rnd.dtype)
        C.release(gathered)
        return out

    def gather(
        self,
        shards: Sequence[torch.Tensor],
        into: Sequence[torch.Tensor | None] | None = None,
        *,
        secondary: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor], list[torch.Tensor]]:
        """All gather rounds on plain tensors: ``(padded full tensors, parameters, secondary)``.

        The parameters are the padded full tensors with the padding cut off (views), or
        the shards themselves where nothing is gathered. ``into`` gives the padded full
        tensors to write (the regather in backward); otherwise they are allocated.

        ``secondary`` (hpZ, ``Policy(reshard_after_forward=axis)``): each parameter as it
        was before its gather over that axis, which the forward's gather returns and the
        backward's regather starts from, gathering over that axis only.
        """
        keep = self.ctx.policy.secondary_axis
        if secondary is not None:  # hpZ's backward: over the kept axis only
            return self._gather_rounds(list(secondary), list(secondary), into, only=keep)
        rest = [self.ctx.to_device(s) for s in shards]
        current = [
            s if s.dtype == self.gather_dtype(s) else s.to(self.gather_dtype(s)) for s in rest
        ]
        full: list[torch.Tensor | None] = [None] * len(current)
        if self.replicas is not None:  # held at rest: nothing to gather, nothing to free
            for i, rep in enumerate(self.replicas):
                if rep is not None:
                    current[i] = rep if rep.dtype == current[i].dtype else rep.to(current[i].dtype)
            return full, current, []
        return self._gather_rounds(rest, current, into, keep=keep)

    def _gather_rounds(
        self,
        rest: list[torch.Tensor],
        current: list[torch.Tensor],
        into: Sequence[torch.Tensor | None] | None,
        *,
        keep: str | None = None,
        only: str | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor], list[torch.Tensor]]:
        """Run the rounds (those over axis ``only``, if given) from ``current`` (``rest``:
        the shards at rest, which a float8 cast reads). With ``keep``, the third result is
        each parameter as it was before its round over ``keep`` (or gathered whole)."""
        layout = self.layout
        full: list[torch.Tensor | None] = [None] * len(current)
        kept: dict[int, torch.Tensor] = {}
        for r, rnd in enumerate(layout.rounds):
            if only is not None and rnd.axis != only:
                continue
            pending = self.prefetched.pop(r, None) if only is None else None
            src = rest if isinstance(self._quantized(r), Float8Gather) else current
            if rnd.axis == keep:
                kept.update((p.index, src[p.index]) for p in rnd.pieces)
            if pending is None:
                pending = self._issue(r, [src[p.index] for p in rnd.pieces])
            gathered = self._received(r, C.wait(pending))  # [n, the pieces' local numels]
            n = rnd.size
            if len(rnd.pieces) == 1 and rnd.pieces[0].dim == 0 and into is None and n > 1:
                outs = [gathered.view(rnd.pieces[0].padded_shape(n))]  # already in place
            else:
                outs = [
                    into[p.index]  # type: ignore[misc]
                    if into is not None and layout.last_round[p.index] == r
                    else gathered.new_empty(p.padded_shape(n))
                    for p in rnd.pieces
                ]
                unpack_gathered(gathered, rnd, outs)
                C.release(gathered)  # copied out: freed here, not by gloo's worker
            for p, out in zip(rnd.pieces, outs):
                full[p.index] = out
                padded = out.shape[p.dim] != p.gathered_len
                current[p.index] = out.narrow(p.dim, 0, p.gathered_len) if padded else out
        if only is None:
            self.prefetched.clear()
        secondary = [kept.get(i, c) for i, c in enumerate(current)] if keep is not None else []
        return full, current, secondary

    def reduce(
        self, grads: list[torch.Tensor | None], dtypes: Sequence[torch.dtype]
    ) -> list[torch.Tensor | None]:
        """Reduce-scatter (and all-reduce) plain gradients onto the shards' layouts.

        The entries of ``grads`` are dropped once packed into the reduce-scatter's buffer.
        When the unit needs one reduce-scatter and nothing after it, the reduce-scatter is left
        in flight (``self.in_flight``) and the returned gradients are filled in when it is
        finished; the fence and the end-of-backward callback make sure of that.
        """
        layout, ctx = self.layout, self.ctx
        mp = ctx.policy.mixed_precision
        reduce_dtype = mp.reduce_dtype or mp.param_dtype
        current = [
            g.to(reduce_dtype)
            if g is not None and reduce_dtype is not None and g.is_floating_point()
            else g
            for g in grads
        ]
        needed = [i for i, g in enumerate(current) if g is not None]
        if not needed:
            return current
        sizes = ctx.sizes
        factor = mean_divisor(sizes, ctx.data_axes, ctx.policy)  # the gradient rule's
        pre, post = divide_factors(factor, current[needed[0]].dtype)  # type: ignore[union-attr]
        # The entries that still are the caller's tensors (divided out of place below).
        theirs = {i: g for i, g in enumerate(current) if g is not None and g is grads[i]}
        if pre != 1:  # narrow dtypes: divide before the sum can overflow (new buffers)
            current = [g / pre if g is not None else g for g in current]
            theirs = {}
        rounds = [
            (r, rnd)
            for r, rnd in reversed(list(enumerate(layout.rounds)))
            if any(i in needed for i in _indices(rnd))
        ]
        all_reduce = ctx.sync and any(sizes[a] > 1 for i in needed for a in layout.replicated[i])
        # Deferred only for a unit called once: the gradients of several calls are summed
        # (read) by autograd as soon as they arrive.
        defer = (
            self.defer
            and not ctx.policy.offload  # the gradients are copied to the host right away
            and self.calls == 1
            and len(rounds) == 1
            and not all_reduce
            and all(current[i].dtype == dtypes[i] for i in needed)  # type: ignore[union-attr]
            and ctx.policy.grad_quantization is None  # qgZ's all-to-all waits
        )
        qgz = ctx.policy.grad_quantization
        two_hops = qgz is not None and qgz.hierarchical and _two_hops(rounds, current, sizes)
        for r, rnd in rounds:
            pieces = [p for p in rnd.pieces if current[p.index] is not None]
            meta = layout.labels[r]
            if len(pieces) < len(rnd.pieces) and checks._CHECK:  # for the debug check only
                meta = tuple(m for m, p in zip(meta, rnd.pieces) if current[p.index] is not None)
            n = rnd.size
            inputs: list[torch.Tensor] = [current[p.index] for p in pieces]  # type: ignore[misc]
            flat = pack_grads(inputs, pieces, n)
            # A new buffer (not a view of a gradient): released once the collective is done.
            mine = [flat] if C.releasable(flat) and not _shares_storage(flat, inputs) else []
            # Packed: drop the full gradients before the collective (freed here if the caller
            # handed them over, as an isolated unit's backward does).
            del inputs
            for p in pieces:
                theirs.pop(p.index, None)
                current[p.index] = grads[p.index] = None
            if defer:
                reduced, finish = C.raw_reduce_scatter_start(
                    flat, ctx.mesh, rnd.axis, counters=ctx.counters, meta=meta
                )
                # Traced (ff.jit), the compiler plans the buffers and places the wait.
                soon = C.receives_copy(ctx.mesh, rnd.axis) and not torch.compiler.is_compiling()
                self.in_flight.add(_finisher(finish, reduced, post, mine), soon=soon)
            elif two_hops:  # the minor axis first, then the major (ZeRO++'s hierarchy)
                minor = rounds[1][1]
                reduced = qgz.reduce_two_hops(  # type: ignore[union-attr]
                    flat,
                    pieces,
                    minor.pieces,
                    ctx.mesh,
                    (rnd.axis, minor.axis),
                    counters=ctx.counters,
                )
                pieces = list(minor.pieces)
            elif qgz is not None and flat.is_floating_point():  # quantized blocks, all-to-all
                numels = [math.prod(p.local_shape) for p in pieces]
                reduced = qgz.reduce(flat, numels, ctx.mesh, rnd.axis, counters=ctx.counters)
            else:
                reduced = C.wait(
                    C.raw_reduce_scatter(flat, ctx.mesh, rnd.axis, counters=ctx.counters, meta=meta)
                )
                C.release(*mine)
            for p, block in zip(pieces, unpack_reduced(reduced, pieces)):
                current[p.index] = block
            if two_hops:
                break  # the minor round's reduction is done
        if defer:
            return current
        if ctx.sync:
            _all_reduce_replicated(current, layout.replicated, ctx)
        if post != 1:
            theirs = {i: g for i, g in theirs.items() if current[i] is g}
            mine = [g for i, g in enumerate(current) if g is not None and i not in theirs]
            if mine:
                torch._foreach_div_(mine, post)  # our own buffers: in place, one call
            current = [g / post if i in theirs else g for i, g in enumerate(current)]
        return current


def _two_hops(
    rounds: Sequence[tuple[int, Round]], grads: Sequence[Any], sizes: Mapping[str, int]
) -> bool:
    """Whether a reduction's ``rounds`` (in reduction order) are two, of the same
    floating-point tensors, the first over a mesh axis before the second's (``"node"`` then
    ``"gpu"``): what qgZ's hierarchy reorders, the minor axis first. (Rounds already in that
    order, as hpZ's are, are two hops as they come.)"""
    if len(rounds) != 2:
        return False
    (_, major), (_, minor) = rounds
    order = list(sizes)
    if order.index(major.axis) >= order.index(minor.axis):
        return False
    indices = [{p.index for p in r.pieces if grads[p.index] is not None} for r in (major, minor)]
    return (
        indices[0] == indices[1]
        and len(indices[0]) == len(minor.pieces) == len(major.pieces)
        and all(grads[i].is_floating_point() for i in indices[0])
    )


class InFlight:
    """Reductions left in flight by the units of one ``apply`` (finished in issue order).

    An object, not a list: ``torch.func`` rebuilds the containers among a Function's inputs.
    """

    def __init__(self) -> None:
        self.finishers: list[Callable[[], None]] = []
        self.callback_queued = False
        self.soon = False  # one holds a receive buffer: finish at the next chance

    def add(self, finisher: Callable[[], None], *, soon: bool = False) -> None:
        """``soon``: the reduction holds memory until it is finished beyond its input and
        output (gloo's receive buffer, as large as the unit): :meth:`finish_soon` finishes it."""
        self.finishers.append(finisher)
        self.soon = self.soon or soon
        if not self.callback_queued:
            # Whatever part of the graph a backward runs (autograd.grad over a subset of the
            # inputs, or a backward that never reaches the fence), nothing stays in flight
            # after it: the engine calls this when the backward pass ends.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self.finish()

    def finish(self) -> None:
        while self.finishers:
            self.finishers.pop(0)()
        self.soon = False

    def finish_soon(self) -> None:
        """Finish now if a reduction in flight holds a receive buffer (gloo's all-to-all, as
        large as the unit). Called before the next call's backward, so that buffer is not
        kept through it; elsewhere (NCCL) the reduction overlaps that backward."""
        if self.soon:
            self.finish()


def _indices(rnd: Round) -> list[int]:
    return [p.index for p in rnd.pieces]


def _shares_storage(t: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """Whether ``t`` may share memory with one of ``others`` (yes, if one is not plain)."""
    ptr = t.untyped_storage().data_ptr()
    return any(not C.releasable(o) or o.untyped_storage().data_ptr() == ptr for o in others)


def _finisher(
    finish: Callable[[], None], out: torch.Tensor, post: float, packed: list[torch.Tensor]
) -> Callable[[], None]:
    def done() -> None:
        with torch.no_grad(), torch._C._DisableFuncTorch():
            finish()
            C.release(*packed)  # the packed gradients: freed here, not by gloo's worker
            if post != 1:
                out.div_(post)

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
        self.dtypes: list[torch.dtype] = []  # of the shards (their gradients' dtypes)
        self.devices: list[torch.device] = []  # of the shards (the host, for offloaded ones)
        # The gradients of the shards, reduced before the gather's backward ran (by the
        # call's own backward: see reduce), which then hands them on.
        self.reduced: list[torch.Tensor | None] | None = None
        # hpZ (Policy(reshard_after_forward=axis)): each parameter before its gather over
        # that axis, kept from the forward to the backward (the secondary shard).
        self.secondary: list[torch.Tensor] = []

    def gather(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        unit = self.unit
        unit.calls += 1
        self.dtypes = [s.dtype for s in shards]
        self.devices = [s.device for s in shards]
        prefetched = bool(unit.prefetched)
        self.full, params, self.secondary = unit.gather(shards)
        real = not unit.ctx.simulated
        self.nbytes = [
            t.untyped_storage().nbytes() if t is not None and real else 0 for t in self.full
        ]
        self.freed = False
        if unit.layout.rounds and unit.replicas is None:  # replicas: nothing is gathered
            unit.note("gather", "forward", self.token, unit.token if prefetched else None)
        return params

    def free(self, phase: Phase) -> None:
        """Release the gathered storage (autograd keeps the tensors as empty shells)."""
        if self.freed or not self.unit.layout.rounds or self.unit.replicas is not None:
            self.freed = True
            return
        # hpZ after the forward: what the backward does not gather again stays.
        gathered = self.unit.regathered if phase == "forward" else None
        if not self.unit.ctx.simulated:
            for i, t in enumerate(self.full):
                if t is not None and (gathered is None or i in gathered):
                    t.untyped_storage().resize_(0)
        if phase == "backward":
            self.secondary = []
        self.freed = True
        self.unit.note("free", phase, self.token)

    def reduce(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The call's backward is done: free its gathered parameters, finish the reduction
        left in flight, and reduce ``grads`` (plain, one per shard or ``None``; the list is
        emptied as they are packed) to the shards' layouts, dtypes and devices."""
        self.free("backward")
        unit = self.unit
        with torch.no_grad(), torch._C._DisableFuncTorch():
            unit.in_flight.finish()  # the previous unit's reduce-scatter: one in flight
            reduced = unit.reduce(grads, self.dtypes)
            return [
                g if g is None else g.to(device=device, dtype=dtype)
                for g, dtype, device in zip(reduced, self.dtypes, self.devices)
            ]

    def regather(self) -> None:
        """Gather again, in place, into the tensors autograd saved in forward."""
        if not self.freed or self.unit.replicas is not None:
            self.freed = False
            return
        unit = self.unit
        prefetched = bool(unit.prefetched)
        full = [t for t in self.full if t is not None]
        # The gathered tensors sit below any torch.func level; write them outside the transform.
        with torch.no_grad(), torch._C._DisableFuncTorch():
            if not unit.ctx.simulated:
                for t, nbytes in zip(self.full, self.nbytes):
                    if t is not None and t.untyped_storage().nbytes() == 0:
                        t.untyped_storage().resize_(nbytes)
            secondary = self.secondary or None
            with torch.autograd._unsafe_preserve_version_counter(tuple(full)):
                unit.gather([_plain(s) for s in unit.shards], into=self.full, secondary=secondary)
        self.freed = False
        unit.note("gather", "backward", self.token, unit.token if prefetched else None)


def _all_reduce_replicated(
    grads: list[torch.Tensor | None], replicated: Sequence[tuple[str, ...]], ctx: Context
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
            flat = C.wait(C.raw_all_reduce(flat, ctx.mesh, axis, counters=ctx.counters))
            offset = 0
            for i, g in zip(idx, parts):
                grads[i] = flat[offset : offset + g.numel()].view(g.shape)  # type: ignore[union-attr]
                offset += g.numel()  # type: ignore[union-attr]


class CallState:
    """The state of one ``FSDP.apply`` call and its backward, in one place.

    * ``units``: ``{unit path: Unit}``, each with its shards, the all-gathers issued ahead
      for it (prefetch), whether it is differentiated and, for ZeRO-1/2, its replicas;
    * ``calls``: the unit invocations in forward order, with their gathered tensors (freed
      after forward, gathered again before backward);
    * ``in_flight``: the reduce-scatters left in flight during the backward;
    * ``prefetched_upto``: how far down the module order forward all-gathers were issued;
    * ``checkpointing``: how deep the call is inside units the policy checkpoints (their
      forward or recompute), where Hugging Face's own checkpointing runs layers plainly.

    The interpreter creates it per call and drives it (gathers through the engine's autograd
    functions, prefetches, hooks); the autograd functions reach the :class:`Call` and
    :class:`Unit` they were given. Nothing here calls back into the interpreter.
    """

    def __init__(
        self,
        layout: ModelLayout,
        ctx: Context,
        params: Mapping[str, Any],
        replicas: Mapping[int, torch.Tensor] | None = None,
    ):
        self.layout, self.ctx = layout, ctx
        self.in_flight = InFlight()
        self.units = {
            name: Unit(up, ctx, [params[n].local for n in up.names], self.in_flight)
            for name, up in layout.units.items()
        }
        if replicas:
            for unit in self.units.values():
                _use_replicas(unit, replicas)
        if not ctx.sync:
            _check_unsynced(self.units)
        if ctx.policy.secondary_axis is not None:
            _check_secondary(self.units, ctx, ctx.policy.secondary_axis)
        if isinstance(ctx.policy.gather_quantization, Float8Gather):
            _float8_scales(self.units, ctx, ctx.policy.gather_quantization)
        self.calls: list[Call] = []  # this call's unit invocations, in order
        self.position = {name: i for i, name in enumerate(layout.order)}
        self.prefetched_upto = -1  # forward prefetch: units up to this position were issued
        self.checkpointing = 0  # inside how many checkpointed units (forward or recompute)
        # (slots, gathered tensors) installed around the units that run inside them: the
        # root's, and those of enclosing units while they run (the interpreter's business).
        self.installed: list[tuple[Any, list[torch.Tensor]]] = []
        self.isolate = True  # whether self-contained units may run isolated (the interpreter's)

    def differentiated_shards(self) -> list[torch.Tensor]:
        """The shards that require grad, in unit order (what the reduce fence covers)."""
        return [s for u in self.units.values() for s in u.shards if s.requires_grad]

    def fenced(self, outputs: Sequence[torch.Tensor]) -> None:
        """Take the fence's outputs (one per :meth:`differentiated_shards`, in order) as the
        shards the units gather from; their reductions may now stay in flight."""
        it = iter(outputs)
        for unit in self.units.values():
            unit.defer = True
            unit.shards = [next(it) if s.requires_grad else s for s in unit.shards]

    def begin(self, name: str) -> Call:
        """A new invocation of unit ``name`` (a module may run several times)."""
        call = Call(self.units[name], len(self.calls))
        self.calls.append(call)
        return call

    def root_call(self) -> Call | None:
        """The root unit's one call, gathered before the module runs; not in ``calls`` (its
        backward comes first and prefetches the last calls), or ``None`` without a root."""
        return Call(self.units[""], -1) if "" in self.units else None

    def note_compute(self, unit: str, phase: Phase) -> None:
        for tracker in self.ctx.trackers:
            tracker._record("compute", unit, phase, 0, -1)

    def prefetch_forward(self, position: int) -> None:
        """Issue the all-gathers of the units after ``position`` in module order (each once)."""
        depth = self.ctx.policy.prefetch
        start = max(position + 1, self.prefetched_upto + 1)
        for name in self.layout.order[start : position + 1 + depth]:
            unit = self.units[name]
            if unit.calls == 0:
                unit.prefetch("forward")
        self.prefetched_upto = max(self.prefetched_upto, position + depth)

    def backward_hook(
        self, call: Call, position: int, *, prefetch: bool = True
    ) -> Callable[[], None]:
        """Before ``call``'s backward: gather it again, and prefetch the calls before it
        (unless ``prefetch`` is false)."""
        calls, depth = self.calls, self.ctx.policy.prefetch if prefetch else 0
        if self.ctx.policy.secondary_axis is not None:
            depth = 0  # hpZ: the backward gathers from each call's secondary shard

        def hook() -> None:
            # A reduce-scatter in flight that holds a receive buffer (gloo) is finished
            # before this call's parameters and gradients join it.
            self.in_flight.finish_soon()
            call.regather()
            for earlier in calls[max(0, position - depth) : position][::-1]:
                if earlier.hooked:
                    earlier.unit.prefetch("backward")
            self.note_compute(call.unit.layout.name, "backward")

        return hook

    def drop_prefetches(self) -> None:
        """Discard the forward all-gathers issued for calls that did not come."""
        for unit in self.units.values():
            unit.drop_prefetch("forward")


def _use_replicas(unit: Unit, known: Mapping[int, torch.Tensor]) -> None:
    """Give ``unit`` the replicas of its parameters, if every gathered one has one (known by
    the id of the local shard, as the call received it). A parameter that is not gathered
    computes with its replica too, where it has one (a master's value in the compute
    dtype, held by the step: no cast of its own)."""
    gathered = {p.index for rnd in unit.layout.rounds for p in rnd.pieces}
    found = [known.get(id(s)) for s in unit.shards]
    if any(f is not None for f in found) and all(found[i] is not None for i in gathered):
        unit.replicas = found


def _check_unsynced(units: Mapping[str, Unit]) -> None:
    """With ``grad_reduce="none"`` a differentiated parameter must not be sharded over a data
    axis: its gradient could not be returned unreduced."""
    for unit in units.values():
        for rnd in unit.layout.rounds:
            for piece in rnd.pieces:
                if unit.shards[piece.index].requires_grad:
                    name = unit.layout.names[piece.index]
                    lay = unit.layout.layouts[piece.index]
                    raise ValueError(
                        f"Policy(grad_reduce='none'): params[{name!r}] (shape "
                        f"{lay.global_shape}, {lay.spec}) is sharded over data axis "
                        f"{rnd.axis!r}, so its gradient cannot stay unreduced. Gather the data "
                        f"axes first (train_step(accumulate_mode='local') does), or use "
                        f"grad_reduce='mean'."
                    )


def _float8_scales(units: Mapping[str, Unit], ctx: Context, q: Float8Gather) -> None:
    """Set each unit's float8 scales: the amax of every cast parameter over all its shards,
    by one all-reduce (MAX) of the shards' amaxes per mesh axis they are split over, for all
    units at once (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)."""
    cast: list[tuple[Unit, int]] = []
    axes: set[str] = set()
    for unit in units.values():
        if unit.replicas is not None:  # held at rest (ZeRO-1/2): nothing is gathered
            continue
        up = unit.layout
        for rnd in up.rounds:
            if not rnd.first:
                continue
            for p in rnd.pieces:
                name, lay = up.names[p.index], up.layouts[p.index]
                floating = rnd.dtype.is_floating_point
                if not q.selects(name) or (q.params is None and not floating):
                    continue  # by default, integer tensors (packed bases) go as they are
                if not floating:
                    raise ValueError(
                        f"Policy(gather_quantization=Float8Gather(params={q.params!r})): "
                        f"params[{name!r}] (shape {lay.global_shape}, {lay.spec}, "
                        f"{format_mesh(ctx.sizes)}) is {up.dtypes[p.index]}, and float8 casts "
                        f"floating tensors only. Leave it out of params= (patterns of the key "
                        f"paths to cast, or a predicate), or gather it exactly: it is then sent "
                        f"as it is."
                    )
                cast.append((unit, p.index))
                axes.update(a for a in lay.spec.axes if ctx.sizes[a] > 1)
    if not cast:
        return
    with torch.no_grad(), torch._C._DisableFuncTorch():
        amax = shard_amaxes([_plain(u.shards[i]) for u, i in cast]).to(ctx.device)
        ordered = tuple(a for a in ctx.sizes if a in axes)  # the same order on every rank
        if ordered:
            amax = C.wait(
                C.raw_all_reduce(amax, ctx.mesh, ordered, op="max", counters=ctx.counters)
            )
        scales = amax_to_scale(amax, q.dtype)
    for k, (unit, i) in enumerate(cast):
        unit.scales[i] = scales[k]


def _check_secondary(units: Mapping[str, Unit], ctx: Context, axis: str) -> None:
    """hpZ needs ``axis`` to be a data axis of the mesh, and each parameter's last gather
    round where it splits one (so the backward gathers over ``axis`` only)."""
    if axis not in ctx.data_axes:
        raise ValueError(
            f"Policy(reshard_after_forward={axis!r}): {axis!r} is not a data axis of "
            f"{format_mesh(ctx.sizes)} (data axes {ctx.data_axes}). Name the axis within a "
            f"node that the backward's all-gathers should stay in, e.g. "
            f"reshard_after_forward='gpu' on ff.make_mesh({{'node': 2, 'gpu': 8}})."
        )
    for unit in units.values():
        up = unit.layout
        for r, rnd in enumerate(up.rounds):
            if rnd.axis != axis:
                continue
            for p in rnd.pieces:
                if up.last_round[p.index] != r:
                    lay = up.layouts[p.index]
                    major = (axis, *(a for a in lay.spec.entry(p.dim) if a != axis))
                    raise ValueError(
                        f"Policy(reshard_after_forward={axis!r}): params[{up.names[p.index]!r}] "
                        f"(shape {lay.global_shape}, {lay.spec}, {format_mesh(ctx.sizes)}) is "
                        f"gathered over {axis!r} before another axis, so its backward would "
                        f"gather across nodes too. Split dim {p.dim} with {axis!r} major: "
                        f"P({major!r}) (the default specs do when reshard_after_forward names "
                        f"an axis)."
                    )
