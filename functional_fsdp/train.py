"""``TrainState`` and a pure ``train_step``.

``train_step(loss_fn, optimizer, model=...)`` returns ``step(state, batch) -> (state, metrics)``
built on ``torch.func.grad_and_value`` or plain autograd (``engine=``, in one place,
:func:`_value_and_grads`). The gradient
rule is :mod:`functional_fsdp.fsdp.gradients`'s: :meth:`FSDP.apply` applies it per unit
(each unit's backward reduce-scatters / all-reduces over the data axes), and
``accumulate_mode="local"`` once per step; ``train_step`` adds the global-batch split,
gradient accumulation, ZeRO-1/2 (with :mod:`functional_fsdp.fsdp.zero`), metrics and
donation. The optimizer gets donation, the gradient norm and finiteness as arguments of its
``update`` (``donate=``, ``grad_norm=``, ``finite=``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import typing
from collections.abc import Callable
from typing import Any, Literal

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from . import rng as random
from ._loss import Outputs, loss_parts, reduce_outputs, to_token_mean
from ._partition import marked_frozen, module_trainable, names_of, partition, trainable_names
from ._tree import NAMESPACE, dotted, keystr, tree_leaves
from .cp.layout import split_sequence
from .distributed import agreement, process
from .distributed.axes import data_axes_of, sequence_axis_of
from .distributed.mesh import axis_sizes, check_mesh, coordinate_of
from .distributed.simulate import check_alive, is_simulated, per_coordinate
from .fsdp import step_inputs
from .fsdp.api import FSDP
from .fsdp.gradients import to_compute_layout
from .fsdp.layout import gather_dtype
from .fsdp.zero import gather_replicas, reduce_to_shards, slice_to_shards
from .ft.replicas import ReplicaGroup
from .grad_engine import Differentiator, Engine
from .optim.clipping import global_norm_and_finite
from .optim.masters import MasterWeightsState, _widens
from .optim.records import metrics_of
from .optim.schedules import Schedule
from .optim.transforms import GradientTransformation, apply_updates, call_update
from .resharding import reshard, resolve_specs
from .sharded import Sharded
from .spec import P, format_mesh

Batch = Any
Metrics = dict[str, float | torch.Tensor]


class DonatedStateError(RuntimeError):
    """A ``TrainState`` was used after ``train_step(donate=True)`` consumed its buffers.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> opt = ff.sgd(0.1)
        >>> step = ff.train_step(lambda p, b: (p["w"] * b).sum(), opt, batch="local", donate=True)
        >>> old = ff.TrainState.create({"w": torch.ones(2)}, opt)
        >>> new, _ = step(old, torch.ones(2))
        >>> old.params
        Traceback (most recent call last):
        ...
        functional_fsdp.train.DonatedStateError: this TrainState was donated to a train_step(donate=True) call at step 0: its buffers now hold the next state (or part of it, if that call raised during the update). Use the state that call returned, or build the step with donate=False to keep old states.
    """


class TrainState:
    """Parameters, optimizer state and step count: a pytree, immutable by convention.

    Attributes:
        params: all parameters, trainable and frozen (a pytree of ``Sharded``, in their
            at-rest layout): what ``loss_fn`` and :meth:`FSDP.apply` take.
        opt_state: the optimizer state, built on the trainable parameters only (for ZeRO-1/2
            laid out by the optimizer specs).
        step: completed optimizer steps (an int, or a 0-dim integer tensor).
        trainable: the dotted names of the trainable leaves of ``params``, or ``None`` when
            all are trainable. Static: part of the pytree structure, not a leaf.
        opt_specs: the optimizer layout given to :meth:`create` (``((dotted name, P), ...)``
            per trainable leaf), or ``None``: the parameters' own. ``train_step`` reads it, so
            it is given once. Static, like ``trainable``.
        rng: the random key (an ``int64[2]`` tensor from :func:`~functional_fsdp.rng_key`) that
            every step's random numbers (dropout) derive from; saved with the state. ``None``:
            the step leaves torch's generator alone (see ``docs/randomness.md``).
        buffers: the module buffers carried as state (``{name: tensor}``, e.g. BatchNorm's
            running statistics), or ``None`` (the default: none). With buffers,
            ``train_step`` calls ``loss_fn(params, batch, buffers)``, which returns
            ``(its usual return value, new_buffers)`` (from :meth:`FSDP.apply` with
            ``mutable=``), threads them through the micro-batches in order and returns the
            last in the new state; checkpoints hold them under ``buffers.<name>`` (see
            ``docs/guides/buffers.md``).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> params = {"w": torch.zeros(2), "lora": torch.zeros(2)}
        >>> state = ff.TrainState.create(params, ff.adam(0.1), trainable={"lora"})
        >>> state.step, sorted(state.trainable), sorted(state.opt_state[0].mu)
        (0, ['lora'], ['lora'])
    """

    __slots__ = (
        "_buffers",
        "_donated_at",
        "_opt_specs",
        "_opt_state",
        "_params",
        "_rng",
        "_step",
        "_trainable",
    )

    def __init__(
        self,
        params: Any,
        opt_state: Any,
        step: int = 0,
        trainable: frozenset[str] | None = None,
        opt_specs: tuple[tuple[str, P], ...] | None = None,
        rng: torch.Tensor | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self._params, self._opt_state, self._step = params, opt_state, step
        self._rng = rng
        self._buffers = buffers
        self._trainable = None if trainable is None else frozenset(trainable)
        self._opt_specs = opt_specs
        self._donated_at: int | None = None

    @staticmethod
    def create(
        params: Any,
        optimizer: GradientTransformation,
        *,
        trainable: Any = None,
        opt_specs: Any = None,
        rng: int | torch.Tensor | None = 0,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> TrainState:
        """A fresh state at step 0, with optimizer state for the trainable parameters only.

        Args:
            params: all parameters (trainable and frozen), in their at-rest layout.
            optimizer: initialised on the trainable part of ``params`` (or on its
                ``opt_specs`` layout). Under :func:`~functional_fsdp.master_weights` it gets
                the parameters as given (fp32 masters start exact) and the state keeps the
                trainable ones in the wrapper's ``param_dtype``.
            trainable: which parameters train (see :func:`functional_fsdp.partition`): pass
                the ``FSDP`` description (or the module) to train the parameters with
                ``requires_grad=True``; or dotted names, a predicate ``fn(path, leaf)``, a
                tree of bools. ``None``: all of them.
            opt_specs: for ZeRO-1/2, the optimizer-state layout, e.g. ``P("dp")`` with
                replicated ``P()`` params: gradients are reduce-scattered to it, the optimizer
                steps its shard, and the updated parameters are all-gathered (2Ψ per step,
                as DDP). Given here only: :func:`train_step` reads it from the state.
            rng: the seed (an int) or key (:func:`~functional_fsdp.rng_key`) of the run's
                randomness: every step's dropout masks derive from it, the step count and
                the data-parallel rank. ``None``: no key; steps draw from torch's global
                generator as the caller left it.
            buffers: the buffers carried as state (e.g. ``dict(module.named_buffers())``,
                or the ones ``init_sharded`` returns); ``None``: none. Never written.

        Raises:
            ValueError: if ``trainable`` names a parameter ``params`` lacks, or selects none.
            TypeError: if a trainable leaf is an integer or bool tensor (no gradients).

        Example:
            >>> import torch, functional_fsdp as ff
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
            >>> _ = model[0].requires_grad_(False)
            >>> params = {n: p.detach() for n, p in model.named_parameters()}
            >>> state = ff.TrainState.create(params, ff.adamw(1e-3), trainable=model)
            >>> sorted(state.trainable)
            ['1.bias', '1.weight']
        """
        _check_optimizer(optimizer, "TrainState.create")
        names = None
        if trainable is None:
            _refuse_frozen("TrainState.create", marked_frozen(params), "shards")
        else:
            names = trainable_names(params, trainable, "TrainState.create")
            if not names:
                raise ValueError(
                    f"TrainState.create: trainable={_short_repr(trainable)} selects none of the "
                    f"{len(names_of(params))} parameters, so there is nothing to train. Check "
                    f"the names or predicate, or which parameters have requires_grad=True."
                )
        train = params if names is None else partition(params, names)[0]
        paths, leaves, _ = optree.tree_flatten_with_path(train)
        _check_differentiable(paths, leaves, "TrainState.create", names is None)
        layout = None
        if opt_specs is not None:
            train = reshard(train, restrict_specs(opt_specs, train))
            layout = _layout_of(train)
        opt_state = optimizer.init(train)
        if isinstance(opt_state, MasterWeightsState):  # the trainable params in its dtype
            split = _Split(params, names)
            params = split.full([_cast(x, opt_state.param_dtype) for x in split.train_leaves])
        if buffers is not None and not (
            isinstance(buffers, dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in buffers.items())
        ):
            raise TypeError(
                f"TrainState.create: buffers must be a dict {{name: tensor}} (e.g. "
                f"dict(module.named_buffers())), or None; got {_short_repr(buffers)}."
            )
        return TrainState(
            params, opt_state, 0, names, opt_specs=layout, rng=_as_key(rng), buffers=buffers
        )

    @property
    def opt_specs(self) -> tuple[tuple[str, P], ...] | None:
        return self._opt_specs

    def _alive(self) -> None:
        if self._donated_at is not None:
            at = self._donated_at
            raise DonatedStateError(
                f"this TrainState was donated to a train_step(donate=True) call at step "
                f"{int(at) if isinstance(at, torch.Tensor) else at}: its buffers now hold the next state (or part of it, if "
                f"that call raised during the update). Use the state that call returned, or "
                f"build the step with donate=False to keep old states."
            )

    @property
    def params(self) -> Any:
        self._alive()
        return self._params

    @property
    def opt_state(self) -> Any:
        self._alive()
        return self._opt_state

    @property
    def step(self) -> int:
        self._alive()
        return self._step

    @property
    def trainable(self) -> frozenset[str] | None:
        return self._trainable

    @property
    def rng(self) -> torch.Tensor | None:
        self._alive()
        return self._rng

    @property
    def buffers(self) -> dict[str, torch.Tensor] | None:
        self._alive()
        return self._buffers

    def __repr__(self) -> str:
        if self._donated_at is not None:
            at = self._donated_at
            return (
                f"TrainState(<donated at step {int(at) if isinstance(at, torch.Tensor) else at}>)"
            )
        n = sum(
            leaf.numel() for leaf in tree_leaves(self._params) if isinstance(leaf, torch.Tensor)
        )
        split = "" if self._trainable is None else f", trainable leaves={len(self._trainable)}"
        return f"TrainState(step={self._step}, local parameter elements={n}{split})"


def _check_differentiable(
    paths: list[tuple[Any, ...]], leaves: list[Any], where: str, all_leaves: bool
) -> None:
    """Trainable leaves must be floating-point or complex tensors: only those have gradients."""
    for path, leaf in zip(paths, leaves):
        dtype = getattr(leaf, "dtype", None)
        if isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex):
            told = "every leaf trains (no trainable= was given)" if all_leaves else "it trains"
            raise TypeError(
                f"{where}: params{keystr(path)} is {str(dtype).removeprefix('torch.')} (shape "
                f"{tuple(leaf.shape)}) and {told}, but integer and bool tensors have no "
                f"gradients and cannot be trained. Leave it out with trainable=: "
                f"ff.TrainState.create(params, optimizer, trainable=sharded_model) trains the "
                f"module's requires_grad=True parameters, trainable=lambda path, p: "
                f"p.dtype.is_floating_point the floating ones; or keep it as a buffer "
                f"(module.register_buffer) instead of a parameter."
            )


def _check_optimizer(optimizer: Any, where: str) -> None:
    """An optimizer here is a pure GradientTransformation, not a torch.optim one."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    name = optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__
    torch_optim = isinstance(optimizer, torch.optim.Optimizer) or (
        isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
    )
    hint = (
        f"torch.optim.{name} holds its own state and updates parameters in place; use its "
        f"pure counterpart, e.g. ff.adamw(3e-4, weight_decay=0.01) (torch.optim.AdamW's "
        f"default decay; ff.adamw's is optax's, 1e-4) or ff.sgd(0.1, momentum=0.9)"
        if torch_optim
        else "e.g. ff.adamw(3e-4), or ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(3e-4))"
    )
    raise TypeError(
        f"{where}: optimizer must be a GradientTransformation (a pair of pure functions init, "
        f"update), got {name}: {hint}."
    )


