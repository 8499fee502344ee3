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
On real processes a unit's reduce-scatter stays in flight while the next unit computes its
backward. A unit called twice in one forward is gathered (and reduced) once per call.

:func:`~functional_fsdp.fsdp.memory.track_memory` shows which units' full parameters are alive
at every step of this; ``count_comms`` shows the collectives.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import optree
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..dist.mesh import axis_names, axis_sizes
from ..dist.simulate import is_simulated
from ..sharded import Sharded
from ..sharding import Specs, resolve_specs, shard
from ..spec import P, format_mesh
from .memory import Phase, active_trackers
from .runtime import (
    Call,
    InFlight,
    ReduceFence,
    Unit,
    UnitGather,
    UnitPlan,
    attach_pre_backward,
    cast_floating,
    checkpointed,
    plan_rounds,
)

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


ForwardWrapper = Callable[[nn.Module, Callable[..., Any]], Callable[..., Any]]
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

        ``buffers`` (``{name: tensor}``) replaces the module's buffers for this call, as in
        ``torch.func.functional_call``; buffers are never sharded. Python control flow that
        skips a unit must agree on every rank (its collectives are skipped too).
        """
        static = self._static(params)
        plans, placeholders, modules = static.plans, static.placeholders, static.modules
        trackers = active_trackers()
        in_flight = InFlight()
        units = {
            name: Unit(
                plan,
                self.mesh,
                self.policy,
                self.data_axes,
                _locals(params, plan),
                trackers,
                in_flight,
            )
            for name, plan in plans.items()
        }
        if not is_simulated() and not torch.is_anomaly_enabled():
            # Before any gather, one fence over every shard: see ReduceFence.
            # Only shards being differentiated: a frozen one must not turn into one that
            # requires grad (an autograd.Function's outputs all do when any input does).
            live = [s for u in units.values() for s in u.shards if s.requires_grad]
            fenced = iter(ReduceFence.apply(in_flight, *live)) if live else iter(())
            for unit_state in units.values():
                unit_state.defer = True
                unit_state.shards = [
                    next(fenced) if s.requires_grad else s for s in unit_state.shards
                ]
        if not self._cache.get("sync", True):
            for unit_state in units.values():
                unit_state.sync = False
                if unit_state.plan.rounds:
                    first = unit_state.plan.rounds[0]
                    name = unit_state.plan.names[first.pieces[0].index]
                    raise ValueError(
                        f"FSDP.no_sync(): params[{name!r}] ({params[name].spec}) is still sharded "
                        f"over data axis {first.axis!r}, so its gradient cannot stay "
                        f"unreduced. Gather the data axes first (train_step(accumulate_mode="
                        f"'local') does), or call apply outside no_sync()."
                    )
        calls: list[Call] = []  # this step's unit invocations, in order
        planned: list[str] = self._cache.get("order") or list(self.units)  # the last step's
        depth = self.policy.prefetch
        reshard = self.policy.reshard_after_forward
        mp = self.policy.mixed_precision
        accessor = NamedMemberAccessor(self.module)

        def note_compute(unit: str, phase: Phase) -> None:
            for tracker in trackers:
                tracker._record("compute", unit, phase, 0, -1)

        def gather(call: Call) -> dict[str, torch.Tensor]:
            outs = UnitGather.apply(call, *call.unit.shards)
            aliases = call.unit.plan.aliases
            return {alias: t for names, t in zip(aliases, outs) for alias in names}

        def prefetch_forward(position: int) -> None:
            """Issue the all-gathers of the calls that followed ``position`` in the last step."""
            for name in planned[position + 1 : position + 1 + depth]:
                if name in units:
                    units[name].prefetch("forward")

        def backward_hook(call: Call, position: int) -> Callable[[], None]:
            """Before ``call``'s backward: gather it again, and prefetch the calls before it."""

            def hook() -> None:
                call.regather()
                for earlier in calls[max(0, position - depth) : position][::-1]:
                    if earlier.hooked:
                        earlier.unit.prefetch("backward")
                note_compute(call.unit.plan.name, "backward")

            return hook

        def wrap(unit: str, _module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
            ckpt = self.policy.checkpoint
            use_ckpt = ckpt(unit) if callable(ckpt) else bool(ckpt)

            def forward(*a: Any, **kw: Any) -> Any:
                call = Call(units[unit], len(calls))
                calls.append(call)
                tensors = gather(call)
                if call.position < len(planned) and planned[call.position] == unit:
                    prefetch_forward(call.position)
                note_compute(unit, "forward")
                if mp.cast_forward_inputs:
                    a, kw = cast_floating((a, kw), mp.param_dtype)
                names = list(tensors)
                try:
                    accessor.swap_tensors_dict(tensors)
                    if use_ckpt:
                        out = checkpointed(
                            with_wrappers(original), names, list(tensors.values()), accessor, a, kw
                        )
                    else:
                        out = original(*a, **kw)
                finally:
                    accessor.swap_tensors_dict({n: placeholders[n] for n in names})
                if reshard:
                    call.free("forward")
                    out, call.hooked = attach_pre_backward(out, backward_hook(call, call.position))
                return out

            return forward

        restored = [False]

        def with_wrappers(fn: Callable[..., Any]) -> Callable[..., Any]:
            # A checkpointed unit recomputes in backward, after apply has restored the module:
            # install the forward wrappers (tensor-parallel styles) again around the recompute.
            def call(*a: Any, **kw: Any) -> Any:
                if not restored[0] or not self.wrappers:
                    return fn(*a, **kw)
                with _forwards_wrapped(modules, self.wrappers):
                    return fn(*a, **kw)

            return call

        root = Call(units[""], -1) if "" in units else None
        # Inner wrappers first (e.g. tensor-parallel styles), then the unit gathers.
        unit_wrappers = [(unit, functools.partial(wrap, unit)) for unit in self.units]
        try:
            with _forwards_wrapped(modules, [*self.wrappers, *unit_wrappers]):
                root_tensors = gather(root) if root is not None else {}
                prefetch_forward(-1)
                if root is not None:
                    note_compute("", "forward")
                if mp.cast_forward_inputs:
                    args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
                tensors = {**placeholders, **root_tensors}
                if buffers is not None:
                    tensors.update(buffers)
                out = torch.func.functional_call(
                    self.module, tensors, args, kwargs, tie_weights=False, strict=False
                )
        finally:
            restored[0] = True
            for unit_state in units.values():  # issued ahead for a call that did not come
                unit_state.drop_prefetch("forward")
        self._cache["order"] = [c.unit.plan.name for c in calls]
        if mp.output_dtype is not None:
            out = cast_floating(out, mp.output_dtype)
        if reshard and root is not None:
            root.free("forward")
            # The root's backward starts first: prefetch the last calls from there.
            out, root.hooked = attach_pre_backward(out, backward_hook(root, len(calls)))
        return out

    def _static(self, params: dict[str, Sharded]) -> _Static:
        """Plans and other per-layout state, built once per parameter layout."""
        key = tuple(
            (n, v.global_shape, v.spec, v.dtype)
            for n, v in params.items()
            if isinstance(v, Sharded)
        )
        cached = self._cache.get("static")
        if cached is not None and cached[0] == key and len(key) == len(params):
            return cached[1]
        plans = self._build_plans(params)
        pd = self.policy.mixed_precision.param_dtype
        placeholders = {
            alias: torch.empty(
                layout.global_shape,
                dtype=pd if pd is not None and dtype.is_floating_point else dtype,
                device="meta",
            )
            for u, plan in plans.items()
            if u
            for aliases, layout, dtype in zip(plan.aliases, plan.layouts, plan.dtypes)
            for alias in aliases
        }
        static = _Static(plans, placeholders, dict(self.module.named_modules()))
        self._cache["static"] = (key, static)
        return static

    def _build_plans(self, params: dict[str, Sharded]) -> dict[str, UnitPlan]:
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
        plans: dict[str, UnitPlan] = {}
        for unit in ["", *self.units]:
            names = tuple(n for n in module_params if owner[n] == unit)
            if not names:
                continue
            values = tuple(params[n] for n in names)
            layouts = [v.layout for v in values]
            pd = self.policy.mixed_precision.param_dtype
            dtypes = [
                pd if pd is not None and v.dtype.is_floating_point else v.dtype for v in values
            ]
            rounds = plan_rounds(layouts, self.mesh, self.data_axes, dtypes)
            last_round, full_bytes = [-1] * len(values), [0] * len(values)
            for r, rnd in enumerate(rounds):
                for p in rnd.pieces:
                    last_round[p.index] = r
                    padded = math.prod(p.padded_shape(rnd.size))
                    full_bytes[p.index] = padded * rnd.dtype.itemsize
            plans[unit] = UnitPlan(
                name=unit,
                names=names,
                aliases=tuple(tuple(aliases[id(module_params[n])]) for n in names),
                layouts=tuple(layouts),
                dtypes=tuple(v.dtype for v in values),
                rounds=rounds,
                last_round=tuple(last_round),
                gathered_bytes=sum(full_bytes),
                replicated=tuple(
                    tuple(a for a in self.data_axes if a not in v.spec.axes) for v in values
                ),
            )
        return plans


@dataclass(frozen=True)
class _Static:
    """What :meth:`FSDP.apply` needs that depends only on the parameter layout (cached)."""

    plans: dict[str, UnitPlan]
    placeholders: dict[str, torch.Tensor]  # meta tensors standing in for ungathered params
    modules: dict[str, nn.Module]


def _unit_of(name: str, units: Sequence[str]) -> str:
    best = ""
    for u in units:
        if name.startswith(u + ".") and len(u) > len(best):
            best = u
    return best


def _locals(params: dict[str, Sharded], plan: UnitPlan) -> list[torch.Tensor]:
    # A parameter gets a gradient exactly when the caller differentiates its shard.
    return [params[name].local for name in plan.names]


@contextlib.contextmanager
def _forwards_wrapped(
    modules: dict[str, nn.Module], wrappers: Sequence[tuple[str, ForwardWrapper]]
) -> Iterator[None]:
    """Replace each listed submodule's ``forward`` by ``wrapper(forward)``, in order (later
    wrappers wrap earlier ones), and restore every one of them on exit."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for path, wrapper in wrappers:
            m = modules[path]
            patched.append((m, m.__dict__.get("forward")))
            m.forward = wrapper(m, m.forward)  # type: ignore[method-assign]
        yield
    finally:
        for m, previous in reversed(patched):
            if previous is None:
                del m.forward
            else:
                m.forward = previous  # type: ignore[method-assign]


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
