"""The communication of one training step, counted on the real engine (private).

:func:`step_comms` builds the configuration with the public API (:func:`functional_fsdp.fsdp`,
:func:`functional_fsdp.tensor_parallel`, :meth:`TrainState.create
<functional_fsdp.TrainState.create>`, :func:`functional_fsdp.train_step`), runs one step on a
``shapes_only`` simulated mesh of the same axis sizes (rank 0 on ``meta`` tensors: no values,
no memory), and returns what :func:`functional_fsdp.count_comms` recorded. So the planner's
collectives are the engine's, by construction: whatever the step issues (a norm all-reduce
more or less, a new bucket) shows in the plan.

A model with many identical units (the blocks of a transformer) is run shortened, as the same
model with 2 and with 3 of those blocks (per-call shallow copies; the user's module is never
touched). Every count and byte figure of a step is affine in the number of identical blocks
(each block adds its own collectives; the step's bucketed collectives grow by its bytes), so
the full model's figures are ``f(2) + (L - 2) * (f(3) - f(2))``: exact, for the cost of a
3-block model. Two blocks are the smallest model with a first and a last block that differ.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._modules import copy_tree as _copy_tree
from ..distributed import process
from ..distributed.collectives import count_comms
from ..distributed.simulate import simulated_mesh
from ..fsdp.api import fsdp
from ..optim.transforms import identity
from ..tp.plan import tensor_parallel
from ..train import TrainState, train_step

Key = tuple[str, str, str]  # (kind, axis, source)
Counts = dict[Key, tuple[int, int]]  # {key: (count, bytes)}
SHORT = (2, 3)  # blocks in the two shortened runs


def copy_tree(model: nn.Module) -> dict[str, nn.Module]:
    """Shallow copies of ``model``'s module tree, ``{path: copy}`` for every path (see
    :func:`functional_fsdp._modules.copy_tree`)."""
    return _copy_tree(model.named_modules(remove_duplicate=False))


def _signature(module: nn.Module, prefix: str, per_name: Callable[[str], Any]) -> Any:
    """What makes two blocks interchangeable for a step: type, parameter and buffer shapes,
    dtypes, ``requires_grad`` and whatever ``per_name`` says of each parameter (its spec,
    whether it trains), keyed by the name below the block."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad, per_name(f"{prefix}.{n}"))
        for n, p in module.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    modules = tuple((n, type(m)) for n, m in module.named_modules())
    return (type(module), params, buffers, modules)


def repeated_blocks(
    model: nn.Module,
    units: Sequence[str],
    per_name: Callable[[str], Any],
    per_unit: Callable[[str], Any],
) -> tuple[str, int] | None:
    """``(path, n)`` of the longest ``ModuleList``/``Sequential`` of more than 3 units that a
    step treats alike (see :func:`_signature`; ``per_unit`` says how the policy treats a
    unit, e.g. whether it is checkpointed), or ``None``."""
    unit_set = set(units)
    best: tuple[str, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m._modules) <= max(SHORT):
            continue
        kids = [f"{path}.{k}" if path else k for k in m._modules]
        if not all(k in unit_set for k in kids):
            continue
        sigs = {
            (_signature(child, kid, per_name), per_unit(kid))
            for kid, child in zip(kids, m._modules.values())
        }
        if len(sigs) == 1 and (best is None or len(kids) > best[1]):
            best = (path, len(kids))
    return best


def shortened(model: nn.Module, path: str, keep: int) -> nn.Module:
    """A copy of ``model`` (see :func:`copy_tree`) whose container at ``path`` holds only
    its first ``keep`` blocks."""
    copies = copy_tree(model)
    blocks = copies[path]
    blocks._modules = dict(list(blocks._modules.items())[:keep])
    return copies[""]