def _refuse_frozen(where: str, frozen: list[str], seen_in: Literal["shards", "module"]) -> None:
    """The rule: a state created without ``trainable=`` trains every parameter, so frozen
    ones (``requires_grad=False`` in the module, :func:`module_trainable`) are refused unless
    ``trainable=`` says so. Checked where it is first known: at ``TrainState.create`` from
    the shards the library made for the module (``mark_frozen``), at the step from the
    module itself."""
    if not frozen:
        return
    more = f" and {len(frozen) - 1} more" if len(frozen) > 1 else ""
    if seen_in == "shards":
        what = (
            f"params[{frozen[0]!r}]{more} {'are' if more else 'is'} the shard"
            f"{'s' if more else ''} of frozen parameters (requires_grad=False) of the module "
            f"ff.fsdp sharded, but trainable= was not given"
        )
    else:
        what = (
            f"the module has frozen parameters (requires_grad=False), e.g. {frozen[0]!r}{more}, "
            f"but the TrainState was created without trainable="
        )
    raise ValueError(
        f"{where}: {what}, so they would get gradients, optimizer state and updates. Create "
        f"the state with ff.TrainState.create(params, optimizer, trainable=sharded_model) to "
        f"keep them frozen (or trainable=lambda path, p: True to train every parameter on "
        f"purpose)."
    )


def _as_key(rng: int | torch.Tensor | None) -> torch.Tensor | None:
    """``TrainState.create(rng=...)``: a key from a seed; a key as it is (checked)."""
    if rng is None or isinstance(rng, torch.Tensor):
        if rng is not None:
            random.key_bits(rng, "TrainState.create(rng=...)")
        return rng
    if isinstance(rng, bool) or not isinstance(rng, int):
        raise TypeError(
            f"TrainState.create: rng must be an int seed, a key from ff.rng_key(seed), or "
            f"None, got {type(rng).__name__} {_short_repr(rng)}."
        )
    return random.rng_key(rng)


