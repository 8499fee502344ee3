"""The interpreter under :meth:`FSDP.apply <functional_fsdp.FSDP.apply>` (private).

:func:`run` executes a :class:`~functional_fsdp.fsdp.layout.ModelLayout` on one call's parameters.
Everything it creates belongs to that call and dies with its autograd graph:

* a *copy of the module tree*: every module object is copied shallowly (its own parameter,
  buffer and child dicts; every other attribute shared until set). Gathered parameters,
  tensor-parallel styles and the units' gathering ``forward`` are installed on the copies,
  never on the user's module, so calls on several threads, and an ``apply`` inside a module's
  forward, each run on their own copies. A checkpointed unit recomputes on the same copies
  in backward.
* a :class:`~functional_fsdp.fsdp.units.CallState`: the units, their gathers and
  prefetches, the reductions in flight. :func:`run` creates it and drives it; the module
  copies' forwards reach it through :func:`_unit_forward`; nothing of it outlives the call's
  autograd graph, and no state is kept between calls.

No reference cycle is created: a copy's installed forward holds the call's state, which
refers to the copies only weakly, so a step's tensors are freed as soon as the caller drops
them (without Python's cycle collector).
"""

from __future__ import annotations

import contextvars
import functools
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._modules import copy_tree
from . import batch_stats
from .functions import (
    Checkpoint,
    GradFence,
    Isolate,
    Isolated,
    PostBackward,
    PreBackward,
    ReduceFence,
    Replay,
    UnitGather,
    attach,
    cast_floating,
    flatten,
)
from .layout import ModelLayout, UnitLayout
from .memory import active_trackers
from .policy import ModuleWrapper, Policy
from .units import Call, CallState, Context

Slot = tuple["weakref.ReferenceType[nn.Module]", str]  # (module copy, attribute name)


def copy_modules(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, nn.Module]:
    """Shallow copies of a module tree: ``{path: copy}`` for every path (shared modules once).

    Each copy has its own ``_parameters``, ``_buffers`` and ``_modules`` dicts (children
    point to the copies); other attributes are shared with the original until set. A
    ``forward`` bound to the instance is bound to the copy weakly (the copy dies with the call).
    """
    return copy_tree(modules, bind=lambda c, own: _Forward(c, own, rebind=True))


def _slot(copies: dict[str, nn.Module], name: str) -> Slot:
    path, _, attr = name.rpartition(".")
    return weakref.ref(copies[path]), attr


def _set(
    slots: Sequence[Sequence[Slot]], tensors: Sequence[torch.Tensor], *, fence: bool = False
) -> None:
    """Install ``tensors`` in their slots (every alias); with ``fence``, each alias that
    ``torch.func`` differentiates gets its own :class:`GradFence`."""
    for where, t in zip(slots, tensors):
        fenced = fence and t.requires_grad and _transformed(t)
        for ref, attr in where:
            ref()._parameters[attr] = GradFence.apply(t) if fenced else t  # type: ignore[union-attr,assignment]


def _transformed(t: Any) -> bool:
    """Whether ``t`` is a tensor inside a ``torch.func`` transform (a wrapped tensor)."""
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)


class _Forward:
    """The ``forward`` installed on a module copy: its own forward, wrapped by the
    tensor-parallel styles of its path, then (for a unit) by the unit's gather.

    Holds the copy weakly and builds the chain per invocation with the live copy.
    """

    def __init__(
        self,
        copy: nn.Module,
        base: Callable[..., Any] | None,
        wrappers: Sequence[ModuleWrapper] = (),
        unit: Callable[..., Any] | None = None,
        *,
        rebind: bool = False,
    ):
        if isinstance(base, _Forward):  # the copy's own forward, already made weak
            base, rebind = base.base, base.rebind
        self.copy = weakref.ref(copy)
        # The original's instance-level forward, if it had one (``None``: the class's); a
        # method bound to the original runs bound to the copy instead (``rebind``).
        self.base, self.rebind = base, rebind
        self.wrappers, self.unit = tuple(wrappers), unit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.copy()
        if module is None:  # pragma: no cover - a copy outliving its call
            raise RuntimeError("internal: FSDP.apply's module copy is gone")
        forward: Callable[..., Any]
        if self.base is None:
            forward = types.MethodType(type(module).forward, module)
        elif self.rebind:
            forward = types.MethodType(self.base.__func__, module)  # type: ignore[attr-defined]
        else:
            forward = self.base
        for wrapper in self.wrappers:
            forward = wrapper(module, forward)
        if self.unit is not None:
            return self.unit(forward, *args, **kwargs)
        return forward(*args, **kwargs)


