"""``TrainState`` and a pure ``train_step``.

``train_step(loss_fn, optimizer, model=...)`` returns ``step(state, batch) -> (state, metrics)``
built on ``torch.func.grad_and_value``. The gradient rule lives in :meth:`FSDP.apply` (each
unit's backward reduce-scatters / all-reduces over the data axes); ``train_step`` adds the
global-batch split, gradient accumulation, ZeRO-1 optimizer sharding, metrics and donation.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import optree
import torch

from ._tree import NAMESPACE, tree_leaves
from .dist import collectives as C
from .dist.mesh import axis_sizes
from .dist.simulate import per_coordinate
from .fsdp.api import FSDP
from .optim._tree import donating
from .optim.clipping import global_norm
from .optim.schedules import Schedule
from .optim.transforms import GradientTransformation, apply_updates
from .sharded import Sharded
from .sharding import reshard
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
        functional_fsdp.train.DonatedStateError: this TrainState was donated to a train_step(donate=True) call at step 0: its buffers now hold the next state. Use the state that call returned, or build the step with donate=False to keep old states.
    """


class TrainState:
    """Parameters, optimizer state and step count: a pytree, immutable by convention.

    Attributes:
        params: the parameters (a pytree of ``Sharded``, in their at-rest layout).
        opt_state: the optimizer state (for ZeRO-1 laid out by the optimizer specs).
        step: completed optimizer steps.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> state = ff.TrainState.create({"w": torch.zeros(2)}, ff.sgd(0.1))
        >>> state.step
        0
    """

    __slots__ = ("_donated_at", "_opt_state", "_params", "_step")

    def __init__(self, params: Any, opt_state: Any, step: int = 0) -> None:
        self._params, self._opt_state, self._step = params, opt_state, step
        self._donated_at: int | None = None

    @staticmethod
    def create(
        params: Any, optimizer: GradientTransformation, *, opt_specs: Any = None
    ) -> TrainState:
        """A fresh state at step 0.

        Args:
            params: the parameters, in their at-rest layout.
            optimizer: initialised on ``params`` (or on their ``opt_specs`` layout).
            opt_specs: for ZeRO-1, the optimizer-state layout (the same value passed to
                :func:`train_step`), e.g. ``P("dp")`` with replicated ``P()`` params.
        """
        opt_params = params if opt_specs is None else reshard(params, opt_specs)
        return TrainState(params, optimizer.init(opt_params), 0)

    def _alive(self) -> None:
        if self._donated_at is not None:
            raise DonatedStateError(
                f"this TrainState was donated to a train_step(donate=True) call at step "
                f"{self._donated_at}: its buffers now hold the next state. Use the state that "
                f"call returned, or build the step with donate=False to keep old states."
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

    def __repr__(self) -> str:
        if self._donated_at is not None:
            return f"TrainState(<donated at step {self._donated_at}>)"
        n = sum(
            leaf.numel() for leaf in tree_leaves(self._params) if isinstance(leaf, torch.Tensor)
        )
        return f"TrainState(step={self._step}, local parameter elements={n})"


def _flatten_state(s: TrainState) -> tuple[tuple[Any, Any, int], None, tuple[str, str, str]]:
    s._alive()
    return (s._params, s._opt_state, s._step), None, ("params", "opt_state", "step")


optree.register_pytree_node(
    TrainState,
    _flatten_state,
    lambda _, children: TrainState(*children),
    namespace=NAMESPACE,
)


# --------------------------------------------------------------------------- batches


def split_batch(batch: Batch, parts: int, where: str = "train_step") -> list[Batch]:
    """Split every tensor of ``batch`` into ``parts`` equal chunks along dim 0."""
    leaves, treedef = optree.tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor)}
    for size in sizes:
        if size % parts:
            raise ValueError(
                f"{where}: a batch of {size} examples does not split into {parts} equal "
                f"micro-batches; use a batch size divisible by accumulate={parts}."
            )
    chunks = [t.chunk(parts) if isinstance(t, torch.Tensor) else [t] * parts for t in leaves]
    return [optree.tree_unflatten(treedef, [c[i] for c in chunks]) for i in range(parts)]


