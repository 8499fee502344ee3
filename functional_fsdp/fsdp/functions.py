"""The engine's autograd functions and pytree helpers (private).

The gather (whose backward reduce-scatters), the hooks that gather a unit again before its
backward and free it after, the fence that finishes the reductions in flight, and activation
checkpointing written as a plain ``autograd.Function`` (torch's own relies on saved-tensor
hooks, which ``torch.func`` transforms refuse). Outputs and inputs are traversed as torch's
pytree sees them (``ModelOutput`` and any registered node), and dataclasses too.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .. import rng
from .units import Call, InFlight, _plain


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
        # A frozen shard's gathered value is a constant: no gradient is computed for it, and
        # model code may write into it without autograd (peft's parametrization of a frozen
        # weight: ``set_`` on it, which a differentiable view of this node would refuse).
        frozen = [o for s, o in zip(inputs[1:], output) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        call: Call = ctx.call
        if call.reduced is not None:  # by the call's own backward (see reduce_early)
            out, call.reduced = call.reduced, None
            return (None, *out)
        needs = [ctx.needs_input_grad[1 + i] for i in range(len(grads))]
        # Communication and bookkeeping on plain tensors, below any torch.func level: the
        # returned gradients are constants to outer transforms (FSDP is not differentiated
        # twice), and the transforms' per-op overhead is avoided.
        plain = [_plain(g) if need and g is not None else None for g, need in zip(grads, needs)]
        return (None, *call.reduce(plain))


def reduce_early(
    call: Call | None, n_params: int, diff: list[int], leaves: list[torch.Tensor], got: list[Any]
) -> None:
    """Reduce a self-contained call's parameter gradients in its own backward, where they
    are the backward's own tensors: freed once packed, before the reduce-scatter is issued
    (the gather's backward would receive them from autograd, which holds them throughout).

    Flat inputs ``0..n_params-1`` of the call's graph are its gathered parameters;
    ``leaves[k]`` is flat input ``diff[k]`` as the graph's input and ``got[k]`` its gradient.
    The parameters' entries of ``got`` become zero-size stand-ins for the gather's backward,
    which hands on ``call.reduced`` instead. A parameter that requires grad and got none
    counts as zeros, as the gather's backward would have received it.
    """
    if call is None or not any(i < n_params for i in diff):
        return
    grads: list[torch.Tensor | None] = [None] * n_params
    for k, i in enumerate(diff):
        if i < n_params:
            g, got[k] = got[k], leaves[k].new_zeros(()).expand(leaves[k].shape)
            grads[i] = g if g is not None else torch.zeros_like(leaves[k])
    del g
    call.reduced = call.reduce(grads)


class GradFence(torch.autograd.Function):
    """Identity on one gathered parameter as one module reads it; its gradient passes on
    as a constant (below any ``torch.func`` level) as soon as that use's backward is done.

    Inside ``torch.func.grad``, whose backward records its own history for higher
    derivatives, a parameter's gradient holds that history (the backward's temporaries and
    the activations they saved) until it is read. Without the fence it is read by the
    unit's gather backward, after the unit's whole backward (and, for a weight tied to a
    module that runs last, after the whole backward pass: the logits' gradient of a tied
    LM head). FSDP is not differentiated twice.
    """

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _plain(grad)


class Isolated:
    """One unit call that :class:`Isolate` runs with its own plain autograd graph.

    ``fn(*flat)`` is the call; ``diff`` the positions in ``flat`` of the tensors to
    differentiate. The forward keeps the graph (its outputs and its leaves) for the backward,
    which drops it.
    """

    def __init__(self, fn: Callable[..., Any], diff: list[int], call: Call, n_params: int) -> None:
        self.fn: Callable[..., Any] | None = fn  # dropped once run (it holds module copies)
        self.diff = diff
        # The unit call whose parameters are flat inputs 0..n_params-1: their gradients are
        # reduced in this call's backward (see reduce_early).
        self.call, self.n_params = call, n_params
        self.leaves: list[torch.Tensor] = []  # detached copies of flat[diff]: the graph's inputs
        # Per tensor leaf of the output, where its gradient enters the graph (None: nowhere).
        # Edges, not the tensors: an output is freed when the code after the unit is done.
        self.edges: list[GradientEdge | None] = []
        self.out_def: torch_pytree.TreeSpec | None = None
        self.out_others: list[Any] = []  # the output's non-tensor leaves, as returned
        self.out_is_tensor: list[bool] = []

    def first(self, flat: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        args = list(flat)
        fn, self.fn = self.fn, None
        with torch.enable_grad():
            for i in self.diff:
                args[i] = args[i].detach().requires_grad_()
            self.leaves = [args[i] for i in self.diff]
            out = fn(*args)  # type: ignore[misc]
        leaves, self.out_def = flatten(out)
        self.out_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.out_others = [x for x in leaves if not isinstance(x, torch.Tensor)]
        outs = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.edges = [get_gradient_edge(x) if x.requires_grad else None for x in outs]
        return tuple(x.detach() for x in outs)

    def output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        it, others = iter(tensors), iter(self.out_others)
        leaves = [next(it) if is_t else next(others) for is_t in self.out_is_tensor]
        return torch_pytree.tree_unflatten(leaves, self.out_def)  # type: ignore[arg-type]


class Isolate(torch.autograd.Function):
    """Run a unit call with plain autograd inside ``torch.func``; backward runs its graph.

    Inside ``torch.func.grad`` the backward records its own history (for higher
    derivatives), which would keep the unit's backward temporaries, and the activations they
    saved, alive until the unit's whole backward is done. Here the unit runs on plain
    tensors (``torch.func`` runs a Function's forward below its level) with a graph of its
    own, and the backward runs that graph with plain autograd, which frees each saved tensor
    as soon as its node has run, as ``loss.backward()`` does. The same operations in the same
    order, so the same gradients; they pass on as constants (FSDP is not differentiated twice).
    Returns the output's tensor leaves; ``job.output`` rebuilds the output.
    """

    @staticmethod
    def forward(job: Isolated, *flat: Any) -> Any:  # type: ignore[override]
        return job.first(flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.job, ctx.n = inputs[0], len(inputs) - 1
        ctx.set_materialize_grads(False)  # an output nothing used adds nothing, not zeros

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        job: Isolated = ctx.job
        edges, leaves = job.edges, job.leaves
        job.edges, job.leaves = [], []  # the graph dies with this backward
        got = list(plain_grads(edges, grads, leaves))
        del edges
        reduce_early(job.call, job.n_params, job.diff, leaves, got)
        result: list[Any] = [None] * ctx.n
        for i, g in zip(job.diff, got):
            result[i] = g
        return (None, *result)


@contextlib.contextmanager
def _below_transform() -> Iterator[None]:
    """Run below the innermost ``torch.func`` level, if any: where ``torch.func`` runs an
    autograd.Function's forward (an isolated unit's, a checkpointed unit's first run)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        yield
        return
    with temporarily_pop_interpreter_stack():
        yield


def plain_grads(
    outs: list[GradientEdge | torch.Tensor | None],
    grads: tuple[torch.Tensor | None, ...],
    leaves: list[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``leaves`` given those of ``outs`` (``None``: no gradient flows
    there), computed with plain autograd below any ``torch.func`` level (the graph from
    ``outs`` to ``leaves`` was recorded on plain tensors). Not differentiable."""
    used = [(o, _plain(g)) for o, g in zip(outs, grads) if g is not None and o is not None]
    if not used:
        return (None,) * len(leaves)
    with _below_transform():  # as the graph was recorded (its Functions see no transform)
        return torch.autograd.grad(
            [o for o, _ in used], leaves, [g for _, g in used], allow_unused=True
        )


class PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; in backward, gathers the unit again before it runs.

    The incoming gradients pass on as constants (below any ``torch.func`` level): inside
    ``torch.func.grad``, whose backward records its own history for higher derivatives, this
    lets the backward history of the units already done be freed at once instead of at the
    end of the backward pass. FSDP is not differentiated twice.
    """

    @staticmethod
    def forward(hook: Callable[[], None], *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.hook = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.hook()
        return (None, *(None if g is None else _plain(g) for g in grads))


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; in backward (after the unit's), runs a hook.

    For a unit none of whose parameters is differentiated: no gather backward frees its
    parameters gathered again for backward, so this does.
    """

    @staticmethod
    def forward(hook: Callable[[], None], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.hook = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


class ReduceFence(torch.autograd.Function):
    """Identity on the differentiated shards; in backward, finishes the reductions in flight.

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


def attach(
    fn: type[torch.autograd.Function], tree: Any, hook: Callable[[], None]
) -> tuple[Any, bool]:
    """``tree`` with ``fn`` applied to its tensors that require grad; and whether any did."""
    leaves, treedef = flatten(tree)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return tree, False
    wrapped = fn.apply(hook, *(leaves[i] for i in idx))
    for i, w in zip(idx, wrapped):
        leaves[i] = w
    return torch_pytree.tree_unflatten(leaves, treedef), True


def _is_opaque_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def flatten(tree: Any) -> tuple[list[Any], torch_pytree.TreeSpec]:
    """Flatten as torch's pytree does (``ModelOutput`` and any registered node), also
    seeing into dataclasses that nobody registered."""
    leaves, treedef = torch_pytree.tree_flatten(tree)
    if not any(_is_opaque_dataclass(x) for x in leaves):
        return leaves, treedef
    expanded = [_DataclassNode.of(x) if _is_opaque_dataclass(x) else x for x in leaves]
    return torch_pytree.tree_flatten(torch_pytree.tree_unflatten(expanded, treedef))


class _DataclassNode:
    """A dataclass instance seen as a pytree node (its init fields are the children)."""

    def __init__(self, value: Any, names: tuple[str, ...], children: list[Any]):
        self.value, self.names, self.children = value, names, children

    @staticmethod
    def of(value: Any) -> _DataclassNode:
        names = tuple(f.name for f in dataclasses.fields(value) if f.init)
        return _DataclassNode(value, names, [getattr(value, n) for n in names])

    def rebuild(self, children: list[Any]) -> Any:
        return dataclasses.replace(self.value, **dict(zip(self.names, children)))


torch_pytree.register_pytree_node(
    _DataclassNode,
    lambda node: (node.children, (node.value, node.names)),
    lambda children, ctx: _DataclassNode(ctx[0], ctx[1], list(children)).rebuild(list(children)),
    serialized_type_name="functional_fsdp._DataclassNode",
)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor (other leaves kept), as :func:`flatten` sees it."""
    leaves, treedef = flatten(tree)
    return torch_pytree.tree_unflatten(
        [fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], treedef
    )


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast the floating tensors of ``tree`` (``ModelOutput`` and dataclasses too)."""
    if dtype is None:
        return tree
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


class Replay:
    """What a checkpointed call needs to run its forward again, exactly, in backward.

    ``fn(*flat)`` is the call (``call()``, if given, runs it in forward on the caller's
    own objects, so that containers among the inputs are the caller's, as without
    checkpointing); :class:`Checkpoint`'s forward fills in the rest: the
    generator state the forward drew from (so dropout draws the same masks again), a
    snapshot of the non-tensor inputs as they were before the forward (so state that the
    forward mutates, e.g. a Hugging Face KV cache it appends to, is seen unmutated again),
    and how to rebuild the output (tensors from autograd, everything else as returned).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        call: Callable[[], Any] | None = None,
        *,
        plain: bool = False,
        unit: tuple[Call, int] | None = None,
    ) -> None:
        self.fn, self.call = fn, call  # call: the forward on the caller's own input objects
        # Recompute with plain autograd below any torch.func level (the arithmetic of an
        # isolated unit: see Isolate), else with torch.func.vjp.
        self.plain = plain
        # With plain: the unit call whose parameters are the first flat inputs, and how
        # many; their gradients are reduced in the recompute's backward (see reduce_early).
        self.unit = unit
        self.rng: Any = None
        self.context: contextvars.Context | None = None  # e.g. the call's sequence split
        self.others: list[Any] = []  # the non-tensor inputs, snapshotted before the forward
        self.out_def: torch_pytree.TreeSpec | None = None
        self.out_others: list[Any] = []  # the output's non-tensor leaves, as returned
        self.out_is_tensor: list[bool] = []

    def first(self, flat: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        self.rng = rng.get_state()
        self.context = contextvars.copy_context()
        self.others = [snapshot(x) for x in flat if not isinstance(x, torch.Tensor)]
        with torch.no_grad():
            out = self.fn(*flat) if self.call is None else self.call()
        leaves, self.out_def = flatten(out)
        self.out_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.out_others = [x for x in leaves if not isinstance(x, torch.Tensor)]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def again(self, flat: list[Any]) -> tuple[torch.Tensor, ...]:
        """The forward run again on ``flat`` (tensors) and fresh copies of the snapshot."""
        others = iter(snapshot(self.others))
        args = [x if isinstance(x, torch.Tensor) else next(others) for x in flat]
        assert self.context is not None
        with rng.preserved():
            rng.set_state(self.rng)
            # In the forward's context variables (a fresh copy: a recompute may nest).
            leaves, _ = flatten(self.context.copy().run(self.fn, *args))
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        it, others = iter(tensors), iter(self.out_others)
        leaves = [next(it) if is_t else next(others) for is_t in self.out_is_tensor]
        return torch_pytree.tree_unflatten(leaves, self.out_def)  # type: ignore[arg-type]


class Checkpoint(torch.autograd.Function):
    """Run a :class:`Replay`'s call without keeping activations; recompute them in backward.

    Written as a plain ``autograd.Function`` because torch's checkpoint relies on saved-tensor
    hooks (refused inside ``torch.func`` transforms) or lacks ``setup_context``. Like torch's
    (``preserve_rng_state=True``), the recompute draws the forward's random numbers. Returns
    the output's tensor leaves; ``replay.output`` rebuilds the output.
    """

    @staticmethod
    def forward(replay: Replay, *flat: Any) -> Any:  # type: ignore[override]
        return replay.first(flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.replay = inputs[0]
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs[1:]]
        ctx.save_for_backward(*(x for x in inputs[1:] if isinstance(x, torch.Tensor)))
        ctx.set_materialize_grads(False)  # an output nothing used adds nothing (plain)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        replay: Replay = ctx.replay
        tensors = iter(ctx.saved_tensors)
        flat: list[Any] = [next(tensors) if is_t else None for is_t in ctx.is_tensor]
        diff = [i for i, is_t in enumerate(ctx.is_tensor) if is_t and ctx.needs_input_grad[1 + i]]

        if replay.plain:  # as an isolated unit's backward: plain autograd, op by op
            with _below_transform(), torch.enable_grad():
                args = [_plain(x) if isinstance(x, torch.Tensor) else x for x in flat]
                for i in diff:
                    args[i] = args[i].detach().requires_grad_()
                leaves = [args[i] for i in diff]
                outs = [o if o.requires_grad else None for o in replay.again(args)]
            got: Any = list(plain_grads(outs, grads, leaves))
            del outs
            if replay.unit is not None:
                reduce_early(replay.unit[0], replay.unit[1], diff, leaves, got)
        else:

            def recompute(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                args = list(flat)
                for i, x in zip(diff, xs):
                    args[i] = x
                return replay.again(args)

            # torch.func.vjp works both under plain autograd and inside torch.func transforms.
            out, vjp_fn = torch.func.vjp(recompute, *(flat[i] for i in diff))
            cotangents = tuple(
                (g if g is not None else torch.zeros_like(o))
                if o.is_floating_point() or o.is_complex()
                else None
                for o, g in zip(out, grads)
            )
            got = vjp_fn(cotangents)
        result: list[Any] = [None] * len(flat)
        for i, g in zip(diff, got):
            result[i] = g
        return (None, *result)


_SHARED = (
    torch.Tensor,
    torch.nn.Module,
    torch.Generator,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
    enum.Enum,
)


def snapshot(x: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of the mutable structure of ``x`` that shares its tensors, modules and functions.

    Containers and plain objects (their ``__dict__``) are copied, so code that replaces what
    they hold (``cache.keys = torch.cat(...)``, ``list.append``) leaves the snapshot as it
    was; tensors are shared, never copied. Objects that cannot be copied are shared.
    """
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, *_SHARED)):
        return x
    memo = {} if memo is None else memo
    if id(x) in memo:
        return memo[id(x)]
    kind = type(x)
    if kind in (list, tuple, set, frozenset):
        out: Any = kind(snapshot(v, memo) for v in x)
    elif kind is dict:
        out = {k: snapshot(v, memo) for k, v in x.items()}
    elif isinstance(getattr(x, "__dict__", None), dict) and not callable(x):
        try:
            out = copy.copy(x)
        except Exception:  # an object that refuses to be copied is shared as it is
            return x
        if out is x or not isinstance(getattr(out, "__dict__", None), dict):
            return x
        memo[id(x)] = out
        for k, v in list(vars(out).items()):
            out.__dict__[k] = snapshot(v, memo)
        if isinstance(out, dict):  # dict subclasses (ModelOutput) keep items apart from attrs
            for k, v in list(out.items()):
                dict.__setitem__(out, k, snapshot(v, memo))
        return out
    else:
        return x
    memo[id(x)] = out
    return out
