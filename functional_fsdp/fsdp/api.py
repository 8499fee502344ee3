"""Functional FSDP forward and backward over any ``nn.Module``.

``fsdp(module, mesh, ...)`` describes how a module's parameters are sharded and grouped into
units and builds the :class:`~functional_fsdp.fsdp.layout.ModelLayout` once; ``FSDP.apply(params,
*args, **kwargs)`` runs the module with ``torch.func.functional_call`` semantics on a dict of
``Sharded`` parameters. The module object is never changed, not even during the call: each
call runs on its own shallow copies of the module tree (see
:mod:`functional_fsdp.fsdp.runtime`).

Per unit, in forward: one bucketed all-gather just before the unit runs (the next units'
gathers are issued asynchronously first, ``prefetch`` deep, in module order). With
``reshard_after_forward`` the gathered storage is freed after the unit, and gathered again in
place when backward reaches the unit (FSDP2's approach, which works under ``torch.func`` where
saved-tensor hooks do not). In backward: one bucketed reduce-scatter per unit over the data
axes that shard a parameter, and an all-reduce over the data axes where it is replicated (the
gradient rule). A parameter gets a gradient exactly when the caller differentiates its shard:
frozen parameters (not differentiated) cost no gradient and no reduce-scatter. On real
processes a unit's reduce-scatter stays in flight while the next unit computes its backward.

:func:`~functional_fsdp.fsdp.memory.track_memory` shows which units' full parameters are alive
at every step of this; ``count_comms`` shows the collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._partition import mark_frozen
from ..cp.attention import splitting
from ..cp.checks import check_split_attention, with_padding_mask
from ..distributed.axes import data_axes_of, same_mesh, sequence_axis_of
from ..distributed.mesh import axis_sizes, check_mesh, describe_mesh
from ..distributed.simulate import check_made_outside, is_shapes_only
from ..formats import storage_view, sync_view
from ..resharding import Specs, resolve_specs, shard
from ..sharded import Sharded
from ..spec import P, format_mesh
from . import runtime, step_inputs
from .layout import ModelLayout, model_layout
from .materialize import init_sharded
from .policy import (
    ModuleWrapper,
    Policy,
    UnitsArg,
    default_specs,
    find_units,
    trainable_names,
)

TrainableArg = Collection[str] | Callable[[str], bool] | None


@dataclass(frozen=True, eq=False)
class FSDP:
    """A module's sharding: specs, units and policy, and the layout built from them.

    Build it with :func:`fsdp`. It is immutable: ``dataclasses.replace(sharded_model,
    policy=...)`` gives a new description with its own layout.

    Attributes:
        module: the ``nn.Module`` (never modified).
        mesh: the named mesh.
        data_axes: mesh axes that split the batch; gradients are reduced over them.
        units: module paths of the units (the root unit holds every other parameter).
        policy: see :class:`Policy`.
        specs: the parameter layout: a ``P``, a ``{name: P}`` dict, or a rule.
        wrappers: ``(module path, wrapper)`` pairs: during :meth:`apply`,
            ``wrapper(module, forward)`` replaces the forward of that submodule's per-call
            copy (tensor-parallel styles use this).
        trainable_override: the names of the trainable parameters, or a predicate on the
            name; ``None``: those with ``requires_grad`` (read when :attr:`trainable` is).
        layout: the :class:`~functional_fsdp.fsdp.layout.ModelLayout`: units, each
            parameter's layout, the bucketed gather rounds (derived; never passed). Its old
            name ``plan`` still reads, with a ``DeprecationWarning``.

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
    wrappers: tuple[tuple[str, ModuleWrapper], ...] = ()
    trainable_override: TrainableArg = None
    sequence_axis: str | None = None
    layout: ModelLayout = field(init=False, repr=False)
    _modules: tuple[tuple[str, nn.Module], ...] = field(init=False, repr=False)
    _sizes: dict[str, int] = field(init=False, repr=False)
    _other_layouts: dict[tuple[P, ...], ModelLayout] = field(init=False, repr=False)
    _complex: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sizes = axis_sizes(self.mesh)
        params = dict(self.module.named_parameters())
        object.__setattr__(
            self, "_complex", tuple(n for n, p in params.items() if p.dtype.is_complex)
        )
        # resolve_specs follows optree's leaf order (sorted keys), not the dict's order.
        paths = optree.tree_paths(params, none_is_leaf=True)  # type: ignore[arg-type]
        resolved = dict(zip((p[0] for p in paths), resolve_specs(params, self.specs)))
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_other_layouts", {})
        object.__setattr__(self, "layout", self._make_layout({n: resolved[n] for n in params}))
        object.__setattr__(
            self, "_modules", tuple(self.module.named_modules(remove_duplicate=False))
        )

    @property
    def plan(self) -> ModelLayout:
        """Deprecated name of :attr:`layout` ("plan" is ``ff.plan``'s report)."""
        warnings.warn(
            "FSDP.plan is now FSDP.layout (the model's ModelLayout); 'plan' names ff.plan's "
            "report.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.layout

    def _make_layout(self, specs: dict[str, P | None]) -> ModelLayout:
        return model_layout(
            self.module,
            self._sizes,
            specs,  # type: ignore[arg-type]
            self.units,
            self.data_axes,
            self.policy.mixed_precision.param_dtype,
        )

    @property
    def trainable(self) -> frozenset[str]:
        """Names of the trainable parameters (first alias of tied ones).

        By default those with ``requires_grad=True``, read from the module now (so a layer
        unfrozen after :func:`fsdp` counts); ``fsdp(trainable=...)`` overrides it. Pass it to
        :func:`functional_fsdp.partition` or ``TrainState.create(trainable=...)``.

        Example:
            >>> import torch, functional_fsdp as ff
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
            >>> _ = model[0].requires_grad_(False)
            >>> with ff.simulated_mesh({"dp": 2}) as mesh:
            ...     sorted(ff.fsdp(model, mesh).trainable)
            ['1.bias', '1.weight']
        """
        names = trainable_names(self.module, self.trainable_override)
        if self.trainable_override is not None:
            _check_trainable_dtypes(self.module, names)
        return names

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, this model's :meth:`apply` reduces no gradients over the data axes.

        Equivalent to ``Policy(grad_reduce="none")`` for the calls made inside the block (in
        this thread or task only; nothing is stored on the object). For gradient
        accumulation with parameters already gathered over the data axes: each rank's
        gradients stay local until the caller reduces them once (what
        ``train_step(accumulate_mode="local")`` does, through the same per-step inputs,
        :mod:`functional_fsdp.fsdp.step_inputs`). Differentiated parameters still sharded
        over a data axis raise, since their gradient could not be returned unreduced.

        Example:
            >>> import torch, functional_fsdp as ff
            >>> model = torch.nn.Linear(2, 1)
            >>> with ff.simulated_mesh({"dp": 2}) as mesh:
            ...     sharded_model = ff.fsdp(model, mesh, specs=ff.P())  # replicated
            ...     params = sharded_model.shard()
            ...     with sharded_model.no_sync(), ff.count_comms() as comms:
            ...         _ = torch.func.grad(lambda p: sharded_model.apply(p, torch.ones(1, 2)).sum())(params)
            ...     comms.count()
            0
        """
        with step_inputs.given(self, reduce=False):
            yield

    def param_specs(self) -> dict[str, P]:
        """``{parameter name: P}`` for the module's parameters (tied ones once)."""
        return dict(self.layout.specs)

    def shard(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, Sharded]:
        """Shard the module's parameters (or ``params``, a ``{name: tensor}`` dict).

        Every rank must hold the same initial values (seed the model identically). A module
        built on the ``meta`` device is initialised one unit at a time by
        :func:`~functional_fsdp.init_sharded` (which also returns the buffers, needed when
        they are on ``meta`` too).
        """
        own = params is None  # the shards are then the library's own: frozen ones are tagged
        if params is None:
            shapes_only = is_shapes_only(self.mesh)  # meta values are what it runs on
            if not shapes_only and any(p.is_meta for p in self.module.parameters()):
                meta_buffers = [n for n, b in self.module.named_buffers() if b.is_meta]
                if meta_buffers:
                    raise ValueError(
                        f"FSDP.shard(): {type(self.module).__name__} is on the meta device, "
                        f"buffers included ({meta_buffers[:3]}); create both with "
                        f"params, buffers = ff.init_sharded(sharded_model) and pass "
                        f"buffers=buffers to apply."
                    )
                return init_sharded(self)[0]
            params = {n: p.detach() for n, p in self.module.named_parameters()}
        sharded = shard(params, self.mesh, self.param_specs())
        sharded = to_host(sharded) if self.policy.offload else sharded
        return mark_frozen(sharded, self) if own else sharded

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"an FSDP description is not a module and is not called: it has no parameters "
            f"of its own (they live in the tree sharded_model.shard() returns). Run the "
            f"{type(self.module).__name__} with sharded_model.apply(params, *inputs) "
            f"(torch.func.functional_call semantics), e.g. inside your loss function."
        )

    def apply(
        self,
        params: dict[str, Sharded],
        *args: Any,
        buffers: dict[str, torch.Tensor] | None = None,
        mutable: bool | str = False,
        **kwargs: Any,
    ) -> Any:
        """Run the module on ``args``/``kwargs`` with sharded ``params`` (a pure function).

        Works under plain autograd and inside ``torch.func.grad``/``grad_and_value``/``vjp``;
        gradients arrive as ``Sharded`` values with the parameters' layouts, for the
        parameters the caller differentiates. Outputs may be any pytree torch knows
        (tuples, dicts, ``transformers``' ``ModelOutput``, dataclasses).

        ``buffers`` (``{name: tensor}``) replaces the module's buffers for this call, as in
        ``torch.func.functional_call``; buffers are never sharded. Python control flow that
        skips a unit must agree on every rank (its collectives are skipped too).

        ``mutable`` carries the buffers as state, as Flax's ``mutable=["batch_stats"]``: the
        forward runs on clones of ``buffers`` (BatchNorm in training mode updates its running
        statistics there) and the call returns ``(out, new_buffers)``, ``new_buffers`` with
        the keys of ``buffers``; your module and ``buffers`` are never written, and the new
        values are detached (state, not differentiated: return them as ``has_aux`` output).
        ``"sync"``: BatchNorm normalises with the statistics of the global batch over the data
        axes and its running statistics equal one process's on the global batch
        (SyncBatchNorm's). ``"per_rank"`` (or ``True``): each rank normalises with its own
        share's statistics and the new buffers are data rank 0's on every rank (torch DDP's
        default, ``broadcast_buffers=True``). See docs/guides/buffers.md.

        Example:
            >>> import torch, functional_fsdp as ff
            >>> with ff.simulated_mesh({"dp": 2}) as mesh:
            ...     model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
            ...     sm = ff.fsdp(model, mesh)
            ...     bufs = dict(model.named_buffers())
            ...     out, new = sm.apply(sm.shard(), torch.ones(4, 3), buffers=bufs, mutable="sync")
            ...     int(new["1.num_batches_tracked"]), int(bufs["1.num_batches_tracked"])
            (1, 0)
        """
        mode = _mutable_mode(mutable, buffers)
        sync_view(self.module)  # a 4-bit base's storage view runs with the user's state
        layout = self._layout_for(params)
        given = step_inputs.inputs_for(self)  # what a train_step tells this call, if any
        policy = self.policy
        if not given.reduce:
            policy = dataclasses.replace(policy, grad_reduce="none")
        if self._complex and policy.grad_reduce != "none":
            self._check_complex(params)
        added = False
        if self.sequence_axis is not None:
            kwargs, added = with_padding_mask(self.module, kwargs)
        with self._sequence_split(added):
            return runtime.run(
                layout,
                self._modules,
                self.mesh,
                self._sizes,
                policy,
                self.data_axes,
                self.wrappers,
                params,
                args,
                kwargs,
                buffers,
                replicas=given.replicas,
                mutable=mode,
            )

    @contextlib.contextmanager
    def _sequence_split(self, mask_added: bool = False) -> Iterator[None]:
        """Where :attr:`sequence_axis` splits the sequence, attention inside the block
        gathers keys and values over it (:mod:`functional_fsdp.cp`); a model whose attention
        does not is refused."""
        if self.sequence_axis is None:
            yield
            return
        cp = self._sizes[self.sequence_axis]
        if cp > 1:
            check_split_attention(self.module, self.sequence_axis, self.mesh)
        with splitting(self.mesh, self.sequence_axis, mask_added) as split:
            yield
        if cp > 1 and split.calls == 0:
            raise ValueError(
                f"{type(self.module).__name__} ran on {describe_mesh(self.mesh)}, whose "
                f"{self.sequence_axis!r} axis splits each sequence, but none of its attention "
                f"went through ff.cp.attention: every rank would attend within its own chunks "
                f"only. Call ff.cp.attention(q, k, v) in the model's attention (and "
                f"ff.cp.positions for its position embeddings), or build a transformers model "
                f"with attn_implementation=ff.cp.register_attention(); or pass "
                f"sequence_axis=None to ff.fsdp to split the batch over it instead."
            )

    def _layout_for(self, params: Any) -> ModelLayout:
        """Check ``params`` against the module; the model's layout for theirs."""
        expected = self.layout.expected
        other = False
        if not isinstance(params, dict):
            raise TypeError(
                f"FSDP.apply takes params as a dict {{name: Sharded}} (what FSDP.shard() "
                f"returns), got a {type(params).__name__}."
            )
        if len(params) != len(expected) or any(n not in params for n in expected):
            missing = sorted(set(expected) - set(params))
            unexpected = sorted(set(params) - set(expected))
            raise ValueError(
                f"params do not match {type(self.module).__name__}'s parameters: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}. Pass the dict returned by "
                f"FSDP.shard() (keys are module.named_parameters() names); to train part of "
                f"them, combine the parts again: ff.combine(trainable, frozen)."
            )
        for name, (shape, spec, dtype) in expected.items():
            v = params[name]
            if not isinstance(v, Sharded):
                shape = f" of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else ""
                raise TypeError(
                    f"params[{name!r}] is a {type(v).__name__}{shape}, not a Sharded value; "
                    f"FSDP.apply takes Sharded values (use FSDP.shard(), or "
                    f"ff.shard(params, mesh, P()) to replicate)."
                )
            if not same_mesh(v.mesh, self.mesh):
                raise ValueError(
                    f"params[{name!r}] lives on {describe_mesh(v.mesh)}, but this FSDP runs on "
                    f"{describe_mesh(self.mesh)}. Shard the parameters on this FSDP's mesh "
                    f"(FSDP.shard()); to move trained values to another mesh, save them and "
                    f"load them into its layout: ff.checkpoint.load(path, sharded_model.shard())."
                )
            if v.local.is_meta and not is_shapes_only(self.mesh):
                raise ValueError(
                    f"params[{name!r}] (shape {v.global_shape}, {v.spec.trimmed()}) is on the "
                    f"meta device: it has no values. Create the parameters with "
                    f"params, buffers = ff.init_sharded(sharded_model) (or FSDP.shard()), or "
                    f"load them: ff.checkpoint.load_safetensors(sharded_model, path)."
                )
            compute = self.policy.mixed_precision.param_dtype
            same_dtype = v.dtype == dtype or (
                compute is not None and dtype.is_floating_point and v.dtype == compute
            )  # kept in the compute dtype (ff.master_weights holds the fp32 masters)
            if v.global_shape != shape or not same_dtype:
                raise ValueError(
                    f"params[{name!r}] is {v.dtype} {v.global_shape} {v.spec.trimmed()}, but "
                    f"{type(self.module).__name__}'s parameter is {dtype} {shape} "
                    f"{spec.trimmed()} on {format_mesh(self._sizes)}. Pass the parameters of "
                    f"this model, sharded by FSDP.shard() (or build ff.fsdp on a module of the "
                    f"same shapes and dtypes)."
                )
            if v.spec != spec and v.spec.padded(len(shape)) != spec:
                other = True
        if not other:
            return self.layout
        # Another layout (e.g. gathered over the data axes for local accumulation): its own
        # ModelLayout, built once per layout. It is a pure function of the layout and of this
        # (immutable) object, so remembering it changes no result.
        key = tuple(params[n].spec.padded(len(shape)) for n, (shape, _, _) in expected.items())
        layout = self._other_layouts.get(key)
        if layout is None:
            layout = self._make_layout(dict(zip(expected, key)))
            self._other_layouts[key] = layout
        return layout

    def _check_complex(self, params: dict[str, Sharded]) -> None:
        """Complex gradients cannot be reduced: c10d's functional collectives (gloo, NCCL)
        have no complex sum. Refuse before the backward reaches a collective."""
        for name in self._complex:
            local = params[name].local
            if local.requires_grad:
                raise TypeError(
                    f"params[{name!r}] is complex ({local.dtype}, shape "
                    f"{params[name].global_shape}) and is being differentiated, but its "
                    f"gradient would be reduced over the data axes {self.data_axes} of "
                    f"{format_mesh(self._sizes)}, and the collectives (gloo, NCCL) cannot sum "
                    f"complex tensors. Store it as a real tensor with a trailing dim of 2 "
                    f"(torch.view_as_real) and rebuild it in forward with torch.view_as_complex, "
                    f"or freeze it."
                )