def extrapolate(short: Sequence[Counts], blocks: int) -> Counts:
    """The figures of ``blocks`` blocks from those of :data:`SHORT` blocks (affine in the
    number of blocks)."""
    a, b = short
    out: Counts = {}
    for key in {*a, *b}:
        (ca, ba), (cb, bb) = a.get(key, (0, 0)), b.get(key, (0, 0))
        n = blocks - SHORT[0]
        count, nbytes = ca + n * (cb - ca), ba + n * (bb - ba)
        if count:
            out[key] = (count, nbytes)
    return out


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _first_tensor(tree: Any) -> torch.Tensor:
    import torch.utils._pytree as torch_pytree

    for leaf in torch_pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf
    if hasattr(tree, "logits"):
        return tree.logits
    raise ValueError(
        f"ff.plan(loss_fn=None): the model returned {type(tree).__name__}, with no tensor to "
        f"take a loss of; pass loss_fn=callable(output) -> scalar."
    )


def count_step(
    model: nn.Module,
    sizes: Mapping[str, int],
    batch: tuple[tuple[Any, ...], dict[str, Any]],
    fsdp_kwargs: dict[str, Any],
    tp: tuple[Any, str],
    step_kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    source: Callable[[str, str, int, str | None], str],
) -> Counts:
    """One real ``train_step`` of ``model`` on a shapes-only mesh of ``sizes``: its
    collectives as ``{(kind, axis, source(kind, axis, bytes, label)): (count, bytes)}``.

    ``batch`` is this rank's share, as ``(args, kwargs)`` of the model's call; ``fsdp_kwargs``
    go to :func:`functional_fsdp.fsdp`, ``tp`` is ``(tp_plan or None, tp_axis)`` and
    ``step_kwargs`` hold ``optimizer`` (``None``: none), ``opt_specs``, ``accumulate`` and
    ``accumulate_mode``.
    """
    kwargs = dict(fsdp_kwargs)
    tp_plan, tp_axis = tp
    optimizer, opt_specs = step_kwargs["optimizer"], step_kwargs["opt_specs"]
    with simulated_mesh(dict(sizes), shapes_only=True) as mesh:
        if tp_plan is not None:
            # The planner prices the plan; checking it is the training run's first call's job.
            layout = tensor_parallel(model, mesh, tp_plan, axis=tp_axis, verify=False)
            if kwargs.get("specs") is None:
                kwargs["specs"] = layout.specs
            kwargs["wrappers"] = layout.wrappers
        sharded = fsdp(model, mesh, **kwargs)
        args, kw = batch
        if "use_cache" not in kw and "use_cache" in inspect.signature(model.forward).parameters:
            kw = {**kw, "use_cache": False}  # a training step keeps no key/value cache

        def loss(params: Any, b: Any) -> torch.Tensor:
            out = sharded.apply(params, *b[0], **b[1])
            return loss_fn(out) if loss_fn is not None else _first_tensor(out).float().mean()

        opt = optimizer if optimizer is not None else identity()
        step = train_step(
            loss,
            opt,
            model=sharded,
            batch="local",
            accumulate=step_kwargs["accumulate"],
            accumulate_mode=step_kwargs["accumulate_mode"],
        )
        state = TrainState.create(sharded.shard(), opt, trainable=sharded, opt_specs=opt_specs)
        with count_comms() as counter:
            step(state, (tuple(map(_meta, args)), {k: _meta(v) for k, v in kw.items()}))
    out: dict[Key, list[int]] = {}
    for r in counter.records:
        key = (r.kind, r.axis, source(r.kind, r.axis, r.bytes, r.label))
        slot = out.setdefault(key, [0, 0])
        slot[0] += 1
        slot[1] += r.bytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def check_no_process_group() -> None:
    """The shapes-only mesh makes its own (fake) process group: none may exist yet."""
    if process.is_initialized():
        raise RuntimeError(
            "ff.plan counts the collectives of one real train_step on a shapes-only simulated "
            "mesh, which needs its own (fake) process group, but one already exists (a "
            "torchrun job, or inside ff.simulated_mesh). Plan before "
            "torch.distributed.init_process_group (or before the simulated mesh starts), or in "
            "a separate process: python -m functional_fsdp.planner."
        )
