"""Functional FSDP forward and backward over any ``nn.Module``.

``fsdp(module, mesh, ...)`` describes how a module's parameters are sharded and grouped into
units; ``FSDP.apply(params, *args)`` runs the module with ``torch.func.functional_call``
semantics on a dict of ``Sharded`` parameters. The module object is never changed: for the
duration of the call its parameters are swapped (as ``functional_call`` does) and each unit's
``forward`` is wrapped, and everything is restored before ``apply`` returns.

Per unit, in forward: one bucketed all-gather just before the unit runs (the next units'
gathers are issued asynchronously first, ``prefetch`` deep). With ``reshard_after_forward``
the gathered storage is freed after the unit, and gathered again in place when backward
reaches the unit (FSDP2's approach, which works under ``torch.func`` where saved-tensor hooks
do not). In backward: one bucketed reduce-scatter per unit over the data axes that shard a
parameter, and an all-reduce over the data axes where it is replicated (the gradient rule).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import optree
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from . import collectives as C
from .mesh import axis_names, axis_sizes
from .sharded import Sharded
from .sharding import Specs, resolve_specs, shard
from .simulate import is_simulated
from .spec import P, format_mesh

# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Mixed-precision policy (the same knobs as FSDP2's ``MixedPrecisionPolicy``).

    Attributes:
        param_dtype: dtype of gathered parameters and of compute (``None``: keep the shard's).
            Shards are cast before the all-gather, so a bf16 gather moves half the bytes.
        reduce_dtype: dtype of gradient reduction (``None``: ``param_dtype``).
        output_dtype: dtype the module's floating outputs are cast to (``None``: unchanged).
        cast_forward_inputs: cast each unit's floating inputs to ``param_dtype``.

    Master shards always keep their own dtype (e.g. fp32); gradients arrive in it.

    Example:
        >>> import torch
        >>> bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> Policy(mixed_precision=bf16).mixed_precision.param_dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How units are gathered, freed and reduced.

    Attributes:
        reshard_after_forward: free gathered parameters after each unit's forward and gather
            them again in backward (ZeRO-3, the default); ``False`` keeps them until backward
            (ZeRO-2 / "shard grad op"), one all-gather per unit instead of two.
        prefetch: how many next units' all-gathers are issued ahead, in forward and backward.
        mixed_precision: see :class:`MixedPrecision`.
        checkpoint: recompute each unit's activations in backward (activation checkpointing):
            ``True`` for every unit, or a predicate on the unit name.
        grad_reduce: ``"mean"`` averages gradients over the data-parallel ranks (DDP/FSDP
            semantics: a per-rank mean loss gives the global-batch mean gradient); ``"sum"``
            adds them.

    Example:
        >>> Policy(reshard_after_forward=False, prefetch=2)  # ZeRO-2, two units ahead
        Policy(reshard_after_forward=False, prefetch=2, mixed_precision=MixedPrecision(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True), checkpoint=False, grad_reduce='mean')
    """

    reshard_after_forward: bool = True
    prefetch: int = 1
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    checkpoint: bool | Callable[[str], bool] = False
    grad_reduce: Literal["mean", "sum"] = "mean"


ForwardWrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
UnitsArg = type | tuple[type, ...] | Sequence[str] | Callable[[str, nn.Module], bool] | None


def find_units(module: nn.Module, units: UnitsArg = None) -> list[str]:
    """Module paths of the units (outermost matches; the root is implicit).

    ``units`` may be a module type (or tuple of types), a list of module paths or fnmatch
    patterns (``"blocks.*"``), or a predicate ``fn(path, module) -> bool``. The default picks
    the children of every ``nn.ModuleList``/``nn.Sequential``, one unit per transformer block.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> find_units(model, nn.Linear)
        ['0', '2']
    """
    named = [(p, m) for p, m in module.named_modules() if p]
    if units is None:
        containers = {
            p for p, m in module.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
        }

        def match(path: str, m: nn.Module) -> bool:
            parent = path.rpartition(".")[0]
            return parent in containers and any(True for _ in m.parameters())

    elif isinstance(units, type) or (
        isinstance(units, tuple) and all(isinstance(u, type) for u in units)
    ):

        def match(path: str, m: nn.Module) -> bool:
            return isinstance(m, units)  # type: ignore[arg-type]

    elif callable(units):
        match = units  # type: ignore[assignment]
    else:
        patterns = list(units)  # type: ignore[arg-type]
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(p, pat) for p, _ in named):
                raise ValueError(
                    f"unit pattern {pat!r} matches no submodule of {type(module).__name__}; "
                    f"module paths look like {[p for p, _ in named[:6]]}"
                )

        def match(path: str, m: nn.Module) -> bool:
            return any(fnmatch.fnmatchcase(path, pat) for pat in patterns)

    chosen: list[str] = []
    for path, m in named:
        if match(path, m) and not any(path.startswith(c + ".") for c in chosen):
            chosen.append(path)
    return chosen