def local_batch(batch: Batch, mesh: Any, data_axes: tuple[str, ...]) -> Batch:
    """This rank's share (along dim 0) of a global batch that every rank holds.

    Data ranks are numbered row-major over ``data_axes``; ranks that differ only in model
    axes (tp) get the same share.

    Raises:
        ValueError: if the batch does not divide across the data-parallel ranks.
    """
    sizes = axis_sizes(mesh)
    n = math.prod(sizes[a] for a in data_axes)
    leaves, treedef = optree.tree_flatten(batch)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.shape[0] % n:
            raise ValueError(
                f"train_step: a global batch of {t.shape[0]} examples (shape {tuple(t.shape)}) "
                f"does not divide across the {n} data-parallel ranks of {format_mesh(sizes)} "
                f"(data axes {data_axes}); use a multiple of {n}, or pass each rank's own "
                f"batch with train_step(..., batch='local')."
            )
    if n == 1:
        return batch

    def index(coord: dict[str, int], per: int) -> torch.Tensor:
        rank = 0
        for a in data_axes:
            rank = rank * sizes[a] + coord[a]
        return torch.arange(rank * per, (rank + 1) * per)

    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            per = t.shape[0] // n
            out.append(t.index_select(0, per_coordinate(mesh, lambda c, p=per: index(c, p))))
        else:
            out.append(t)
    return optree.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------- the step


class _ScaleGrad(torch.autograd.Function):
    """Identity whose gradient is multiplied by ``scale``."""

    @staticmethod
    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.scale, None


def _gather_for_accumulation(model: FSDP, params: dict[str, Sharded]) -> dict[str, Sharded]:
    """The compute layout (data axes gathered), differentiable with the gradient rule.

    Its gradient is reduce-scattered over the sharded data axes, all-reduced over the
    replicated ones, and averaged over the data ranks: once per step, for the whole model.
    """
    data = model.data_axes
    compute = {k: functools.reduce(P.without, data, v.spec) for k, v in params.items()}
    gathered = reshard(params, compute)
    sizes = axis_sizes(model.mesh)
    scale = 1.0 / math.prod(sizes[a] for a in data) if model.policy.grad_reduce == "mean" else 1.0
    out = {}
    for k, v in gathered.items():
        replicated = tuple(a for a in data if a not in params[k].spec.axes)
        local = C.all_reduce_grad(v.local, model.mesh, replicated) if replicated else v.local
        out[k] = Sharded._unchecked(_ScaleGrad.apply(local, scale), v.global_shape, v.spec, v.mesh)
    return out


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"train_step: loss_fn must return a scalar tensor (the mean loss of this rank's "
            f"batch), got {shape}. Reduce it, e.g. return loss.mean()."
        )
    return loss