def _short_repr(x: Any, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Sharded) and x.dtype.is_floating_point:
        return x.replace(x.local.to(dtype))
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _layout_of(tree: Any) -> tuple[tuple[str, P], ...]:
    """``((dotted name, spec), ...)`` of the ``Sharded`` leaves of ``tree``, in leaf order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return tuple(
        (dotted(p), v.spec if isinstance(v, Sharded) else P()) for p, v in zip(paths, leaves)
    )


def restrict_specs(specs: Any, tree: Any) -> Any:
    """``specs`` without the dict keys that ``tree`` lacks (specs written for all params)."""
    if isinstance(specs, dict) and isinstance(tree, dict):
        return {k: restrict_specs(specs[k], v) for k, v in tree.items() if k in specs}
    return specs


def _flatten_state(
    s: TrainState,
) -> tuple[tuple[Any, ...], tuple[Any, Any], tuple[str, ...]]:
    s._alive()
    # A state without buffers has no "buffers" child at all: its checkpoint keys are those of
    # a state written before buffers could be carried, so old checkpoints still load.
    children: tuple[Any, ...] = (s._params, s._opt_state, s._step, s._rng)
    names: tuple[str, ...] = ("params", "opt_state", "step", "rng")
    if s._buffers is not None:
        children, names = (*children, s._buffers), (*names, "buffers")
    static = (s._trainable, s._opt_specs)
    return children, static, names


optree.register_pytree_node(
    TrainState,
    _flatten_state,
    lambda static, children: TrainState(
        *children[:3],
        trainable=static[0],
        opt_specs=static[1],
        rng=children[3],
        buffers=children[4] if len(children) > 4 else None,
    ),
    namespace=NAMESPACE,
)


# --------------------------------------------------------------------------- batches


def _examples(n: int) -> str:
    return f"{n} example{'' if n == 1 else 's'}"


def _check_not_empty(batch: Batch, where: str = "train_step") -> None:
    """Raise unless every tensor of ``batch`` (with a batch dim) holds at least one example."""
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    for path, t in zip(paths, leaves):
        if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == 0:
            raise ValueError(
                f"{where}: the batch is empty: batch{keystr(path)} has 0 examples (shape "
                f"{tuple(t.shape)}), and the mean loss of no examples is not a number. Skip "
                f"the step when the data runs out (drop_last=True in a DataLoader drops a "
                f"short last batch), or pass at least one example per rank."
            )


def split_batch(
    batch: Batch, parts: int, where: str = "train_step", whose: str = "the batch"
) -> list[Batch]:
    """Split every tensor of ``batch`` into ``parts`` equal chunks along dim 0.

    ``whose`` says which batch this is in errors (e.g. this rank's share of a global batch).
    """
    leaves, treedef = optree.tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.ndim}
    for size in sizes:
        if size % parts:
            raise ValueError(
                f"{where}: {whose} holds {_examples(size)}, which does not split into "
                f"{parts} equal micro-batches (accumulate={parts}); make it a multiple of "
                f"{parts}."
            )
    chunks = [t.chunk(parts) if isinstance(t, torch.Tensor) else [t] * parts for t in leaves]
    return [optree.tree_unflatten(treedef, [c[i] for c in chunks]) for i in range(parts)]


def local_batch(
    batch: Batch,
    mesh: Any,
    data_axes: str | tuple[str, ...] | None = None,
    *,
    sequence_axis: str | bool | None = True,
    where: str = "ff.local_batch",
) -> Batch:
    """This rank's share (along dim 0) of a global batch that every rank holds.

    Use it wherever your own code needs this rank's examples (a ``torch.func`` loop of your
    own, an evaluation): it is right under ``torchrun`` (a view of this rank's rows) and on a
    simulated mesh, where each simulated rank gets its own rows (a per-rank tensor). Code
    such as ``batch.chunk(n)[torch.distributed.get_rank()]`` is right only on real processes:
    on a simulated mesh one process is every rank. ``train_step(..., batch="global")`` (the
    default) takes the same share itself.

    Data ranks are numbered row-major over ``data_axes``; ranks that differ only in model
    axes (tp) get the same share. An axis that splits the sequence (context parallelism,
    ``"cp"``) splits dim 1 of every tensor of 2 or more dims instead, into its two
    load-balanced chunks per rank (:func:`functional_fsdp.cp.chunk_layout`); the other
    data axes split dim 0.

    Args:
        batch: a tensor or a pytree of tensors, the same global batch on every rank; every
            tensor is split along dim 0 (other leaves are kept as they are).
        mesh: the mesh, or the ``FSDP`` model (``ff.fsdp(...)``), whose mesh and
            ``data_axes`` are then used.
        data_axes: the mesh axes that split the batch (default: the model's, or every axis
            of the mesh but ``"tp"``).
        sequence_axis: the data axis that splits the sequence (default: the model's, or
            ``"cp"`` where it is a data axis; ``None``: none).
        where: the name that errors start with.

    Returns:
        A tree like ``batch`` holding this rank's ``batch_size / n_data_ranks`` examples.

    Raises:
        ValueError: if the batch does not divide across the data-parallel ranks, or an axis
            is not one of the mesh's.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     share = ff.local_batch(torch.arange(4), mesh)
        ...     [t.tolist() for t in ff.rank_values(share)]
        [[0, 1], [2, 3]]
    """
    if isinstance(mesh, FSDP):
        model = mesh
        mesh = model.mesh
        if data_axes is None:
            data_axes = model.data_axes
        if sequence_axis is True:
            sequence_axis = model.sequence_axis
    check_mesh(mesh, where)
    data_axes = data_axes_of(
        mesh,
        data_axes,
        where,
        hint=", or pass the FSDP model itself (ff.local_batch(batch, sharded_model))",
    )
    seq_axis = sequence_axis_of(mesh, data_axes, sequence_axis, where)
    if seq_axis is not None:
        batch = _split_sequences(batch, mesh, seq_axis)
        data_axes = tuple(a for a in data_axes if a != seq_axis)
    sizes = axis_sizes(mesh)
    n = math.prod(sizes[a] for a in data_axes)
    leaves, treedef = optree.tree_flatten(batch)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] % n:
            local = ", or pass each rank's own batch with train_step(..., batch='local')"
            raise ValueError(
                f"{where}: a global batch of {_examples(t.shape[0])} (shape {tuple(t.shape)}) "
                f"does not divide across the {n} data-parallel ranks of {format_mesh(sizes)} "
                f"(data axes {data_axes}); use a multiple of {n}"
                f"{local if where == 'train_step' else ''}."
            )
    if n == 1:
        return batch

    def rank_of(coord: dict[str, int]) -> int:
        rank = 0
        for a in data_axes:
            rank = rank * sizes[a] + coord[a]
        return rank

    def share(t: torch.Tensor) -> torch.Tensor:
        per = t.shape[0] // n
        if not is_simulated():  # a view of this rank's rows: no index tensor, no copy
            return t.narrow(0, rank_of(coordinate_of(mesh, process.rank())) * per, per)
        # Simulated ranks differ in their rows: one index_select with per-rank indices,
        # built on the batch's device.
        index = per_coordinate(
            mesh, lambda c: torch.arange(rank_of(c) * per, (rank_of(c) + 1) * per, device=t.device)
        )
        return t.index_select(0, index)

    out = [share(t) if isinstance(t, torch.Tensor) and t.ndim else t for t in leaves]
    return optree.tree_unflatten(treedef, out)


def _split_sequences(batch: Batch, mesh: DeviceMesh, axis: str) -> Batch:
    """Each tensor of 2 or more dims cut to this rank's chunks of dim 1 (the sequence)."""
    if axis_sizes(mesh)[axis] == 1:
        return batch
    paths, leaves, treedef = optree.tree_flatten_with_path(batch)
    out = [
        split_sequence(t, mesh, axis, f"batch{keystr(p) if p else ''}")
        if isinstance(t, torch.Tensor) and t.ndim >= 2
        else t
        for p, t in zip(paths, leaves)
    ]
    return optree.tree_unflatten(treedef, out)


def _check_same_global_batch(data: Batch, mesh: DeviceMesh) -> None:
    """Raise unless every rank passed the same global batch (one small all-gather per axis)."""
    if is_simulated() or torch.compiler.is_compiling():
        return  # one program: the same batch on every simulated rank
    if all(n == 1 for n in axis_sizes(mesh).values()):
        return
    paths, leaves, _ = optree.tree_flatten_with_path(data)
    named = [
        (f"batch{keystr(p) if p else ''}", t, "")
        for p, t in zip(paths, leaves)
        if isinstance(t, torch.Tensor)
    ]
    if any(t.is_meta for _, t, _ in named):
        return  # a shapes-only simulation: no values to compare
    per_rank = agreement.differences(mesh, named, "train_step")
    if per_rank is None:
        return
    first, _ = agreement.first_difference(per_rank)
    if first is None:
        rows = {r: f"{len(t)} tensors" for r, t in per_rank.items()}
        what = "the batch"
    else:
        what = next(iter(per_rank.values()))[first][0]
        rows = {
            r: f"shape {t[first][1]}, torch.{t[first][2]}, checksum {agreement.short(t[first][4])}"
            for r, t in per_rank.items()
        }
    raise ValueError(
        f"train_step(batch='global'): {what} differs between the ranks of "
        f"{format_mesh(axis_sizes(mesh))}:\n{agreement.by_rank(rows)}\nWith batch='global' "
        f"every rank passes the same global batch and keeps its own share of dim 0, so the "
        f"other shares of each rank's batch would be dropped. If each rank loads its own "
        f"data, pass train_step(..., batch='local'); otherwise load the same batches on every "
        f"rank (the same seed and order)."
    )


def _share_description(data: Batch, model: FSDP) -> str:
    """Names this rank's share of a global batch in errors: which batch was counted."""
    sizes = axis_sizes(model.mesh)
    n = math.prod(sizes[a] for a in model.data_axes)
    first = next(
        (t for t in optree.tree_leaves(data) if isinstance(t, torch.Tensor) and t.ndim), None
    )
    total = f"{_examples(first.shape[0])}" if first is not None else "the batch"
    return (
        f"this rank's share of the global batch ({total} over the {n} data-parallel ranks "
        f"of {format_mesh(sizes)}, data axes {model.data_axes})"
    )


# --------------------------------------------------------------------------- the step


class _Split:
    """``params`` as its trainable leaves (in the order of ``partition``'s trainable tree)
    and a way to put them back among the frozen ones, keeping ``params``' exact structure."""

    def __init__(self, params: Any, names: frozenset[str] | None) -> None:
        self.paths, self.leaves, self.treedef = optree.tree_flatten_with_path(params)
        paths = self.paths
        if names is None:
            self.train, self.index = params, list(range(len(self.leaves)))
            self.train_def = self.treedef
        else:
            self.train = partition(params, names)[0]
            train_paths, _, self.train_def = optree.tree_flatten_with_path(self.train)
            position = {p: i for i, p in enumerate(paths)}
            self.index = [position[p] for p in train_paths]
        self.train_leaves = [self.leaves[i] for i in self.index]
        trained = set(self.index)
        self.frozen_index = [i for i in range(len(self.leaves)) if i not in trained]

    def full(self, train_leaves: list[Any], base: list[Any] | None = None) -> Any:
        """``params`` with the trainable leaves replaced (frozen ones from ``base``)."""
        out = list(self.leaves if base is None else base)
        for i, x in zip(self.index, train_leaves):
            out[i] = x
        return self.treedef.unflatten(out)


def _frozen_module_params(model: FSDP) -> list[str]:
    trainable = module_trainable(model)
    module = getattr(model, "module", None)
    if trainable is None or not isinstance(module, torch.nn.Module):
        return []
    return [n for n, _ in module.named_parameters() if n not in trainable]


def _check_all_trainable(model: FSDP, params: Any) -> None:
    """The default path must not train a module's frozen parameters without being told."""
    frozen = _frozen_module_params(model)
    if frozen:
        present = set(names_of(params))
        _refuse_frozen("train_step", [n for n in frozen if n in present], "module")


def train_step(
    loss_fn: Callable[[Any, Batch], Any],
    optimizer: GradientTransformation,
    *,
    model: FSDP | None = None,
    batch: Literal["global", "local"] = "global",
    accumulate: int = 1,
    accumulate_mode: Literal["reduce_each", "local"] = "reduce_each",
    opt_specs: Any = None,
    learning_rate: float | Schedule | None = None,
    donate: bool = False,
    randomness: Literal["per_rank", "global_batch"] = "per_rank",
    engine: Engine = "auto",
    has_aux: bool = False,
    replicas: ReplicaGroup | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build a pure ``step(state, batch) -> (new_state, metrics)``.

    Only the state's trainable parameters (``TrainState.create(..., trainable=...)``) are
    differentiated, clipped, counted in ``grad_norm`` and updated; frozen ones get no
    gradient and no reduce-scatter, and come back as the same tensor objects. With
    ``model=`` given, a state created without ``trainable=`` for a module that has
    ``requires_grad=False`` parameters raises instead of training them.

    Failures. An exception inside a step (from ``loss_fn``, a bad batch, a collective)
    leaves the input state intact and usable. With ``donate=True`` the input state is marked
    dead just before the update writes into it, so an exception during the update (a
    learning-rate schedule runs there, inside the optimizer) makes its reuse raise
    :class:`DonatedStateError` rather than hand back half an update. To skip steps whose loss or gradients are not finite, wrap the optimizer in
    :func:`~functional_fsdp.apply_if_finite`: the step passes it ``finite=`` (no extra
    collective) and the decision stays on the device. An optimizer that is a
    :class:`~functional_fsdp.GradientTransformationExtraArgs` (every built-in one) also gets
    ``donate=`` and ``grad_norm=`` (the step's gradient norm, which
    :func:`~functional_fsdp.clip_by_global_norm` then uses instead of all-reducing another).

    Args:
        loss_fn: ``loss_fn(params, batch)``, running the model with :meth:`FSDP.apply`
            (which reduces gradients over the data axes), returns either

            * a scalar, the mean loss of its batch: the step's loss and gradient are the
              mean over data-parallel ranks and micro-batches of ``loss_fn``'s, as DDP and
              FSDP2 give; the global batch's mean when every share counts the same number
              of items;
            * or a pair ``(sum, count)`` (or a :class:`SumCount`), e.g. the summed cross
              entropy of the tokens whose label is not -100 and their number: the step's
              loss and gradient are then the sum over every data-parallel rank and
              micro-batch divided by the total count, which is the token mean one process
              computes on the global batch (Hugging Face Trainer's default,
              ``average_tokens_across_devices=True``), however unevenly the tokens fall
              into shares. ``metrics["count"]`` is the total. It costs no extra collective:
              the count rides in the all-reduce that averages the loss.

        optimizer: a :class:`GradientTransformation`, e.g. ``chain(clip_by_global_norm(1.0),
            adamw(3e-4))``.
        model: the :class:`FSDP` description (mesh, data axes, policy). Needed for
            ``batch="global"``, ``accumulate_mode="local"`` and metrics over the mesh.
        batch: ``"global"``: every rank passes the same global batch and keeps its share of
            dim 0 (the loss is then the global-batch mean; the step's first call checks that
            the ranks' batches agree, and raises if not); ``"local"``: each rank passes its
            own share.
        accumulate: split this rank's batch into this many micro-batches.
        accumulate_mode: ``"reduce_each"`` runs the sharded step per micro-batch and adds the
            reduce-scattered gradients (least memory: only shard-sized gradients; ZeRO-2 with
            a ZeRO state); ``"local"`` (ZeRO-1 with a ZeRO state)
            gathers the parameters once, adds full-size gradients locally and reduces once
            per step (least communication: one reduce-scatter instead of ``accumulate``, but
            full parameters and gradients stay in memory for the step).
        opt_specs: not needed: the state knows its optimizer layout
            (``TrainState.create(..., opt_specs=P("dp"))``, ZeRO-1/2). If given, it must agree
            with the state's, else ``ValueError``. With a state whose parameters are replicated
            over the data axes and whose optimizer layout shards them, the step is ZeRO-2
            (``accumulate_mode="reduce_each"``: each unit's gradients reduce-scattered to the
            optimizer shards during the backward) or ZeRO-1 (``"local"``: full gradients,
            reduce-scattered once), then one all-gather of the updated parameters: DDP's bytes.
        learning_rate: the schedule (or constant) to report as ``metrics["lr"]``. ``None``:
            the rate the optimizer's new state records for this update (see
            :func:`~functional_fsdp.learning_rate_of`), so a schedule is given once, to the
            optimizer.
        donate: update the state's tensors in place; the input state is dead afterwards and
            using it raises :class:`DonatedStateError`. Lowers peak memory. Frozen
            parameters are never written: the new state shares them.
        randomness: how the state's key (``TrainState.rng``) becomes random numbers (see
            ``docs/randomness.md``). ``"per_rank"``: each data-parallel rank draws its own
            stream (tensor-parallel ranks share it). ``"global_batch"``: every random op
            draws for the whole global batch (dim 0) and each rank keeps its rows, so a
            run draws the masks one process draws on the global batch, whatever the number
            of data ranks, at the price of drawing the global batch's random numbers on
            every rank. Real processes, data-parallel meshes and ``accumulate=1`` only.
        engine: what computes the gradients; the step is pure and its numbers the same
            with each. ``"func"``: ``torch.func.grad_and_value``, so the step itself can be
            transformed (``vmap``, ``jvp``, ``grad`` of a step). ``"autograd"``: plain
            autograd over leaf copies of the trainable shards, for model code ``torch.func``
            cannot transform (custom ``autograd.Function``\\ s without ``setup_context``, as
            in Bloom; ``requires_grad_()`` in the forward, as the hooks of Hugging Face's
            ``enable_input_require_grads`` and peft's ``prepare_model_for_kbit_training``;
            Hugging Face gradient checkpointing); the step then cannot be transformed by
            ``torch.func``. ``"auto"`` (default): autograd if the module shows a reason
            (a forward hook calling ``requires_grad_``, gradient checkpointing enabled on a
            module in training mode), else ``torch.func``, falling back to autograd for good
            when ``torch.func`` raises on code it cannot transform (the failed attempt's
            forward is wasted once); either way it warns once
            (:class:`~functional_fsdp.grad_engine.AutogradFallbackWarning`).
        has_aux: ``loss_fn`` returns ``(loss, aux)``, ``loss`` as above and ``aux`` a pytree
            of tensors (JAX's ``has_aux``), returned as ``metrics["aux"]``, reduced over the
            data ranks and micro-batches in the same all-reduce as the loss: a
            :class:`SumCount` leaf becomes its global sum over its global count (as a
            ``(sum, count)`` loss); any other tensor is averaged over ranks and
            micro-batches (as a scalar loss), returned in its shape, in its dtype if
            floating, else in float32.

    Returns:
        ``step(state, batch)``. Its metrics hold ``loss`` (the global-batch mean, with
        ``model=``), ``count`` (for a ``(sum, count)`` loss: the total count), ``aux``
        (with ``has_aux``), ``grad_norm`` (global, mesh-aware), ``lr`` (the rate of this update;
        ``nan`` if unknown) and ``finite`` (whether the loss and every gradient element are
        finite); with
        :func:`~functional_fsdp.apply_if_finite` also ``skipped`` (this update was skipped)
        and ``nonfinite_steps`` (so far). ``lr``, ``skipped`` and ``nonfinite_steps`` are
        what the new optimizer state records (``optim/records.py``: a state class lists
        them in ``METRICS``; a skipped update keeps the previous record, so its ``lr`` is the
        rate of the last update applied). Values are tensors on the device, never read back
        (no host sync); on a simulated mesh, where they are the same on every rank, they are
        plain tensors that format as numbers (``f"{metrics['loss']:.3f}"``).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Linear(4, 1)
        >>> _ = model.bias.requires_grad_(False)  # frozen: no gradient, no optimizer state
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sharded_model = ff.fsdp(model, mesh)
        ...     loss_fn = lambda p, b: (sharded_model.apply(p, b[0]) - b[1]).pow(2).mean()
        ...     opt = ff.adamw(0.1)
        ...     step = ff.train_step(loss_fn, opt, model=sharded_model)
        ...     params = sharded_model.shard()
        ...     state = ff.TrainState.create(params, opt, trainable=sharded_model)
        ...     state, metrics = step(state, (torch.randn(8, 4), torch.randn(8, 1)))
        ...     state.step, sorted(state.trainable), state.params["bias"] is params["bias"]
        (1, ['weight'], True)
    """
    if not callable(loss_fn):
        raise TypeError(
            f"train_step: loss_fn must be a function loss_fn(params, batch) -> scalar tensor, "
            f"got {_short_repr(loss_fn)} ({type(loss_fn).__name__})."
        )
    _check_optimizer(optimizer, "train_step")
    if model is not None and not isinstance(model, FSDP):
        raise TypeError(
            f"train_step: model= takes the FSDP description that ff.fsdp(module, mesh) returns "
            f"(it knows the mesh and the data axes), got {type(model).__name__}; write "
            f"sharded_model = ff.fsdp(model, mesh) and pass model=sharded_model."
        )
    if isinstance(accumulate, bool) or not isinstance(accumulate, int):
        raise TypeError(
            f"train_step: accumulate must be an int (the number of micro-batches), got "
            f"{accumulate!r}."
        )
    if accumulate < 1:
        raise ValueError(
            f"train_step: accumulate must be >= 1, got {accumulate}. It is the number of "
            f"micro-batches each rank's batch is split into: accumulate=1 (the default) "
            f"computes the step on the whole batch at once; accumulate=k > 1 splits it into k."
        )
    if accumulate_mode not in ("reduce_each", "local"):
        raise ValueError(
            f"train_step: accumulate_mode must be 'reduce_each' or 'local', got {accumulate_mode!r}"
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"train_step: has_aux must be True or False, got {has_aux!r}.")
    if randomness not in ("per_rank", "global_batch"):
        raise ValueError(
            f"train_step: randomness must be 'per_rank' or 'global_batch', got {randomness!r}."
        )
    if randomness == "global_batch":
        _check_global_batch_randomness(model, accumulate)
    if replicas is not None and not isinstance(replicas, ReplicaGroup):
        raise TypeError(
            f"train_step: replicas= takes an ff.ft.ReplicaGroup (this process's group in a "
            f"fault-tolerant job), got {_short_repr(replicas)}."
        )
    if (batch == "global" or accumulate_mode == "local") and model is None:
        raise ValueError(
            "train_step: pass model=ff.fsdp(...) so the step knows the mesh and data axes "
            "(needed for batch='global' and accumulate_mode='local')."
        )
    cfg = _Config(
        loss_fn=loss_fn,
        optimizer=optimizer,
        model=model,
        batch=batch,
        accumulate=accumulate,
        accumulate_mode=accumulate_mode,
        opt_specs=opt_specs,
        learning_rate=learning_rate,
        donate=donate,
        randomness=randomness,
        has_aux=has_aux,
        differentiate=Differentiator(engine, None if model is None else model.module),
        replicas=replicas,
    )
    checked_batch: list[bool] = []  # whether a call compared the ranks' global batches

    def step(state: TrainState, data: Batch) -> tuple[TrainState, Metrics]:
        return _step(cfg, checked_batch, state, data)

    return step


@dataclasses.dataclass(frozen=True)
class _Config:
    """The arguments of one ``train_step``, checked: what each of its steps reads."""

    loss_fn: Callable[[Any, Batch], Any]
    optimizer: GradientTransformation
    model: FSDP | None
    batch: str
    accumulate: int
    accumulate_mode: str
    opt_specs: Any
    learning_rate: float | Schedule | None
    donate: bool
    randomness: str
    has_aux: bool
    differentiate: Differentiator  # remembers the engine "auto" chose
    replicas: ReplicaGroup | None = None  # fault-tolerant replica groups (torchft)

    def loss(self, params: Any, batch: Batch) -> tuple[torch.Tensor, tuple[Any, Any, Any]]:
        """``loss_fn(params, batch)`` as ``(value to differentiate, (count, aux, buffers))``:
        all tensors, as ``torch.func``'s ``has_aux`` takes them (``()`` for none). A
        :class:`_WithBuffers` batch calls ``loss_fn(params, batch, buffers)``, which returns
        its value and the new buffers."""
        new_buffers: Any = ()
        if isinstance(batch, _WithBuffers):
            out = self.loss_fn(params, batch.batch, batch.buffers)  # type: ignore[call-arg]
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
                raise TypeError(
                    f"train_step: the state carries buffers, so loss_fn(params, batch, buffers) "
                    f"must return (loss, new_buffers), new_buffers the dict that "
                    f"sharded_model.apply(params, ..., buffers=buffers, mutable=...) returns; "
                    f"got {_short_repr(out)}."
                )
            out, new_buffers = out
            if new_buffers.keys() != batch.buffers.keys():
                raise ValueError(
                    f"train_step: loss_fn returned buffers with keys "
                    f"{sorted(new_buffers)[:5]}, but the state carries "
                    f"{sorted(batch.buffers)[:5]}; return every buffer the state carries."
                )
        else:
            out = self.loss_fn(params, batch)
        value, count, aux = loss_parts(out, self.has_aux)
        as_tensors = functools.partial(
            optree.tree_map,
            lambda x: x if isinstance(x, torch.Tensor) else torch.as_tensor(x),
            namespace=NAMESPACE,
        )
        return value, (
            () if count is None else as_tensors(count),
            () if aux is None else as_tensors(aux),
            new_buffers,
        )

    def stream(self, key: torch.Tensor | None) -> Callable[[int], Any]:
        """Micro-batch ``i``'s random stream, from this step's key."""
        return lambda i: _micro_batch_stream(key, i, self.model, self.randomness)


class _WithBuffers(typing.NamedTuple):
    """A micro-batch and the buffers its ``loss_fn`` call starts from."""

    batch: Batch
    buffers: dict[str, torch.Tensor]


class _PathResult(typing.NamedTuple):
    """What a step path (:func:`_fsdp_path`, :func:`_zero_path`) hands the shared update."""

    train: Any  # the trainable values the optimizer updates (its layout)
    grads: Any  # their gradients, reduced over the data axes, in the same layout
    outputs: Outputs  # loss_fn's, summed over this rank's micro-batches
    restore: Callable[[Any], Any]  # updated values -> the parameters' at-rest layout
    in_place: bool  # whether donation may write the update into ``train``
    buffers: Any = None  # the buffers after the last micro-batch (None: the state has none)


def _step(cfg: _Config, checked_batch: list[bool], state: TrainState, data: Batch) -> Any:
    """One step: this rank's share and micro-batches, the gradients by the path the state's
    layout asks for (:func:`_fsdp_path` or :func:`_zero_path`), then the shared update."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"step(state, batch) takes a TrainState, got {type(state).__name__}; make one "
            f"with ff.TrainState.create(params, optimizer, trainable=...) and pass the "
            f"state each step returns to the next."
        )
    model = cfg.model
    if model is not None:
        check_alive(model.mesh, "train_step")
    if cfg.replicas is not None:  # this step's quorum; a joining group's state first
        state = cfg.replicas.begin(state)
    params, count = state.params, state.step
    base_key = state.rng
    if model is not None and state.trainable is None:
        _check_all_trainable(model, params)
    _check_not_empty(data)
    whose = "this rank's batch (batch='local')"
    local = data
    if cfg.batch == "global" and model is not None:
        if not checked_batch:  # the first call: a step that loads per-rank data
            _check_same_global_batch(data, model.mesh)
            checked_batch.append(True)
        local = local_batch(
            data,
            model.mesh,
            model.data_axes,
            sequence_axis=model.sequence_axis,
            where="train_step",
        )
        whose = _share_description(data, model)
    split = _Split(params, state.trainable)
    _check_differentiable(
        [split.paths[i] for i in split.index],
        split.train_leaves,
        "train_step",
        state.trainable is None,
    )
    layout = _opt_layout(state, split, cfg.opt_specs)
    # Traced by ff.jit, the key has no value to seed a generator with; a traced step
    # that draws random numbers is refused there.
    traced = base_key is None or random.traced(base_key)
    key = None if traced else random.fold_in(base_key, int(count))
    micro = split_batch(local, cfg.accumulate, whose=whose) if cfg.accumulate > 1 else [local]
    zero = layout is not None and _is_zero(model, split, layout)
    masters = _masters_of(state.opt_state, split, model, layout, zero, cfg.accumulate_mode)
    bufs = state.buffers
    if zero:
        path = _zero_path(cfg, split, micro, typing.cast(Any, layout), key, masters, bufs)
    else:
        path = _fsdp_path(cfg, split, micro, layout, key, masters, bufs)
    return _update(cfg, state, split, path)


def _fsdp_path(
    cfg: _Config,
    split: _Split,
    micro: list[Batch],
    layout: tuple[tuple[str, P], ...] | None,
    key: torch.Tensor | None,
    masters: _Masters | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> _PathResult:
    """FSDP, ``shard_grad_op``, DDP, HSDP and TP: the gradients of the trainable leaves as
    :meth:`FSDP.apply` reduces them, per unit (``reduce_each``), or once per step over the
    whole model (``accumulate_mode="local"``: the parameters gathered once, the gradient
    rule as :func:`to_compute_layout`'s pullback). Frozen leaves are never differentiated.
    With an optimizer layout of its own (not ZeRO's), gradients and parameters are resharded
    to it for the update and the updated parameters back to their at-rest layout.
    ``masters``: what :func:`_masters_of` found; its ``wrt`` are differentiated instead."""
    model = cfg.model
    base = split.leaves
    train = split.train_leaves if masters is None or masters.wrt is None else masters.wrt
    pullback = None
    if cfg.accumulate_mode == "local" and model is not None:
        frozen = _compute_layout(model, [base[i] for i in split.frozen_index])
        base = list(base)
        for i, v in zip(split.frozen_index, frozen):
            base[i] = v
        train, pullback = torch.func.vjp(lambda t: _compute_layout(model, t), train)

    held: list[int] = []  # differentiated masters replicated over the data axes
    if pullback is None and masters is not None and masters.wrt is not None:
        data = set(typing.cast(FSDP, model).data_axes)
        held = [
            i
            for i, p in enumerate(split.train_leaves)
            if isinstance(p, Sharded) and not data & set(p.spec.axes)
        ]

    def checked(t: list[Any], b: Batch) -> tuple[torch.Tensor, Any]:
        if held:  # they compute with their parameters (the masters rounded): no casts
            replicas = {id(t[i].local): split.train_leaves[i].local for i in held}
            with step_inputs.given(model, replicas=replicas):
                return cfg.loss(split.full(t, base), b)
        if pullback is None:
            return cfg.loss(split.full(t, base), b)
        # Gathered over the data axes already: the pullback reduces the gradients once.
        with step_inputs.given(model, reduce=False):
            return cfg.loss(split.full(t, base), b)

    widen = None if masters is None else masters.dtypes
    total, outputs, buffers = _value_and_grads(
        checked, train, micro, cfg.stream(key), cfg.differentiate, widen, buffers
    )
    if pullback is not None:
        (total,) = pullback(total)
    grads = split.train_def.unflatten(total)
    values = split.train
    if layout is None:
        return _PathResult(values, grads, outputs, lambda new: new, True, buffers)
    at_rest = optree.tree_map(
        lambda v: v.spec if isinstance(v, Sharded) else None,
        values,
        is_leaf=lambda v: isinstance(v, Sharded),
        none_is_leaf=True,
    )
    opt_layout = split.train_def.unflatten(layout)
    return _PathResult(
        reshard(values, opt_layout, check=False),
        reshard(grads, opt_layout, check=False),
        outputs,
        lambda new: reshard(new, at_rest, check=False),
        in_place=True,
        buffers=buffers,
    )


def _zero_path(
    cfg: _Config,
    split: _Split,
    micro: list[Batch],
    layout: tuple[tuple[str, P], ...],
    key: torch.Tensor | None,
    masters: _Masters | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> _PathResult:
    """ZeRO-1/2: parameters replicated over the data axes at rest, the optimizer on shards.

    ZeRO-2 (``reduce_each``): the engine computes with the replicas and reduce-scatters each
    unit's gradients onto the shards during the backward. ZeRO-1 (``local``): full
    gradients, summed over the micro-batches, reduce-scattered once at the end. The update
    is on the shards (local copies, so never written in place), and one bucketed all-gather
    brings the updated shards back into replicas."""
    model = typing.cast(FSDP, cfg.model)  # _is_zero said there is one
    names = [name for name, _ in layout]
    replicas = split.train_leaves
    shards = slice_to_shards(replicas, [spec for _, spec in layout])  # local copies

    def checked(t: list[Any], b: Batch) -> tuple[torch.Tensor, Any]:
        if cfg.accumulate_mode == "local":  # full gradients, reduce-scattered once below
            inputs = step_inputs.given(model, reduce=False)
        else:  # the shards being differentiated, as apply will see them: their replicas
            inputs = step_inputs.given(
                model, replicas={id(s.local): r.local for s, r in zip(t, replicas)}
            )
        with inputs:
            return cfg.loss(split.full(t), b)

    wrt = replicas if cfg.accumulate_mode == "local" else shards
    if masters is not None and masters.wrt is not None:  # ZeRO-2: the masters are the shards
        wrt = masters.wrt
    widen = None if masters is None else masters.dtypes
    total, outputs, buffers = _value_and_grads(
        checked, wrt, micro, cfg.stream(key), cfg.differentiate, widen, buffers
    )
    if cfg.accumulate_mode == "local":
        # Onto the masters' layout and dtype when there are masters (their gradients reach
        # them unrounded), else onto the shards'.
        onto = shards if masters is None or masters.leaves is None else masters.leaves
        total = reduce_to_shards(total, onto, names, model.data_axes, model.policy)

    def restore(new: Any) -> Any:  # one bucketed all-gather (into the old replicas if donated)
        leaves = split.train_def.flatten_up_to(new)
        gathered = gather_replicas(leaves, replicas, names, model.data_axes, into=cfg.donate)
        return split.train_def.unflatten(gathered)

    return _PathResult(
        split.train_def.unflatten(shards),
        split.train_def.unflatten(total),
        outputs,
        restore,
        in_place=False,  # the shards are the step's own copies
        buffers=buffers,
    )


def _update(cfg: _Config, state: TrainState, split: _Split, path: _PathResult) -> Any:
    """The steps every path shares: the loss (and count, aux) over the data ranks, the
    gradients of a (sum, count) loss divided by the global count, the global gradient norm
    and finiteness, the optimizer update (donated, or from fp32 masters), the parameters
    back at rest, the new state and the metrics."""
    model, donate = cfg.model, cfg.donate
    opt_state, count, key = state.opt_state, state.step, state.rng  # read before donation
    loss, items, aux = reduce_outputs(model, path.outputs, cfg.replicas)
    grads = path.grads
    if cfg.replicas is not None:  # summed over the quorum's groups: their batches' union
        grads = _over_replicas(cfg.replicas, grads, mean=items is None)
    if items is not None:
        grads = to_token_mean(model, grads, path.outputs.parts, items)
    # Element by element: a finite gradient may overflow the norm (optax's rule).
    norm, grads_finite = global_norm_and_finite(grads)
    finite = torch.isfinite(loss) & grads_finite
    given_lr = None  # train_step(learning_rate=...): computed before anything is written
    if cfg.learning_rate is not None:
        lr_ = cfg.learning_rate
        given_lr = lr_(count) if callable(lr_) else lr_
    # Not committed: some group failed (the step runs again), or no group's batch counted
    # (every group had a rank that was joining).
    if cfg.replicas is not None and not (cfg.replicas.commit() and cfg.replicas.contributors):
        skipped = {"loss": loss, "grad_norm": norm, "finite": finite}
        if items is not None:
            skipped["count"] = items
        return state, {**skipped, "committed": False, "replicas": cfg.replicas.contributors}
    if donate:  # dead before the first in-place write: a failure below cannot be retried
        state._donated_at = count
    # What the optimizer depends on, as arguments (an ExtraArgs update takes them), all
    # the same on every rank: the global norm, and the all-reduced loss's finiteness.
    extra = {
        "finite": finite if model is not None else grads_finite,
        "grad_norm": norm,  # clip_by_global_norm's: computed once per step
        "donate": donate,
    }
    train = path.train
    updates, new_opt_state = call_update(cfg.optimizer, grads, opt_state, train, extra)
    in_place = donate and path.in_place
    if isinstance(new_opt_state, MasterWeightsState):  # the masters, cast: bit-exact
        new_train = _from_masters(train, new_opt_state.master, in_place)
    elif in_place:
        new_train = _apply_in_place(train, updates)
    else:
        new_train = apply_updates(train, updates)
    if donate:
        new_opt_state = _donate_into(opt_state, new_opt_state)
    new_train = path.restore(new_train)
    # Frozen leaves are the input's own objects: never copied, never written.
    new_params = split.full(split.train_def.flatten_up_to(new_train))
    new_state = TrainState(
        new_params,
        new_opt_state,
        count + 1,
        state.trainable,
        opt_specs=state.opt_specs,
        rng=key,  # never donated: the new state shares it
        buffers=path.buffers,
    )
    # What the optimizer state records about this update (the learning rate it applied,
    # apply_if_finite's skips): read from the new state, copied if the next donated step
    # would write into it.
    records = {
        k: v.clone() if donate and isinstance(v, torch.Tensor) else v
        for k, v in metrics_of(new_opt_state).items()
    }
    lr = records.pop("lr", float("nan"))
    if given_lr is not None:
        lr = given_lr
    metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "lr": lr, "finite": finite}
    if items is not None:
        metrics["count"] = items
    metrics.update(records)
    if cfg.replicas is not None:
        metrics.update(committed=True, replicas=cfg.replicas.contributors)
    metrics = {k: _one_value(v) for k, v in metrics.items()}
    if cfg.has_aux:
        metrics["aux"] = optree.tree_map(_one_value, aux, namespace=NAMESPACE)
    return new_state, metrics


def _over_replicas(replicas: ReplicaGroup, grads: Any, mean: bool) -> Any:
    """The gradients summed over the quorum's replica groups (averaged for a scalar loss;
    a ``(sum, count)`` loss's are divided by the global count afterwards)."""
    leaves, treedef = optree.tree_flatten(grads, namespace=NAMESPACE)  # Sharded: its local
    summed = replicas.sum(leaves)
    if mean:
        summed = [t / replicas.contributors for t in summed]
    return optree.tree_unflatten(treedef, summed)


def _compute_layout(model: FSDP, values: list[Any]) -> list[Any]:
    """The compute layout of ``values``, differentiable with the gradient rule (asked of
    :mod:`functional_fsdp.fsdp.gradients`, which owns it)."""
    return to_compute_layout(values, model.mesh, model.data_axes, model.policy)


def _value_and_grads(
    fn: Callable[[list[Any], Batch], tuple[torch.Tensor, Any]],
    wrt: list[Any],
    micro: list[Batch],
    stream: Callable[[int], contextlib.AbstractContextManager[Any]],
    differentiate: Differentiator,
    widen: list[torch.dtype] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[list[Any], Outputs, dict[str, torch.Tensor] | None]:
    """The one place a step differentiates and accumulates: the gradients of
    ``fn(wrt, micro_batch)`` (its value; ``fn`` returns ``(value, (count, aux))``) with
    respect to ``wrt`` (``torch.func.grad_and_value``, or autograd: ``differentiate``'s
    engine), averaged over the micro-batches, and ``fn``'s outputs summed over them
    (detached). ``stream(i)`` is micro-batch ``i``'s random stream.
    ``widen``: per leaf of ``wrt``, the dtype micro-batch gradients are summed in when it is
    wider than theirs (the masters' of :func:`~functional_fsdp.master_weights`).
    ``buffers``: the state's buffers, threaded through the micro-batches in order (each
    ``fn`` call starts from the previous one's); the last are returned (``None``: none).

    Whatever reduces the gradients runs inside ``fn`` (``FSDP.apply``'s units); the engine
    that computes them is this function's business alone.
    """
    total, value, items, aux = None, None, None, None
    add = functools.partial(optree.tree_map, torch.add, namespace=NAMESPACE)
    for i, mb in enumerate(micro):
        with stream(i):
            given = mb if buffers is None else _WithBuffers(mb, buffers)
            g, (v, (c, a, b)) = differentiate.grad_and_value(fn, has_aux=True)(wrt, given)
            if buffers is not None:
                buffers = b
        if total is None and widen is not None and len(micro) > 1:
            g = [_widened(x, d) for x, d in zip(g, widen)]
        total = g if total is None else add(total, g)
        v = v.detach()
        value = v if value is None else value + v
        if isinstance(c, torch.Tensor):
            items = c if items is None else items + c
        if not (type(a) is tuple and not a):  # () stands for no aux
            aux = a if aux is None else optree.tree_map(operator.add, aux, a)
    if len(micro) > 1:
        n = len(micro)
        total = optree.tree_map(lambda t: t / n, total, namespace=NAMESPACE)
    outputs = Outputs(typing.cast(torch.Tensor, value), items, aux, len(micro))
    return typing.cast(list[Any], total), outputs, buffers


def _opt_layout(state: TrainState, split: _Split, asked: Any) -> tuple[tuple[str, P], ...] | None:
    """The optimizer layout of ``state`` (``None``: the parameters' own); ``asked``, the
    ``train_step(opt_specs=...)`` of older code, must agree with it."""
    layout = state.opt_specs
    if asked is None:
        return layout
    specs = resolve_specs(split.train, restrict_specs(asked, split.train))
    if layout is None:
        first = next(iter(names_of(split.train)), "?")
        raise ValueError(
            f"train_step(opt_specs=...): this TrainState was created without opt_specs, so "
            f"its optimizer state is laid out like the parameters (e.g. {first!r}), not by "
            f"{_short_repr(asked)}. The state knows its layout: create it with "
            f"ff.TrainState.create(params, optimizer, opt_specs={_short_repr(asked)}) and "
            f"leave opt_specs out of train_step."
        )
    for (name, have), want in zip(layout, specs):
        if want is not None and want.padded(len(have)) != have.padded(len(want)):
            raise ValueError(
                f"train_step(opt_specs=...): gives {name!r} the optimizer layout {want}, but "
                f"the TrainState was created with {have}. The state knows its layout: leave "
                f"opt_specs out of train_step."
            )
    return layout


def _is_zero(model: FSDP | None, split: _Split, layout: tuple[tuple[str, P], ...]) -> bool:
    """ZeRO-1/2: every trainable parameter replicated over the data axes at rest, and the
    optimizer layout sharding some over them."""
    if model is None:
        return False
    data = set(model.data_axes)
    leaves = split.train_leaves
    if not all(isinstance(v, Sharded) and not data & set(v.spec.axes) for v in leaves):
        return False
    return any(data & set(spec.axes) for _, spec in layout)


@dataclasses.dataclass(frozen=True)
class _Masters:
    """What a step does with the masters of a :func:`~functional_fsdp.master_weights` state.

    ``dtypes``: per trainable leaf, its master's dtype: micro-batch gradients are summed in
    it (Megatron's fp32 main gradients). ``leaves``: the masters, laid out as the step's
    gradients land (ZeRO-1 reduce-scatters onto them, so their gradients arrive in their
    dtype), or ``None``. ``wrt``: the masters the step differentiates instead of the
    parameters, or ``None``: FSDP gathers them in the compute dtype (the values of the
    parameters, which are the masters rounded) and the gradients, reduced in
    ``reduce_dtype``, arrive in the masters' dtype, as with FSDP2's ``param_dtype``.
    """

    dtypes: list[torch.dtype]
    leaves: list[Sharded] | None
    wrt: list[Sharded] | None


def _masters_of(
    opt_state: Any,
    split: _Split,
    model: FSDP | None,
    layout: tuple[tuple[str, P], ...] | None,
    zero: bool,
    accumulate_mode: str,
) -> _Masters | None:
    """The masters of ``opt_state`` (a :class:`MasterWeightsState`; else ``None``) and how
    the step uses them (see :class:`_Masters`).

    The masters are differentiated where gradients are reduced in a wider dtype than the
    parameters' (``MixedPrecision(reduce_dtype=float32)`` with bf16 parameters): rounding
    them to the parameters' dtype would lose what the reduction kept. Reduced in the
    parameters' dtype, rounding loses nothing: the parameters are differentiated and their
    gradients held as small. Raises where the masters would be needed and cannot be.
    """
    if not isinstance(opt_state, MasterWeightsState):
        return None
    try:
        leaves = split.train_def.flatten_up_to(opt_state.master)
    except (ValueError, TypeError):  # not laid out like the trainable parameters
        return None
    dtypes = [m.dtype for m in leaves]
    if model is None:  # no reduction: only the sum over micro-batches is widened
        return _Masters(dtypes, None, None)
    specs = (
        [spec for _, spec in layout]
        if zero and layout is not None
        else [getattr(p, "spec", None) for p in split.train_leaves]
    )
    placed = all(
        isinstance(m, Sharded)
        and isinstance(p, Sharded)
        and spec is not None
        and m.global_shape == p.global_shape
        and m.spec.padded(len(m.global_shape)) == spec.padded(len(m.global_shape))
        for m, p, spec in zip(leaves, split.train_leaves, specs)
    )
    if zero and accumulate_mode == "local":  # ZeRO-1: full gradients, reduced onto the masters
        return _Masters(dtypes, leaves if placed else None, None)
    mp = model.policy.mixed_precision
    kept, reduce = opt_state.param_dtype, mp.reduce_dtype or mp.param_dtype
    if reduce is None or reduce == kept or not _widens(kept, reduce):
        return _Masters(dtypes, None, None)
    problem = None if placed else "the masters are laid out unlike the parameters (opt_specs)"
    expected = model.layout.expected
    names = [dotted(split.paths[i]) for i in split.index]
    for name, m, p in zip(names, leaves, split.train_leaves):
        if problem is not None:
            break
        module_dtype = expected[name][2] if name in expected else None
        if gather_dtype(m.dtype, mp.param_dtype) != gather_dtype(p.dtype, mp.param_dtype):
            problem = (
                f"params[{name!r}] is {p.dtype} and its master {m.dtype}, and the policy "
                f"(MixedPrecision(param_dtype={mp.param_dtype})) would gather the master in "
                f"{gather_dtype(m.dtype, mp.param_dtype)}"
            )
        elif module_dtype is None or m.dtype not in (module_dtype, mp.param_dtype):
            problem = (
                f"params[{name!r}]'s master is {m.dtype}, but "
                f"{type(model.module).__name__}'s parameter is {module_dtype}"
            )
    if problem is None:
        return _Masters(dtypes, leaves, leaves)
    raise ValueError(
        f"train_step: with ff.master_weights(param_dtype={kept}) and gradients reduced in "
        f"{reduce} (the policy's MixedPrecision), the gradients would reach the masters "
        f"rounded to {kept}. The step keeps them in the masters' dtype by differentiating "
        f"the masters, which FSDP gathers in the policy's param_dtype, and it cannot here: "
        f"{problem}. Build the module in the masters' dtype (e.g. float32) and give the "
        f"policy MixedPrecision(param_dtype={kept}, reduce_dtype={reduce}), as FSDP2's "
        f"param_dtype does; or reduce in {kept}."
    )


def _widened(g: Any, dtype: torch.dtype) -> Any:
    """``g`` (a tensor or ``Sharded``) in ``dtype`` if that holds every value of its own."""
    local = g.local if isinstance(g, Sharded) else g
    if not isinstance(local, torch.Tensor) or local.dtype == dtype:
        return g
    if not (local.is_floating_point() and _widens(local.dtype, dtype)):
        return g
    return g.replace(local.to(dtype)) if isinstance(g, Sharded) else local.to(dtype)


def _from_masters(train: Any, master: Any, in_place: bool) -> Any:
    """``train`` with the values of the masters, cast to its dtypes (into it if asked)."""
    p, treedef = optree.tree_flatten(train, namespace=NAMESPACE)
    m = tree_leaves(master)
    if in_place:
        with torch.no_grad():
            torch._foreach_copy_(p, m)
        return train
    return optree.tree_unflatten(treedef, [x.to(y.dtype) for x, y in zip(m, p)])


def _check_global_batch_randomness(model: FSDP | None, accumulate: int) -> None:
    if model is None:
        raise ValueError(
            "train_step(randomness='global_batch') needs model=ff.fsdp(...): it draws for the "
            "global batch, laid out over the model's mesh."
        )
    if accumulate != 1:
        raise ValueError(
            f"train_step(randomness='global_batch', accumulate={accumulate}): global-batch "
            f"randomness draws for the whole global batch of a step at once, so it needs "
            f"accumulate=1. Use randomness='per_rank' to accumulate."
        )
    sizes = axis_sizes(model.mesh)
    model_axes = {a: n for a, n in sizes.items() if a not in model.data_axes and n > 1}
    if model_axes:
        raise ValueError(
            f"train_step(randomness='global_batch') supports data-parallel meshes only; the "
            f"mesh {format_mesh(sizes)} also splits the model over {sorted(model_axes)}, whose "
            f"sharded activations would draw other numbers than one process. Use "
            f"randomness='per_rank'."
        )
    if model.sequence_axis is not None and sizes[model.sequence_axis] > 1:
        raise ValueError(
            f"train_step(randomness='global_batch') splits the batch's rows only, but the "
            f"{model.sequence_axis!r} axis of {format_mesh(sizes)} splits each sequence "
            f"(context parallelism): its ranks draw independent masks for their own tokens. "
            f"Use randomness='per_rank'."
        )


def _micro_batch_stream(
    key: torch.Tensor | None, index: int, model: FSDP | None, randomness: str = "per_rank"
) -> contextlib.AbstractContextManager[None]:
    """Micro-batch ``index``'s random numbers: ``fold_in(fold_in(step_key, index), d)`` on
    data-parallel rank ``d`` (tp ranks share it); the caller's generator comes back after."""
    if key is None:
        return contextlib.nullcontext()
    key = random.fold_in(key, index)
    if randomness == "global_batch" and model is not None:  # one stream, each rank its rows
        stack = contextlib.ExitStack()
        stack.enter_context(random.seeded(key))
        stack.enter_context(random.global_batch_draws(model.mesh, model.data_axes))
        return stack
    if model is None:  # no mesh known: every process draws what data rank 0 would
        return random.seeded(random.fold_in(key, 0))
    return random.seeded(key, mesh=model.mesh, axes=model.data_axes)


def _one_value(value: Any) -> Any:
    """A metric as one plain tensor: on a simulated mesh, the rank-0 value if every rank has
    the same (as after the all-reduce); otherwise unchanged. Real tensors are not read."""
    per_rank = getattr(value, "_local_tensors", None)
    if per_rank is None:
        return value
    values = [per_rank[r] for r in sorted(per_rank)]
    if all(_same(values[0], v) for v in values[1:]):
        return values[0]
    return value


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a NaN loss is the same on every rank too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _apply_in_place(params: Any, updates: Any) -> Any:
    leaves = tree_leaves(params)
    with torch.no_grad():
        torch._foreach_add_(leaves, tree_leaves(updates))
    return params


def _donate_into(old: Any, new: Any) -> Any:
    """``new``, with its tensors written into ``old``'s buffers (non-tensor leaves from ``new``)."""
    new_leaves, treedef = optree.tree_flatten(new, namespace=NAMESPACE)
    out = []
    with torch.no_grad():
        for o, n in zip(tree_leaves(old), new_leaves):
            if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o is not n:
                o.copy_(n)
                out.append(o)
            else:
                out.append(n)
    return optree.tree_unflatten(treedef, out)