def _check_tp_axis_not_data(
    wrappers: Sequence[tuple[str, ModuleWrapper]], data_axes: Sequence[str]
) -> None:
    """A tensor-parallel axis splits the model, not the batch: it cannot be a data axis.

    ``ff.tensor_parallel`` names its axis ``"tp"`` by default, which the default data axes
    leave out; a TP axis named otherwise needs ``data_axes=tp.data_axes``.
    """
    for path, wrapper in wrappers:
        axis = getattr(wrapper, "axis", None)
        if isinstance(axis, str) and axis in data_axes:
            raise ValueError(
                f"ff.fsdp: wrappers= holds tensor-parallel styles over mesh axis {axis!r} "
                f"(module {path!r}), but the data axes {tuple(data_axes)} include it: the "
                f"batch would be split, and gradients reduced, over the axis that splits the "
                f"model. Pass data_axes=tp.data_axes (tp = ff.tensor_parallel(...)); only the "
                f"axis named 'tp' is left out of the default data axes."
            )


def _check_trainable_dtypes(module: nn.Module, names: Collection[str]) -> None:
    """Integer and bool parameters have no gradients: they cannot be trainable."""
    params = dict(module.named_parameters())
    for name in sorted(names):
        p = params.get(name)
        if p is not None and not (p.dtype.is_floating_point or p.dtype.is_complex):
            raise TypeError(
                f"fsdp(trainable=...) selects {type(module).__name__}.{name} (shape "
                f"{tuple(p.shape)}, {p.dtype}), but integer and bool parameters have no "
                f"gradients and cannot be trained. Leave it out of trainable= (it stays frozen), "
                f"or make it a buffer (module.register_buffer)."
            )