def train_step(
    loss_fn: Callable[[Any, Batch], torch.Tensor],
    optimizer: GradientTransformation,
    *,
    model: FSDP | None = None,
    batch: Literal["global", "local"] = "global",
    accumulate: int = 1,
    accumulate_mode: Literal["reduce_each", "local"] = "reduce_each",
    opt_specs: Any = None,
    learning_rate: float | Schedule | None = None,
    donate: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build a pure ``step(state, batch) -> (new_state, metrics)``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``: the mean loss of a batch, running the
            model with :meth:`FSDP.apply` (which reduces gradients over the data axes).
        optimizer: a :class:`GradientTransformation`, e.g. ``chain(clip_by_global_norm(1.0),
            adamw(3e-4))``.
        model: the :class:`FSDP` description (mesh, data axes, policy). Needed for
            ``batch="global"``, ``accumulate_mode="local"`` and metrics over the mesh.
        batch: ``"global"``: every rank passes the same global batch and keeps its share of
            dim 0 (the loss is then the global-batch mean); ``"local"``: each rank passes
            its own share.
        accumulate: split this rank's batch into this many micro-batches.
        accumulate_mode: ``"reduce_each"`` runs the sharded step per micro-batch and adds the
            reduce-scattered gradients (least memory: only shard-sized gradients); ``"local"``
            gathers the parameters once, adds full-size gradients locally and reduces once
            per step (least communication: one reduce-scatter instead of ``accumulate``, but
            full parameters and gradients stay in memory for the step).
        opt_specs: optimizer layout for ZeRO-1: params stay replicated (``P()``), gradients
            and optimizer state are laid out by these specs (e.g. ``P("dp")``), updated
            parameters are all-gathered back. ``None``: the parameters' own layout.
        learning_rate: the schedule (or constant) to report as ``metrics["lr"]``.
        donate: update the state's tensors in place; the input state is dead afterwards and
            using it raises :class:`DonatedStateError`. Lowers peak memory.

    Returns:
        ``step(state, batch)``; metrics hold ``loss`` (global mean), ``grad_norm`` (global,
        mesh-aware) and ``lr``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Linear(4, 1)
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     sharded_model = ff.fsdp(model, mesh)
        ...     loss_fn = lambda p, b: (sharded_model.apply(p, b[0]) - b[1]).pow(2).mean()
        ...     step = ff.train_step(loss_fn, ff.sgd(0.1), model=sharded_model)
        ...     state = ff.TrainState.create(sharded_model.shard(), ff.sgd(0.1))
        ...     state, metrics = step(state, (torch.randn(8, 4), torch.randn(8, 1)))
        ...     state.step
        1
    """
    if accumulate < 1:
        raise ValueError(f"train_step: accumulate must be >= 1, got {accumulate}")
    if accumulate_mode not in ("reduce_each", "local"):
        raise ValueError(
            f"train_step: accumulate_mode must be 'reduce_each' or 'local', got {accumulate_mode!r}"
        )
    if (batch == "global" or accumulate_mode == "local") and model is None:
        raise ValueError(
            "train_step: pass model=ff.fsdp(...) so the step knows the mesh and data axes "
            "(needed for batch='global' and accumulate_mode='local')."
        )

    def grads_and_loss(params: Any, local: Batch) -> tuple[Any, torch.Tensor]:
        micro = split_batch(local, accumulate) if accumulate > 1 else [local]
        checked = lambda p, b: _check_loss(loss_fn(p, b))  # noqa: E731
        if accumulate_mode == "local" and model is not None:
            compute, pullback = torch.func.vjp(lambda p: _gather_for_accumulation(model, p), params)
            total, loss_sum = None, 0.0
            with model.no_sync():
                for mb in micro:
                    g, loss = torch.func.grad_and_value(checked)(compute, mb)
                    total = (
                        g
                        if total is None
                        else optree.tree_map(torch.add, total, g, namespace=NAMESPACE)
                    )
                    loss_sum = loss_sum + loss.detach()
            total = optree.tree_map(lambda t: t / len(micro), total, namespace=NAMESPACE)
            (grads,) = pullback(total)
            return grads, loss_sum / len(micro)
        total, loss_sum = None, 0.0
        for mb in micro:
            g, loss = torch.func.grad_and_value(checked)(params, mb)
            total = (
                g if total is None else optree.tree_map(torch.add, total, g, namespace=NAMESPACE)
            )
            loss_sum = loss_sum + loss.detach()
        if len(micro) > 1:
            total = optree.tree_map(lambda t: t / len(micro), total, namespace=NAMESPACE)
        return total, loss_sum / len(micro)

    def step(state: TrainState, data: Batch) -> tuple[TrainState, Metrics]:
        params, opt_state, count = state.params, state.opt_state, state.step
        local = (
            local_batch(data, model.mesh, model.data_axes) if batch == "global" and model else data
        )
        grads, loss = grads_and_loss(params, local)
        at_rest = None
        if opt_specs is not None:  # ZeRO-1: slice gradients and params to the optimizer layout
            at_rest = optree.tree_map(
                lambda v: v.spec if isinstance(v, Sharded) else None,
                params,
                is_leaf=lambda v: isinstance(v, Sharded),
                none_is_leaf=True,
            )
            grads = reshard(grads, opt_specs)
            params = reshard(params, opt_specs)
        norm = global_norm(grads)
        with donating() if donate else contextlib.nullcontext():
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
        if donate:
            new_params = _apply_in_place(params, updates)
            new_opt_state = _donate_into(opt_state, new_opt_state)
        else:
            new_params = apply_updates(params, updates)
        if at_rest is not None:
            new_params = reshard(new_params, at_rest)
        if model is not None:
            loss = C.wait(C.raw_all_reduce(loss, model.mesh, model.data_axes, op="mean"))
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        new_state = TrainState(new_params, new_opt_state, count + 1)
        if donate:
            state._donated_at = count
        return new_state, {
            "loss": loss,
            "grad_norm": norm,
            "lr": lr if lr is not None else float("nan"),
        }

    return step


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