def run(
    layout: ModelLayout,
    modules: Sequence[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    sizes: dict[str, int],
    policy: Policy,
    data_axes: tuple[str, ...],
    wrappers: Sequence[tuple[str, ModuleWrapper]],
    params: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    buffers: dict[str, torch.Tensor] | None,
    *,
    replicas: Mapping[int, torch.Tensor],
    mutable: str | None = None,
) -> Any:
    """Run the module of ``layout`` on ``args``/``kwargs`` with the sharded ``params``.

    ``modules`` is the module's ``named_modules(remove_duplicate=False)``; ``params`` were
    checked against the layout by the caller. ``replicas`` (ZeRO-1/2, from the step): full
    values to compute with instead of all-gathering, by the id of a local shard in ``params``
    (see :class:`~functional_fsdp.fsdp.step_inputs.StepInputs`). ``mutable`` (``"per_rank"``
    or ``"sync"``): the forward runs on clones of ``buffers`` and the call returns
    ``(out, new_buffers)`` (see :mod:`functional_fsdp.fsdp.batch_stats`).
    """
    ctx = Context.for_call(mesh, sizes, policy, data_axes, trackers=active_trackers())
    state = CallState(layout, ctx, params, replicas)
    if not ctx.simulated and not torch.is_anomaly_enabled():
        # One fence over every differentiated shard, before any gather (see ReduceFence).
        # Only those: an autograd.Function's outputs all require grad when one input does.
        live = state.differentiated_shards()
        state.fenced(ReduceFence.apply(state.in_flight, *live) if live else ())

    copies = copy_modules(modules)
    _recompute_with_own_params(copies, state)
    slots = {
        name: [[_slot(copies, a) for a in aliases] for aliases in up.aliases]
        for name, up in layout.units.items()
    }
    for alias, meta in layout.placeholders.items():
        ref, attr = _slot(copies, alias)
        ref()._parameters[attr] = meta  # type: ignore[union-attr,assignment]
    if mutable is not None:
        buffers = batch_stats.clones(buffers or {})
    if buffers:
        _set_buffers(copies, modules, buffers)
        # A unit runs isolated on its arguments and its own parameters: one that could read a
        # differentiated buffer runs in the transform's graph instead.
        state.isolate = not _differentiated(buffers)

    written_ok = set(buffers) if mutable is not None and buffers else set()
    if mutable == "sync":  # before the units' forwards, which wrap it
        batch_stats.install_sync(copies, written_ok, mesh, data_axes)
    by_path: dict[str, list[ModuleWrapper]] = {}
    for path, wrapper in wrappers:  # inner wrappers first (tensor-parallel styles)
        by_path.setdefault(path, []).append(wrapper)
    for path in {*by_path, *layout.order}:
        module = copies[path]
        unit = (
            functools.partial(_unit_forward, state, slots, path) if path in state.position else None
        )
        base = module.__dict__.get("forward")
        module.__dict__["forward"] = _Forward(module, base, by_path.get(path, ()), unit)

    versions = _buffer_versions(copies, written_ok)
    root = state.root_call()
    try:
        if root is not None:
            _install(state, slots[""], _gather(root))
        state.prefetch_forward(-1)
        if root is not None:
            state.note_compute("", "forward")
        mp = policy.mixed_precision
        if mp.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        out = copies[""](*args, **kwargs)
    finally:
        state.drop_prefetches()  # issued ahead for a call that did not come
    _refuse_buffer_writes(_written(versions), copies)
    if policy.mixed_precision.output_dtype is not None:
        out = cast_floating(out, policy.mixed_precision.output_dtype)
    if policy.reshard_after_forward and root is not None:
        root.free("forward")
        # The root's backward starts first, with the loss's backward temporaries (as large as
        # the logits) alive: it prefetches nothing, as FSDP2's does not; the last call's own
        # hook gathers it once the head's backward has freed them.
        hook = state.backward_hook(root, len(state.calls), prefetch=False)
        out, root.hooked = attach(PreBackward, out, hook)
    if state.isolate:
        out = _fence_outputs(out)
    if mutable is not None:
        new = batch_stats.collect(copies, buffers or {})
        if mutable == "per_rank":
            new = batch_stats.from_first_data_rank(new, mesh, data_axes, ctx.simulated)
        return out, new
    return out


def _gather(call: Call) -> list[torch.Tensor]:
    """The call's unit gathered (its backward reduce-scatters: :class:`UnitGather`)."""
    return list(UnitGather.apply(call, *call.unit.shards))


def _unit_forward(
    state: CallState,
    slots: dict[str, list[list[Slot]]],
    name: str,
    inner: Callable[..., Any],
    *a: Any,
    **kw: Any,
) -> Any:
    """Unit ``name``'s module runs: gather it, prefetch the next, run ``inner`` with the
    gathered parameters installed on the module copies, free them after (if asked)."""
    policy = state.ctx.policy
    ckpt = policy.activation_checkpointing
    use_ckpt = ckpt(name) if callable(ckpt) else bool(ckpt)
    call = state.begin(name)
    unit = call.unit
    if not unit.differentiated and unit.layout.rounds:
        # No gather backward will free this unit's parameters after its backward.
        (a, kw), _ = attach(PostBackward, (a, kw), lambda: call.free("backward"))
    tensors = _gather(call)
    state.prefetch_forward(state.position[name])
    state.note_compute(name, "forward")
    mp = policy.mixed_precision
    if mp.cast_forward_inputs:
        a, kw = cast_floating((a, kw), mp.param_dtype)
    where = slots[name]
    placeholders = state.layout.placeholders
    # A unit whose code reads nothing differentiated but its arguments and its own
    # parameters runs (or recomputes, if checkpointed) with plain autograd: see Isolate.
    plain = state.isolate and name in state.layout.self_contained
    if use_ckpt:
        out = _checkpointed(
            state, call, inner, where, tensors, unit.layout, placeholders, a, kw, plain
        )
    elif plain and _differentiated((tensors, a, kw)):
        out = _isolated(state, call, inner, where, tensors, unit.layout, placeholders, a, kw)
    else:
        _install(state, where, tensors)
        try:
            out = inner(*a, **kw)
        finally:
            state.installed.pop()
            _restore(where, unit.layout, placeholders)
    if policy.reshard_after_forward:
        call.free("forward")
        out, call.hooked = attach(PreBackward, out, state.backward_hook(call, call.position))
    if plain:
        out = _fence_outputs(out)
    # Modules that run after this call read the parameters installed around it through new
    # fences: a fence's backward runs when autograd reaches its creation order, so one made
    # before this call would hold its gradient (and history) until this call's backward.
    for installed in state.installed:
        _set(*installed, fence=True)
    return out


def _fence_outputs(out: Any) -> Any:
    """An isolated unit's output, each differentiated tensor through a :class:`GradFence`.

    The output's gradient comes from code that runs in the transform's graph (the caller's
    loss, the root's head), whose history it holds: the fence hands it on as a plain tensor
    before the unit's backward (its gathers included) starts, so that history (the logits'
    gradient, say) is freed then, not when the unit's backward is done.
    """
    leaves, treedef = flatten(out)
    if not any(_transformed(x) and x.requires_grad for x in leaves):
        return out
    fenced = [GradFence.apply(x) if _transformed(x) and x.requires_grad else x for x in leaves]
    return torch_pytree.tree_unflatten(fenced, treedef)


def _install(state: CallState, where: list[list[Slot]], tensors: list[torch.Tensor]) -> None:
    """Install a call's gathered parameters for the module code around the units inside it
    (the root's, or an enclosing unit's), each alias through a :class:`GradFence`."""
    _set(where, tensors, fence=True)
    state.installed.append((where, tensors))


def _differentiated(tree: Any) -> bool:
    """Whether ``torch.func`` differentiates a tensor of ``tree``."""
    return any(x.requires_grad for x in flatten(tree)[0] if _transformed(x))


def _isolated(
    state: CallState,
    call: Call,
    inner: Callable[..., Any],
    where: list[list[Slot]],
    params: list[torch.Tensor],
    up: UnitLayout,
    placeholders: dict[str, torch.Tensor],
    args: Any,
    kwargs: Any,
) -> Any:
    """A unit call under ``torch.func``, run with its own plain autograd graph
    (:class:`Isolate`: its backward frees the unit's activations op by op)."""
    leaves, treedef = flatten((list(params), args, kwargs))

    def fn(*flat: Any) -> Any:
        ps, a, kw = torch_pytree.tree_unflatten(list(flat), treedef)
        return _run_with(where, ps, up, placeholders, inner, a, kw)

    diff = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    job = Isolated(fn, diff, call, len(params))
    return job.output(Isolate.apply(job, *leaves))


def _run_with(
    where: list[list[Slot]],
    params: list[torch.Tensor],
    up: UnitLayout,
    placeholders: dict[str, torch.Tensor],
    inner: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    """``inner(*args, **kwargs)`` with ``params`` installed in their slots, placeholders after."""
    _set(where, params)
    try:
        return inner(*args, **kwargs)
    finally:
        _restore(where, up, placeholders)


def _restore(
    where: list[list[Slot]], up: UnitLayout, placeholders: dict[str, torch.Tensor]
) -> None:
    for aliases, slots in zip(up.aliases, where):
        for alias, (ref, attr) in zip(aliases, slots):
            module = ref()
            if module is not None:
                module._parameters[attr] = placeholders[alias]  # type: ignore[assignment]


def _checkpointed(
    state: CallState,
    call: Call,
    inner: Callable[..., Any],
    where: list[list[Slot]],
    params: list[torch.Tensor],
    up: UnitLayout,
    placeholders: dict[str, torch.Tensor],
    args: Any,
    kwargs: Any,
    plain: bool,
) -> Any:
    leaves, treedef = flatten((list(params), args, kwargs))

    def run(ps: list[torch.Tensor], a: Any, kw: Any) -> Any:
        state.checkpointing += 1  # its forward, or its recompute in backward
        try:
            return _run_with(where, ps, up, placeholders, inner, a, kw)
        finally:
            state.checkpointing -= 1

    def fn(*flat: Any) -> Any:  # the recompute: rebuilt from the leaves
        return run(*torch_pytree.tree_unflatten(list(flat), treedef))

    unit = (call, len(params)) if plain else None
    replay = Replay(fn, lambda: run(list(params), args, kwargs), plain=plain, unit=unit)
    return replay.output(Checkpoint.apply(replay, *leaves))


def _recompute_with_own_params(copies: dict[str, nn.Module], state: CallState) -> None:
    """Hugging Face gradient checkpointing (``self._gradient_checkpointing_func(partial(
    forward, self), ...)``, i.e. ``torch.utils.checkpoint``) recomputes a layer in backward,
    when the copies hold placeholders again: on the copies (never on the user's module), its
    checkpoint function runs the recompute with the parameters the layer had in forward.
    Inside a unit that the policy checkpoints (``state.checkpointing``), it runs the layer
    plainly: a Hugging Face checkpoint there would only recompute again, and torch's cannot
    run inside the recompute."""
    for c in {id(c): c for c in copies.values()}.values():
        func = c.__dict__.get("_gradient_checkpointing_func")
        if callable(func):
            c.__dict__["_gradient_checkpointing_func"] = functools.partial(
                _checkpoint_with_params, state, func, weakref.ref(c)
            )


_CHECKPOINT_OPTIONS = frozenset(
    {
        "use_reentrant",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
    }
)


def _checkpoint_with_params(
    state: CallState,
    checkpoint: Callable[..., Any],
    owner: weakref.ReferenceType[nn.Module],
    function: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    if state.checkpointing:
        return function(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_OPTIONS})
    module = owner()
    held = [(m, dict(m._parameters)) for m in module.modules()] if module is not None else []
    # The forward's context variables (e.g. a context-parallel sequence split), which the
    # recompute in backward runs in too.
    context = contextvars.copy_context()

    def with_params(*a: Any, **kw: Any) -> Any:
        now = [(m, dict(m._parameters)) for m, _ in held]
        for m, params in held:
            m._parameters.update(params)
        try:
            return context.copy().run(function, *a, **kw)
        finally:
            for m, params in now:
                m._parameters.update(params)

    return checkpoint(with_params, *args, **kwargs)


def _set_buffers(
    copies: dict[str, nn.Module],
    modules: Sequence[tuple[str, nn.Module]],
    buffers: dict[str, torch.Tensor],
) -> None:
    for name, t in buffers.items():
        path, _, attr = name.rpartition(".")
        module = copies.get(path)
        if module is None or attr not in module._buffers:
            known = [
                f"{p}.{n}" if p else n
                for p, m in modules
                for n, b in m._buffers.items()
                if b is not None
            ]
            raise ValueError(
                f"FSDP.apply(buffers=...): {name!r} is not a buffer of the module; its buffers "
                f"are {known[:8]}."
            )
        module._buffers[attr] = t


def _buffer_versions(
    copies: dict[str, nn.Module], written_ok: set[str]
) -> dict[str, tuple[torch.Tensor, int]]:
    """Each buffer the call's modules hold, by key path, with its version counter, but those
    in ``written_ok`` (the call's own clones, under ``mutable=``).

    A BatchNorm layer that would update its running statistics is refused first, before the
    forward writes them (its kernel writes them without bumping their versions); any other
    in-place write shows in the versions after the forward.
    """
    for path, module in copies.items():
        if _updates_running_stats(module):
            key = f"{path}.running_mean" if path else "running_mean"
            if key not in written_ok:
                _refuse_buffer_writes([(key, module.running_mean)], copies)
    found: dict[str, tuple[torch.Tensor, int]] = {}
    seen: set[int] = set()
    for path, module in copies.items():
        for name, t in module._buffers.items():
            key = f"{path}.{name}" if path else name
            if t is None or id(t) in seen or t.is_inference() or key in written_ok:
                continue  # (an inference tensor has no version counter)
            seen.add(id(t))
            found[key] = (t, t._version)
    return found


def _updates_running_stats(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and module.training
        and module.running_mean is not None
    )


def _written(versions: dict[str, tuple[torch.Tensor, int]]) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, (t, v) in versions.items() if t._version != v]


def _refuse_buffer_writes(
    written: list[tuple[str, torch.Tensor]], copies: dict[str, nn.Module]
) -> None:
    """Raise if the forward writes a buffer in place (BatchNorm's running statistics in training
    mode): the write would change the caller's module (or ``buffers=``), and every rank would
    keep its own value, outside the training state and its checkpoints."""
    if not written:
        return
    key, t = written[0]
    owner = type(copies[key.rpartition(".")[0]]).__name__
    others = (
        f" (and {len(written) - 1} more: {[k for k, _ in written[1:4]]})" if written[1:] else ""
    )
    raise ValueError(
        f"FSDP.apply: the forward writes the buffer {key!r} of {owner} (shape "
        f"{tuple(t.shape)}, {t.dtype}) in place{others}, as BatchNorm's running statistics do "
        f"in training mode. Outside mutable= the write would change your module, each rank "
        f"would keep its own value, and checkpoints would not hold it. Carry the buffers as "
        f"state: out, new_buffers = sharded_model.apply(params, x, buffers=buffers, "
        f"mutable='sync') (or mutable='per_rank'; TrainState(buffers=...) in train_step). Or "
        f"build the layer with track_running_stats=False (batch statistics, no buffers), freeze "
        f"it with layer.eval() before calling (its running statistics as they are), or use "
        f"LayerNorm or GroupNorm."
    )
