"""Activation memory from one forward on the ``meta`` device (private; the communication
is counted on the real engine, see :mod:`._run`).

:func:`trace_forward` runs the module once on per-call shallow copies of its tree (the user's
module is never touched), with ``meta`` parameters of the shape each rank computes with
(gathered over the data axes, still split over the model axes), on this rank's share of the
batch. Nothing is allocated.

What is measured is what autograd keeps for backward: every tensor saved for backward is seen
through ``torch.autograd.graph.saved_tensors_hooks`` and its *storage* is counted once (a
view keeps its whole storage alive). Parameter storages are left out (they are priced as
gathered parameters). Each storage is charged to the unit running when it was first saved.
For activation checkpointing, a checkpointed unit keeps only the storages of its tensor
inputs instead. ``scaled_dot_product_attention`` is priced as the fused kernels (flash on GPU,
the flash kernel torch uses on CPU) keep it: q, k, v, output and a float32 log-sum-exp.

Units of the same type, parameter shapes and input shapes (the blocks of a transformer) are
run once: later ones replay the first one's figures, so a 80-block model costs one block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

from ..cp.attention import splitting
from ..distributed.simulate import simulated_mesh
from ..tp.styles import (
    ColwiseParallel,
    PrepareInput,
    RowwiseParallel,
    Style,
    VocabParallelEmbedding,
)
from ._run import copy_tree


@dataclasses.dataclass
class Trace:
    """What one meta forward showed.

    Attributes:
        saved: ``{unit: {storage key: bytes}}`` saved for backward while the unit ran
            (``""``: the root unit, ``"<loss>"``: the loss).
        inputs: ``{unit: {storage key: bytes}}`` of each unit's tensor inputs (what a
            checkpointed unit keeps).
        grad_out: ``{unit: bool}``: the unit's output requires grad (so it runs a backward).
    """

    saved: dict[str, dict[Any, int]]
    inputs: dict[str, dict[Any, int]]
    grad_out: dict[str, bool]


@dataclasses.dataclass(frozen=True)
class _Like:
    """A unit output's shape, dtype and requires_grad (a pytree leaf), to replay it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def make(self) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad)