def to_host(params: dict[str, Sharded]) -> dict[str, Sharded]:
    """``params`` with their shards in host memory (pinned when CUDA is present), for
    ``Policy(offload=True)``: their gradients and optimizer state then live there too."""
    pin = torch.cuda.is_available()

    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.to("cpu")
        return t.pin_memory() if pin and not t.is_pinned() else t

    return {k: v.replace(host(v.local)) for k, v in params.items()}


def fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    specs: Specs | None = None,
    units: UnitsArg = None,
    policy: Policy | None = None,
    data_axes: Sequence[str] | None = None,
    wrappers: Sequence[tuple[str, ModuleWrapper]] = (),
    trainable: TrainableArg = None,
    sequence_axis: str | bool | None = True,
) -> FSDP:
    """Describe how to run ``module`` fully sharded over ``mesh``.

    Strategies are spec and policy choices: ``specs=P("dp")`` (the default on a ``dp`` mesh)
    is FSDP/ZeRO-3; add ``Policy(reshard_after_forward=False)`` for FSDP's SHARD_GRAD_OP;
    ``specs=P()`` is DDP, and with ``TrainState.create(..., opt_specs=P("dp"))`` the ZeRO
    paper's ZeRO-1/2; on a ``{"replicate": r, "shard": s}`` mesh the default ``P("shard")``
    is HSDP.

    Args:
        module: any ``nn.Module`` (its parameters may be on ``meta``); it is never modified.
        mesh: a named ``DeviceMesh``.
        specs: the parameter layout at rest: a ``P`` for every parameter, a
            ``{name: P}`` dict, or a rule ``fn(name, tensor) -> P``. Default: dim 0 sharded
            over the data axes (``"replicate"`` excluded), scalars replicated.
        units: which submodules are gathered as one unit (see :func:`find_units`).
        policy: see :class:`Policy`.
        data_axes: the mesh axes that split the batch (default: every axis but ``"tp"``).
        wrappers: ``(module path, wrapper)`` pairs; ``wrapper(module, forward) -> forward``
            is applied to that submodule's per-call copy during :meth:`FSDP.apply`.
        trainable: which parameters :attr:`FSDP.trainable` lists: names, or a predicate on
            the name. Default: those with ``requires_grad=True``.
        sequence_axis: the data axis that splits each sequence (dim 1 of the batch) rather
            than the batch (context parallelism: :mod:`functional_fsdp.cp`). Default:
            ``"cp"`` when the mesh has it; ``None``: none.

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
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"ff.fsdp takes an nn.Module, got {module!r:.60} ({type(module).__name__}): pass "
            f"the model itself, e.g. ff.fsdp(model, mesh)."
        )
    check_mesh(mesh, "ff.fsdp(module, mesh)")
    data_axes = data_axes_of(mesh, data_axes, "ff.fsdp")
    seq_axis = sequence_axis_of(mesh, tuple(data_axes), sequence_axis, "ff.fsdp")
    _check_tp_axis_not_data(wrappers, data_axes)
    check_made_outside(
        itertools.chain(module.named_parameters(), module.named_buffers()),
        mesh,
        "ff.fsdp(module, mesh)",
        "the module's tensor",
    )
    # A quantized base (bitsandbytes 4-bit) is run from a storage copy: packed rows (formats/);
    # apply() first copies the user's module state (train/eval, peft's adapters) to it.
    module = storage_view(module, wrappers)
    if trainable is not None:
        _check_trainable_dtypes(module, trainable_names(module, trainable))
    sharded = FSDP(
        module=module,
        mesh=mesh,
        data_axes=tuple(data_axes),
        units=tuple(find_units(module, units)),
        policy=policy or Policy(),
        specs=specs
        if specs is not None
        else default_specs(mesh, data_axes, (policy or Policy()).secondary_axis),
        wrappers=_check_wrappers(module, wrappers),
        trainable_override=trainable,
        sequence_axis=seq_axis,
    )
    if units is None and not sharded.units:
        _warn_single_unit(sharded)
    return sharded


class SingleUnitWarning(UserWarning):
    """``ff.fsdp``'s default found no units in a large model: the whole model is one unit,
    gathered whole at every step. Name its blocks with ``units=``.

    Example:
        >>> import warnings, torch, functional_fsdp as ff
        >>> with torch.device("meta"):  # two parts of different classes, in no container
        ...     model = torch.nn.Module()
        ...     model.encoder = torch.nn.Linear(4096, 4096)
        ...     model.mixer = torch.nn.TransformerEncoderLayer(4096, 8)
        >>> with ff.simulated_mesh({"dp": 2}) as mesh, warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     _ = ff.fsdp(model, mesh)
        >>> [x.category.__name__ for x in w]
        ['SingleUnitWarning']
    """


# A model smaller than this gathered whole costs little: the default then says nothing.
SINGLE_UNIT_WARN_BYTES = 64 * 1024**2


def _human(n: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _warn_single_unit(sharded: FSDP) -> None:
    """Warn if the default units left a large model as one unit (see SingleUnitWarning)."""
    root = sharded.layout.units.get("")
    if root is None or root.gathered_bytes < SINGLE_UNIT_WARN_BYTES:
        return
    module = sharded.module
    parts = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
    if len(parts) < 2:
        return  # one layer (or one child): nothing to split it into
    names = [n for n, _ in parts]
    shards = 1
    for axis in sharded.data_axes:
        shards *= sharded._sizes[axis]
    warnings.warn(
        f"ff.fsdp: found no units in {type(module).__name__}, so the whole model is one "
        f"unit: every step gathers all of its parameters at once, {_human(root.gathered_bytes)} "
        f"on each rank (the planner's gathered bytes; an unsharded model's memory), where "
        f"its shards at rest are about {_human(root.gathered_bytes // shards)}. The default "
        f"takes the children of nn.ModuleList and nn.Sequential containers and repeated blocks "
        f"(of one class, in an nn.ModuleDict or as attributes); {type(module).__name__} keeps "
        f"none. Name its blocks: ff.fsdp(model, mesh, units=BlockClass), or module paths such "
        f"as units={names[:4]!r} (fnmatch patterns work: 'layers.*').",
        SingleUnitWarning,
        stacklevel=3,
    )


def _check_wrappers(
    module: nn.Module, wrappers: Sequence[tuple[str, ModuleWrapper]]
) -> tuple[tuple[str, ModuleWrapper], ...]:
    modules = dict(module.named_modules())
    for path, _ in wrappers:
        if path not in modules:
            close = fnmatch.filter([p for p in modules if p], f"*{path.rpartition('.')[2]}*")
            raise ValueError(
                f"wrapper for module path {path!r}: {type(module).__name__} has no such submodule "
                f"(paths look like {(close or [p for p in modules if p])[:6]})"
            )
    return tuple(wrappers)


def _mutable_mode(mutable: Any, buffers: Any) -> str | None:
    """``FSDP.apply``'s ``mutable=`` as a mode (``None``: buffers are not state)."""
    if mutable is False:
        return None
    mode = "per_rank" if mutable is True else mutable
    if mode not in ("per_rank", "sync"):
        raise ValueError(
            f"FSDP.apply: mutable={mutable!r}; pass mutable='sync' (BatchNorm statistics over "
            f"the global batch, SyncBatchNorm's), mutable='per_rank' (each rank's own share, "
            f"torch DDP's), or False."
        )
    if not isinstance(buffers, dict):
        raise ValueError(
            f"FSDP.apply(mutable={mutable!r}) needs the buffers it updates: pass "
            f"buffers=dict(module.named_buffers()) (or the buffers a previous call returned); "
            f"got buffers={type(buffers).__name__}."
        )
    return mode