# --------------------------------------------------------------------------- gather plans


@dataclass(frozen=True)
class _Piece:
    index: int  # position in the unit's parameter list
    local_shape: tuple[int, ...]
    dim: int
    gathered_len: int


@dataclass(frozen=True)
class _Round:
    """One bucketed all-gather: ``axis`` out of the listed parameters, all of one dtype."""

    axis: str
    dtype: torch.dtype
    pieces: tuple[_Piece, ...]
    first: bool  # every input is a shard (not the output of an earlier round): prefetchable


@dataclass(frozen=True)
class _UnitPlan:
    name: str
    names: tuple[str, ...]  # parameter names (first alias)
    aliases: tuple[tuple[str, ...], ...]  # every name of each parameter (tied weights)
    values: tuple[Sharded, ...]  # layouts only (the locals are not used)
    rounds: tuple[_Round, ...]
    replicated: tuple[tuple[str, ...], ...]  # per parameter: data axes it is replicated over
    frozen: tuple[bool, ...]


def _plan_rounds(
    values: Sequence[Sharded], data_axes: Sequence[str], gather_dtypes: Sequence[torch.dtype]
) -> tuple[_Round, ...]:
    layouts = [v.layout for v in values]
    remaining = [[a for a in v.spec.axes if a in data_axes] for v in values]
    touched = [False] * len(values)
    rounds: list[_Round] = []
    names = axis_names(values[0].mesh) if values else ()
    while True:
        ready: dict[str, list[int]] = {}
        for i, lay in enumerate(layouts):
            for dim in range(len(lay.global_shape)):
                entry = lay.spec.entry(dim)
                if entry and entry[-1] in remaining[i]:
                    ready.setdefault(entry[-1], []).append(i)
        if not ready:
            break
        axis = max(ready, key=lambda a: (len(ready[a]), -names.index(a)))
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in ready[axis]:
            by_dtype.setdefault(gather_dtypes[i], []).append(i)
        for dtype, idx in by_dtype.items():
            pieces = []
            for i in idx:
                lay = layouts[i]
                dim = lay.spec.dim_of(axis)
                assert dim is not None
                pieces.append(_Piece(i, lay.local_shape, dim, lay.block_sizes(dim)[-2]))
            rounds.append(_Round(axis, dtype, tuple(pieces), not any(touched[i] for i in idx)))
        for i in ready[axis]:
            layouts[i] = layouts[i].gathered(axis)
            remaining[i].remove(axis)
            touched[i] = True
    return tuple(rounds)