class _FusedAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` as the fused (flash) kernels run it on CPU and GPU:
    saves q, k, v, the output and the float32 log-sum-exp per row, never the ``[s, s]``
    scores (the ``meta`` device would otherwise take the unfused path that keeps them)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:  # type: ignore[override]
        if q.ndim == 4:  # laid out [batch, seq, heads, dim] as the kernels return it, so
            b, h, s, _ = q.shape  # that the usual transpose(1, 2).reshape() is a view
            return q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, mask = inputs
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        saved = [q, k, v, output, lse]
        if isinstance(mask, torch.Tensor):  # a boolean mask is converted for the kernel
            saved.append(mask if mask.is_floating_point() else mask.to(q.dtype))
        ctx.save_for_backward(*saved)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _FusedAttentionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            return _FusedAttention.apply(q, k, v, mask)
        if func in _DATA_DEPENDENT and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            # Data-dependent control flow (e.g. a packed-sequence check) has no answer on
            # meta: take the branch of a true condition (checks such as "every token is
            # valid" or "no packed sequences" hold for a plain batch).
            t = args[0]
            return True if func is torch.Tensor.__bool__ else (0.0 if t.is_floating_point() else 0)
        return func(*args, **kwargs)


_DATA_DEPENDENT = (torch.Tensor.__bool__, torch.Tensor.item)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _leaves(tree: Any) -> list[Any]:
    return torch_pytree.tree_leaves(tree)


def _signature(module: nn.Module, args: Any, kwargs: Any) -> Any:
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()
    )
    leaves = []
    for x in _leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            leaves.append((tuple(x.shape), x.dtype, x.requires_grad))
        elif x is None or isinstance(x, (int, float, bool, str)):
            leaves.append(x)
        else:
            leaves.append(type(x).__name__)
    return (type(module), module.training, params, tuple(leaves))


def _check_style(style: Style) -> None:
    """Raise for a style whose meta forward the trace does not model."""
    if isinstance(style, PrepareInput):
        if style.sequence_dim is not None:
            raise _sequence_parallel(style)
    elif isinstance(style, ColwiseParallel):
        if style.input == "sequence":
            raise _sequence_parallel(style)
    elif isinstance(style, (RowwiseParallel, VocabParallelEmbedding)):
        if style.output != "replicated":
            raise _sequence_parallel(style)
    else:
        raise ValueError(
            f"ff.plan: the tensor-parallel style {style} is not modelled by the planner (it "
            f"prices ColwiseParallel, RowwiseParallel, VocabParallelEmbedding and PrepareInput "
            f"without sequence parallelism). Plan with a plan that uses those styles."
        )


def _sequence_parallel(style: Style) -> ValueError:
    return ValueError(
        f"ff.plan: {style} uses sequence parallelism, which the planner does not model yet; "
        f"plan with the non-sequence-parallel variant (e.g. gpt_plan(cfg, "
        f"sequence_parallel=False)) for an estimate."
    )


def _meta_style_forward(style: Style, module: nn.Module, n: int) -> Callable[..., Any] | None:
    """A meta stand-in for a style whose output shape differs from the plain local forward."""
    if isinstance(style, VocabParallelEmbedding):

        def embedding(ids: torch.Tensor) -> torch.Tensor:
            w = module.weight
            local = ids - ids.new_zeros(1)  # the real lookup: shifted ids and their mask
            inside = (local >= 0) & (local < w.shape[0])
            local = torch.where(inside, local, torch.zeros_like(local))
            return F.embedding(local, w) * inside.unsqueeze(-1).to(w.dtype)

        return embedding
    if isinstance(style, ColwiseParallel) and style.output == "replicated":

        def colwise(x: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            y = F.linear(x, module.weight, module.bias)
            return y.detach().repeat(*([1] * (y.ndim - 1)), n).requires_grad_(y.requires_grad)

        return colwise
    return None


def trace_forward(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    units: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    styles: Mapping[str, Style],
    tp_size: int,
    input_dtype: torch.dtype | None,
    split: tuple[Mapping[str, int], str] | None = None,
) -> Trace:
    """Run ``module`` on ``meta`` with ``params`` (``{alias: meta tensor}``); see the module doc.

    ``split``: ``(mesh sizes, axis)`` where an axis splits the sequence (context
    parallelism). The forward then runs as a rank of that axis runs it, inside the split on
    a shapes-only simulated mesh of those sizes: its attention gathers the keys and values
    of the whole sequence (``meta`` tensors, nothing sent) and keeps them for backward, as
    :func:`functional_fsdp.cp.attention` does in the step."""
    named = tuple(module.named_modules(remove_duplicate=False))
    copies = copy_tree(module)
    for name, t in params.items():
        path, _, attr = name.rpartition(".")
        copies[path]._parameters[attr] = t  # type: ignore[assignment]
    for path, m in named:
        for attr, b in m._buffers.items():
            if b is not None:
                copies[path]._buffers[attr] = b.to("meta")
    param_keys = {_key(t) for t in params.values()}

    trace = Trace({"": {}}, {}, {})
    stack = [""]
    cache: dict[Any, tuple[str, Any, list[int]]] = {}
    replay = [0]
    seen: set[Any] = set()
    alive: list[torch.Tensor] = []  # storage addresses are keys: keep them from being reused

    def install(path: str, fn: Callable[..., Any]) -> None:
        copy = copies[path]
        base = copy.__dict__.get("forward")
        inner = base if base is not None else types.MethodType(type(copy).forward, copy)
        copy.__dict__["forward"] = lambda *a, **kw: fn(inner, *a, **kw)

    def unit_forward(path: str) -> Callable[..., Any]:
        def run(inner: Callable[..., Any], *a: Any, **kw: Any) -> Any:
            tensors = [x for x in _leaves((a, kw)) if isinstance(x, torch.Tensor)]
            alive.extend(tensors)
            ins = [
                (_key(x), x.untyped_storage().nbytes())
                for x in tensors
                if _key(x) not in param_keys
            ]
            in_keys = [k for k, _ in ins]
            trace.inputs[path] = dict(ins)
            sig = _signature(copies[path], a, kw)
            hit = cache.get(sig)
            if hit is not None:  # the same unit again: replay its figures
                first, out_meta, first_in = hit
                replay[0] += 1
                slots = dict(zip(first_in, in_keys))
                trace.saved[path] = {
                    slots.get(k, (path, k)): b for k, b in trace.saved[first].items()
                }
                seen.update(trace.saved[path])
                trace.grad_out[path] = trace.grad_out[first]
                return torch_pytree.tree_map(
                    lambda m: m.make() if isinstance(m, _Like) else m, out_meta
                )
            trace.saved[path] = {}
            stack.append(path)
            try:
                out = inner(*a, **kw)
            finally:
                stack.pop()
            outs = [x for x in _leaves(out) if isinstance(x, torch.Tensor)]
            trace.grad_out[path] = any(x.requires_grad for x in outs)
            cache[sig] = (
                path,
                torch_pytree.tree_map(
                    lambda x: (
                        _Like(tuple(x.shape), x.dtype, x.requires_grad)
                        if isinstance(x, torch.Tensor)
                        else x
                    ),
                    out,
                ),
                in_keys,
            )
            return out

        return run

    def styled(path: str, style: Style) -> Callable[..., Any]:
        _check_style(style)
        stand_in = _meta_style_forward(style, copies[path], tp_size)

        def run(inner: Callable[..., Any], *a: Any, **kw: Any) -> Any:
            return (stand_in or inner)(*a, **kw)

        return run

    for path, style in styles.items():  # inner wrappers first, then the unit's
        install(path, styled(path, style))
    for path in units:
        install(path, unit_forward(path))

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        alive.append(t)
        if k not in param_keys and k not in seen:
            seen.add(k)
            trace.saved.setdefault(stack[-1], {})[k] = t.untyped_storage().nbytes()
        return t

    if input_dtype is not None:
        args, kwargs = torch_pytree.tree_map(
            lambda x: (
                x.to(input_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            ),
            (args, kwargs),
        )
    with contextlib.ExitStack() as scope:
        if split is not None:
            mesh = scope.enter_context(simulated_mesh(dict(split[0]), shapes_only=True))
            scope.enter_context(splitting(mesh, split[1]))
        scope.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        scope.enter_context(_FusedAttentionMode())
        out = copies[""](*args, **kwargs)
        if loss_fn is not None:
            stack.append("<loss>")
            trace.saved["<loss>"] = {}
            loss_fn(out)
    trace.grad_out[""] = any(isinstance(x, torch.Tensor) and x.requires_grad for x in _leaves(out))
    return trace


def lm_loss(output: Any) -> torch.Tensor:
    """The default loss: next-token cross entropy on the logits, in float32.

    ``output`` is the logits ``[batch, seq, vocab]`` or anything with a ``logits`` attribute
    (a ``transformers`` ``ModelOutput``). Targets are zeros (the values do not matter on meta).
    """
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
        raise ValueError(
            f"ff.plan(loss_fn='lm') expects the model to return logits [batch, seq, vocab] (or "
            f"an output with .logits), got {type(output).__name__}; pass loss_fn=callable(output) "
            f"-> scalar, or loss_fn=None to leave the loss out."
        )
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, flat.new_zeros(flat.shape[0], dtype=torch.long))