# --------------------------------------------------------------------------- per-call state


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any ``torch.func`` wrappers (for communication outside autograd)."""
    func = torch._C._functorch
    while func.is_functorch_wrapped_tensor(t):
        t = func.get_unwrapped(t)
    return t


class _UnitRun:
    """A unit's mutable state during one ``apply`` call (never shared between calls)."""

    def __init__(
        self, plan: _UnitPlan, mesh: DeviceMesh, policy: Policy, data_axes: tuple[str, ...]
    ):
        self.plan, self.mesh, self.policy, self.data_axes = plan, mesh, policy, data_axes
        self.shards: list[torch.Tensor] = []  # plain local shards (set in gather)
        self.gathered: list[torch.Tensor] = []  # plain gathered tensors (outputs of the gather)
        self.owned: list[bool] = []  # gathered[i] owns a storage we may free
        self.nbytes: list[int] = []
        self.prefetched: dict[int, torch.Tensor] = {}  # round index -> async all-gather result
        self.freed = False
        self.simulated = is_simulated()
        self.sync = True  # reduce gradients over the data axes (False inside FSDP.no_sync())

    def gather_dtype(self, t: torch.Tensor) -> torch.dtype:
        pd = self.policy.mixed_precision.param_dtype
        return pd if pd is not None and t.is_floating_point() else t.dtype

    def prefetch(self, shards: Sequence[torch.Tensor]) -> None:
        """Issue the first-round all-gathers asynchronously (no wait)."""
        if self.prefetched or (self.gathered and not self.freed):
            return
        plain = [_plain(s) for s in shards]
        with torch.no_grad():
            for r, rnd in enumerate(self.plan.rounds):
                if rnd.first:
                    self.prefetched[r] = self._issue(
                        rnd, [plain[p.index].to(rnd.dtype) for p in rnd.pieces]
                    )

    def _issue(self, rnd: _Round, inputs: list[torch.Tensor]) -> torch.Tensor:
        flat = (
            inputs[0].reshape(-1)
            if len(inputs) == 1
            else torch.cat([t.reshape(-1) for t in inputs])
        )
        return C.raw_all_gather(flat, self.mesh, rnd.axis)

    def run_rounds(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """All gather rounds on plain tensors; returns the gathered parameters."""
        current = [s.to(self.gather_dtype(s)) for s in shards]
        n_of = axis_sizes(self.mesh)
        for r, rnd in enumerate(self.plan.rounds):
            pending = self.prefetched.pop(r, None)
            if pending is None:
                pending = self._issue(rnd, [current[p.index] for p in rnd.pieces])
            gathered = C.wait(pending)
            n, offset = n_of[rnd.axis], 0
            for p in rnd.pieces:
                numel = math.prod(p.local_shape)
                block = gathered[:, offset : offset + numel].reshape(n, *p.local_shape)
                offset += numel
                current[p.index] = C._move_leading(block, p.dim).narrow(p.dim, 0, p.gathered_len)
        self.prefetched.clear()
        return current

    def free(self) -> None:
        """Release the gathered storage (kept alive by autograd as empty shells)."""
        if self.freed or self.simulated:
            self.freed = True
            return
        for t, owned in zip(self.gathered, self.owned):
            if owned:
                t.untyped_storage().resize_(0)
        self.freed = True

    def regather(self) -> None:
        """Gather again, in place, into the tensors autograd saved in forward."""
        if not self.freed:
            return
        # The gathered tensors sit below any torch.func level; write them outside the transform.
        with torch.no_grad(), torch._C._DisableFuncTorch():
            fresh = self.run_rounds(self.shards)
            for t, new, owned, nbytes in zip(self.gathered, fresh, self.owned, self.nbytes):
                if not owned:
                    continue
                if not self.simulated:
                    t.untyped_storage().resize_(nbytes)
                with torch.autograd._unsafe_preserve_version_counter(t):
                    t.copy_(new)
        self.freed = False


class _UnitGather(torch.autograd.Function):
    """Gather one unit's parameters; backward reduce-scatters (and all-reduces) the grads."""

    @staticmethod
    def forward(run: _UnitRun, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        run.shards = list(shards)
        out = run.run_rounds(shards)
        gathered_idx = {p.index for rnd in run.plan.rounds for p in rnd.pieces}
        seen: set[int] = set()
        for i, t in enumerate(out):
            if i not in gathered_idx:
                out[i] = t.view_as(t)
                continue
            if not run.simulated:
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen:
                    out[i] = t = t.clone()
                seen.add(t.untyped_storage().data_ptr())
        run.gathered = out
        run.owned = [i in gathered_idx for i in range(len(out))]
        run.nbytes = [0 if run.simulated else t.untyped_storage().nbytes() for t in out]
        run.freed = False
        return tuple(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.run = inputs[0]
        ctx.dtypes = [t.dtype for t in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        run: _UnitRun = ctx.run
        plan, mesh, policy = run.plan, run.mesh, run.policy
        mp = policy.mixed_precision
        needs = [ctx.needs_input_grad[1 + i] and not plan.frozen[i] for i in range(len(grads))]
        reduce_dtype = mp.reduce_dtype or mp.param_dtype
        current: list[torch.Tensor | None] = [
            (g.to(reduce_dtype) if reduce_dtype is not None and g.is_floating_point() else g)
            if need
            else None
            for g, need in zip(grads, needs)
        ]
        sizes = axis_sizes(mesh)
        for rnd in reversed(plan.rounds):
            pieces = [p for p in rnd.pieces if needs[p.index]]
            if not pieces:
                continue
            n = sizes[rnd.axis]
            rows = []
            for p in pieces:
                g = current[p.index]
                assert g is not None
                pad = n * p.local_shape[p.dim] - p.gathered_len
                if pad:
                    g = torch.nn.functional.pad(g, [0, 0] * (g.ndim - 1 - p.dim) + [0, pad])
                rows.append(C._split_leading(g, n, p.dim).reshape(n, -1))
            flat = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
            reduced = C.wait(C.raw_reduce_scatter(flat, mesh, rnd.axis))
            offset = 0
            for p in pieces:
                numel = math.prod(p.local_shape)
                current[p.index] = reduced[offset : offset + numel].view(p.local_shape)
                offset += numel
        if run.sync:
            _all_reduce_replicated(current, plan.replicated, mesh)
        mean = policy.grad_reduce == "mean" and run.sync
        scale = math.prod(sizes[a] for a in run.data_axes) if mean else 1
        out = []
        for g, dtype in zip(current, ctx.dtypes):
            if g is not None:
                g = g / scale if scale != 1 else g
                g = g.to(dtype)
            out.append(g)
        run.free()
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
            flat = torch.cat([grads[i].reshape(-1) for i in idx])  # type: ignore[union-attr]
            flat = C.wait(C.raw_all_reduce(flat, mesh, axis))
            offset = 0
            for i in idx:
                g = grads[i]
                assert g is not None
                grads[i] = flat[offset : offset + g.numel()].view(g.shape)
                offset += g.numel()


class _PreBackward(torch.autograd.Function):
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


def _attach_pre_backward(out: Any, hook: Callable[[], None]) -> Any:
    leaves, treedef = optree.tree_flatten(out)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return out
    wrapped = _PreBackward.apply(hook, *(leaves[i] for i in idx))
    for i, w in zip(idx, wrapped):
        leaves[i] = w
    return optree.tree_unflatten(treedef, leaves)


def _cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return optree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


# --------------------------------------------------------------------------- checkpoint


class _Checkpoint(torch.autograd.Function):
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


# --------------------------------------------------------------------------- the FSDP object


def default_specs(mesh: DeviceMesh, data_axes: Sequence[str]) -> Callable[[str, torch.Tensor], P]:
    """Shard dim 0 over the data axes that shard (all but ``"replicate"``); scalars replicate."""
    shard_axes = tuple(a for a in data_axes if a != "replicate")

    def rule(path: str, t: torch.Tensor) -> P:
        return P(shard_axes) if t.ndim >= 1 and shard_axes else P()

    return rule


@dataclass(frozen=True, eq=False)
class FSDP:
    """A module's sharding: specs, units and policy. Build it with :func:`fsdp`.

    Attributes:
        module: the ``nn.Module`` (never modified).
        mesh: the named mesh.
        data_axes: mesh axes that split the batch; gradients are reduced over them.
        units: module paths of the units (the root unit holds every other parameter).
        policy: see :class:`Policy`.
        specs: the parameter layout: a ``P``, a ``{name: P}`` dict, or a rule.
        wrappers: ``(module path, wrapper)`` pairs: during :meth:`apply` the submodule's
            ``forward`` is replaced by ``wrapper(forward)`` (tensor-parallel styles use this).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sharded_model = ff.fsdp(model, mesh, units=torch.nn.Linear)
        ...     sharded_model.units, sharded_model.param_specs()["0.weight"]
        (('0', '1'), P('dp'))
    """

    module: nn.Module
    mesh: DeviceMesh
    data_axes: tuple[str, ...]
    units: tuple[str, ...]
    policy: Policy
    specs: Specs
    wrappers: tuple[tuple[str, ForwardWrapper], ...] = ()
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, :meth:`apply` reduces no gradients over the data axes.

        For gradient accumulation with parameters already gathered over the data axes
        (``train_step(accumulate_mode="local")`` does this): each rank's gradients stay
        local and unreduced until the caller reduces them once. Parameters still sharded
        over a data axis raise, since their gradient could not be returned unreduced.
        """
        previous = self._cache.get("sync", True)
        self._cache["sync"] = False
        try:
            yield
        finally:
            self._cache["sync"] = previous

    def param_specs(self) -> dict[str, P]:
        """``{parameter name: P}`` for the module's parameters (tied ones once)."""
        params = dict(self.module.named_parameters())
        # resolve_specs follows optree's leaf order (sorted keys), not the dict's order.
        paths = optree.tree_paths(params, none_is_leaf=True)  # type: ignore[arg-type]
        specs = dict(zip((p[0] for p in paths), resolve_specs(params, self.specs)))
        return {name: specs[name] for name in params}  # type: ignore[misc]

    def shard(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, Sharded]:
        """Shard the module's parameters (or ``params``, a ``{name: tensor}`` dict).

        Every rank must hold the same initial values (seed the model identically).
        """
        if params is None:
            params = {n: p.detach() for n, p in self.module.named_parameters()}
        return shard(params, self.mesh, self.param_specs())

    def apply(
        self,
        params: dict[str, Sharded],
        *args: Any,
        buffers: dict[str, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the module on ``args`` with sharded ``params`` (a pure function of its inputs).

        Works under plain autograd and inside ``torch.func.grad``/``grad_and_value``/``vjp``;
        gradients arrive as ``Sharded`` values with the parameters' layouts.
        """
        plans = self._plans(params)
        runs = {
            name: _UnitRun(plan, self.mesh, self.policy, self.data_axes)
            for name, plan in plans.items()
        }
        if not self._cache.get("sync", True):
            for run in runs.values():
                run.sync = False
                if run.plan.rounds:
                    name = run.plan.names[run.plan.rounds[0].pieces[0].index]
                    raise ValueError(
                        f"FSDP.no_sync(): params[{name!r}] ({params[name].spec}) is still sharded "
                        f"over data axis {run.plan.rounds[0].axis!r}, so its gradient cannot stay "
                        f"unreduced. Gather the data axes first (train_step(accumulate_mode="
                        f"'local') does), or call apply outside no_sync()."
                    )
        locals_ = {name: _locals(params, plan) for name, plan in plans.items()}
        order: list[str] = []
        forward_order = self._cache.get("order") or list(self.units)
        reshard = self.policy.reshard_after_forward
        mp = self.policy.mixed_precision
        modules = dict(self.module.named_modules())
        accessor = NamedMemberAccessor(self.module)
        placeholders = {
            alias: torch.empty(v.global_shape, dtype=runs[u].gather_dtype(v.local), device="meta")
            for u, plan in plans.items()
            if u
            for aliases, v in zip(plan.aliases, plan.values)
            for alias in aliases
        }

        def gather(unit: str) -> dict[str, torch.Tensor]:
            run = runs[unit]
            outs = _UnitGather.apply(run, *locals_[unit])
            return {alias: t for aliases, t in zip(run.plan.aliases, outs) for alias in aliases}

        def prefetch_after(unit: str, sequence: Sequence[str]) -> None:
            if unit not in sequence:
                return
            pos = sequence.index(unit)
            for nxt in sequence[pos + 1 : pos + 1 + self.policy.prefetch]:
                if nxt in runs:
                    runs[nxt].prefetch(locals_[nxt])

        def backward_hook(unit: str) -> Callable[[], None]:
            def hook() -> None:
                runs[unit].regather()
                backward_order = ["", *order][::-1]
                prefetch_after(unit, backward_order)

            return hook

        def wrap(unit: str, original: Callable[..., Any]) -> Callable[..., Any]:
            ckpt = self.policy.checkpoint
            use_ckpt = ckpt(unit) if callable(ckpt) else bool(ckpt)

            def forward(*a: Any, **kw: Any) -> Any:
                order.append(unit)
                tensors = gather(unit)
                prefetch_after(unit, forward_order)
                if mp.cast_forward_inputs:
                    a, kw = _cast_floating((a, kw), mp.param_dtype)
                names = list(tensors)
                try:
                    accessor.swap_tensors_dict(tensors)
                    if use_ckpt:
                        out = _checkpointed(
                            with_wrappers(original), names, list(tensors.values()), accessor, a, kw
                        )
                    else:
                        out = original(*a, **kw)
                finally:
                    accessor.swap_tensors_dict({n: placeholders[n] for n in names})
                if reshard:
                    runs[unit].free()
                    out = _attach_pre_backward(out, backward_hook(unit))
                return out

            return forward

        restored = [False]

        def with_wrappers(fn: Callable[..., Any]) -> Callable[..., Any]:
            # A checkpointed unit recomputes in backward, after apply has restored the module:
            # install the forward wrappers (tensor-parallel styles) again around the recompute.
            def call(*a: Any, **kw: Any) -> Any:
                if not restored[0] or not self.wrappers:
                    return fn(*a, **kw)
                saved = [(modules[p], modules[p].__dict__.get("forward")) for p, _ in self.wrappers]
                try:
                    for p, wrapper in self.wrappers:
                        modules[p].forward = wrapper(modules[p].forward)  # type: ignore[method-assign]
                    return fn(*a, **kw)
                finally:
                    for m, previous in reversed(saved):
                        if previous is None:
                            del m.forward
                        else:
                            m.forward = previous  # type: ignore[method-assign]

            return call

        patched = []
        try:
            # Inner wrappers first (e.g. tensor-parallel styles), then the unit gathers.
            for path, wrapper in self.wrappers:
                m = modules[path]
                patched.append((m, m.__dict__.get("forward")))
                m.forward = wrapper(m.forward)  # type: ignore[method-assign]
            for unit in self.units:
                m = modules[unit]
                patched.append((m, m.__dict__.get("forward")))
                m.forward = wrap(unit, m.forward)  # type: ignore[method-assign]
            root_tensors = gather("") if "" in runs else {}
            if mp.cast_forward_inputs:
                args, kwargs = _cast_floating((args, kwargs), mp.param_dtype)
            tensors = {**placeholders, **root_tensors}
            if buffers is not None:
                tensors.update(buffers)
            out = torch.func.functional_call(
                self.module, tensors, args, kwargs, tie_weights=False, strict=False
            )
        finally:
            for m, previous in reversed(patched):
                if previous is None:
                    del m.forward
                else:
                    m.forward = previous  # type: ignore[method-assign]
            restored[0] = True
        self._cache["order"] = list(dict.fromkeys(order))
        if mp.output_dtype is not None:
            out = _cast_floating(out, mp.output_dtype)
        if reshard and "" in runs:
            runs[""].free()
            out = _attach_pre_backward(out, backward_hook(""))
        return out

    def _plans(self, params: dict[str, Sharded]) -> dict[str, _UnitPlan]:
        key = tuple(
            (n, v.global_shape, v.spec, v.dtype)
            for n, v in params.items()
            if isinstance(v, Sharded)
        )
        cached = self._cache.get("plans")
        if cached is not None and cached[0] == key:
            return cached[1]
        plans = self._build_plans(params)
        self._cache["plans"] = (key, plans)
        return plans

    def _build_plans(self, params: dict[str, Sharded]) -> dict[str, _UnitPlan]:
        module_params = dict(self.module.named_parameters())
        missing = sorted(set(module_params) - set(params))
        unexpected = sorted(set(params) - set(module_params))
        if missing or unexpected:
            raise ValueError(
                f"params do not match {type(self.module).__name__}'s parameters: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}. Pass the dict returned by "
                f"FSDP.shard() (keys are module.named_parameters() names)."
            )
        for name, v in params.items():
            if not isinstance(v, Sharded):
                raise TypeError(
                    f"params[{name!r}] is a {type(v).__name__}; FSDP.apply takes Sharded values "
                    f"(use FSDP.shard(), or ff.shard(params, mesh, P()) to replicate)."
                )
            if v.mesh != self.mesh:
                raise ValueError(
                    f"params[{name!r}] lives on {format_mesh(axis_sizes(v.mesh))}, but this FSDP "
                    f"runs on {format_mesh(axis_sizes(self.mesh))}; reshard it onto the same mesh."
                )
            for dim in range(v.ndim):
                entry = v.spec.entry(dim)
                data = [a for a in entry if a in self.data_axes]
                model = [a for a in entry if a not in self.data_axes]
                if data and model and entry.index(data[0]) < entry.index(model[-1]):
                    raise ValueError(
                        f"params[{name!r}] (shape {v.global_shape}, {v.spec}, "
                        f"{format_mesh(axis_sizes(self.mesh))}): data axis {data[0]!r} is major "
                        f"to model axis {model[-1]!r} in dim {dim}; gathering it would not give a "
                        f"contiguous block. Put data axes last (minor), e.g. P(('tp', 'dp'))."
                    )
        aliases: dict[int, list[str]] = {}
        first_name: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
            first_name.setdefault(id(p), name)
        owner: dict[str, str] = {}
        for pid, names in aliases.items():
            units = {_unit_of(n, self.units) for n in names}
            owner[first_name[pid]] = units.pop() if len(units) == 1 else ""
        plans: dict[str, _UnitPlan] = {}
        for unit in ["", *self.units]:
            names = tuple(n for n in module_params if owner[n] == unit)
            if not names:
                continue
            values = tuple(params[n] for n in names)
            pd = self.policy.mixed_precision.param_dtype
            dtypes = [
                pd if pd is not None and v.dtype.is_floating_point else v.dtype for v in values
            ]
            plans[unit] = _UnitPlan(
                name=unit,
                names=names,
                aliases=tuple(tuple(aliases[id(module_params[n])]) for n in names),
                values=values,
                rounds=_plan_rounds(values, self.data_axes, dtypes),
                replicated=tuple(
                    tuple(a for a in self.data_axes if a not in v.spec.axes) for v in values
                ),
                frozen=tuple(not module_params[n].requires_grad for n in names),
            )
        return plans


def _unit_of(name: str, units: Sequence[str]) -> str:
    best = ""
    for u in units:
        if name.startswith(u + ".") and len(u) > len(best):
            best = u
    return best


def _locals(params: dict[str, Sharded], plan: _UnitPlan) -> list[torch.Tensor]:
    out = []
    for name, frozen in zip(plan.names, plan.frozen):
        local = params[name].local
        out.append(local.detach() if frozen else local)
    return out


def _checkpointed(
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

    return _Checkpoint.apply(fn, *flat)


def fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    specs: Specs | None = None,
    units: UnitsArg = None,
    policy: Policy | None = None,
    data_axes: Sequence[str] | None = None,
    wrappers: Sequence[tuple[str, ForwardWrapper]] = (),
) -> FSDP:
    """Describe how to run ``module`` fully sharded over ``mesh``.

    Strategies are spec and policy choices: ``specs=P("dp")`` (the default on a ``dp`` mesh)
    is FSDP/ZeRO-3; add ``Policy(reshard_after_forward=False)`` for ZeRO-2; ``specs=P()``
    is DDP; on a ``{"replicate": r, "shard": s}`` mesh the default ``P("shard")`` is HSDP.

    Args:
        module: any ``nn.Module``; it is never modified.
        mesh: a named ``DeviceMesh``.
        specs: the parameter layout at rest: a ``P`` for every parameter, a
            ``{name: P}`` dict, or a rule ``fn(name, tensor) -> P``. Default: dim 0 sharded
            over the data axes (``"replicate"`` excluded), scalars replicated.
        units: which submodules are gathered as one unit (see :func:`find_units`).
        policy: see :class:`Policy`.
        data_axes: the mesh axes that split the batch (default: every axis but ``"tp"``).
        wrappers: ``(module path, wrapper)`` pairs applied to submodules' ``forward`` during
            :meth:`FSDP.apply` only (the module object is restored after every call).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sharded_model = ff.fsdp(model, mesh)
        ...     params = sharded_model.shard()
        ...     x = torch.randn(3, 4)
        ...     y = sharded_model.apply(params, x)
        ...     torch.allclose(ff.rank_values(y)[0], model(x))
        True
    """
    names = axis_names(mesh)
    if data_axes is None:
        data_axes = tuple(a for a in names if a != "tp")
    unknown = [a for a in data_axes if a not in names]
    if unknown:
        raise ValueError(
            f"data_axes {tuple(data_axes)} name {unknown[0]!r}, which {format_mesh(axis_sizes(mesh))} lacks"
        )
    return FSDP(
        module=module,
        mesh=mesh,
        data_axes=tuple(data_axes),
        units=tuple(find_units(module, units)),
        policy=policy or Policy(),
        specs=specs if specs is not None else default_specs(mesh, data_axes),
        wrappers=_check_wrappers(module, wrappers),
    )


def _check_wrappers(
    module: nn.Module, wrappers: Sequence[tuple[str, ForwardWrapper]]
) -> tuple[tuple[str, ForwardWrapper], ...]:
    modules = dict(module.named_modules())
    for path, _ in wrappers:
        if path not in modules:
            raise ValueError(
                f"wrapper for module path {path!r}: {type(module).__name__} has no such submodule "
                f"(paths look like {[p for p in modules if p][:6]})"
            )
    return tuple(wrappers)
