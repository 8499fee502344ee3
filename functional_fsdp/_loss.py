"""What a step makes of ``loss_fn``'s return value (private to :mod:`functional_fsdp.train`).

``loss_fn`` returns a scalar (the mean loss of its batch), or a pair ``(sum, count)``
(:class:`SumCount`), with ``train_step(has_aux=True)`` followed by a pytree of auxiliary
tensors. The step differentiates the scalar or the sum and sums the rest over its
micro-batches (:class:`Outputs`); then, over the data ranks, in one all-reduce
(:func:`reduce_outputs`):

* a scalar loss becomes the mean over ranks and micro-batches (what DDP and FSDP2 give);
* a ``(sum, count)`` loss becomes the global sum over the global count (one process's token
  mean of the global batch, Hugging Face Trainer's ``num_items_in_batch``), and its
  gradients are divided by the global count instead of by what the gradient rule divided
  them by (:func:`to_token_mean`);
* auxiliary :class:`SumCount` values become their global sum over their global count, other
  auxiliary tensors their mean over ranks and micro-batches.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import optree
import torch

from ._tree import NAMESPACE
from .distributed import collectives as C
from .distributed.mesh import axis_sizes
from .fsdp.api import FSDP
from .fsdp.gradients import mean_divisor


def _short_repr(x: Any, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


class SumCount(typing.NamedTuple):
    """A loss or an auxiliary value given as a sum and what it counts, so that the step can
    divide the global sum by the global count (over data ranks and micro-batches).

    ``loss_fn`` may return one for its loss (a plain ``(sum, count)`` tuple means the
    same), and put some in its auxiliary outputs (``train_step(has_aux=True)``), which then
    reduce like the loss instead of being averaged.

    Attributes:
        sum: a 0-dim floating tensor, e.g. the summed cross entropy of the counted tokens
            (differentiated, for the loss).
        count: what ``sum`` is a sum over: a 0-dim tensor or a number, e.g.
            ``(labels != -100).sum()``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> token_losses = torch.tensor([1.0, 2.0, 0.0])
        >>> labels = torch.tensor([5, 7, -100])
        >>> mask = labels != -100
        >>> ff.SumCount(token_losses[mask].sum(), mask.sum())
        SumCount(sum=tensor(3.), count=tensor(2))
    """

    sum: torch.Tensor
    count: torch.Tensor | int | float


def check_loss(loss: Any, has_aux: bool = False) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        which = " as the loss of its (loss, aux)" if has_aux else ""
        raise ValueError(
            f"train_step: loss_fn must return a scalar tensor (the mean loss of this rank's "
            f"batch) or a pair (sum, count){which}, got {shape}. Reduce it, e.g. return "
            f"loss.mean(), or return (token_losses.sum(), (labels != -100).sum()) for the "
            f"token mean of the global batch."
        )
    return loss


def loss_parts(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any, Any]:
    """``loss_fn``'s return value as (the value to differentiate, its count or ``None``,
    the auxiliary outputs or ``None``)."""
    aux = None
    if has_aux:
        if not isinstance(out, tuple) or len(out) != 2:
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            raise TypeError(
                f"train_step(has_aux=True): loss_fn must return (loss, aux), where loss is a "
                f"scalar tensor or a pair (sum, count) and aux a pytree of tensors; got {got}."
            )
        out, aux = out
    if not isinstance(out, tuple):
        return check_loss(out, has_aux), None, aux
    if len(out) != 2:
        raise ValueError(
            f"train_step: loss_fn returned a tuple of {len(out)}; a loss is a scalar tensor "
            f"or a pair (sum, count)"
            f"{'' if has_aux else ', and (loss, aux) needs train_step(..., has_aux=True)'}."
        )
    total, count = out
    if not has_aux and not _is_count(count):
        raise ValueError(
            f"train_step: loss_fn returned a pair whose second value is "
            f"{_describe(count)}, not a count. If it is auxiliary output, build the step "
            f"with train_step(..., has_aux=True) and return (loss, aux); a loss given as a "
            f"sum returns (sum, count), count a 0-dim tensor or a number."
        )
    if not (isinstance(total, torch.Tensor) and total.ndim == 0 and total.is_floating_point()):
        raise ValueError(
            f"train_step: the sum of a (sum, count) loss must be a 0-dim floating tensor, got "
            f"{_describe(total)}; e.g. return (token_losses.sum(), (labels != -100).sum())."
        )
    return total, _as_count(count, "the count of a (sum, count) loss"), aux


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({str(x.dtype).removeprefix('torch.')})"
    return f"{type(x).__name__} {_short_repr(x, 40)}"


def _is_count(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and not x.is_complex()
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_count(count: Any, what: str) -> Any:
    """A count: a 0-dim real tensor (detached) or a Python number."""
    if _is_count(count):
        return count.detach() if isinstance(count, torch.Tensor) else count
    raise ValueError(
        f"train_step: {what} must be a 0-dim tensor or a number, got {_describe(count)}; "
        f"e.g. (labels != -100).sum()."
    )


class Outputs(typing.NamedTuple):
    """``loss_fn``'s outputs summed over this rank's micro-batches (detached)."""

    value: torch.Tensor  # the sum of the differentiated values (losses, or sums)
    count: Any  # the sum of the counts of a (sum, count) loss; None for a scalar loss
    aux: Any  # the sum of the auxiliary outputs (SumCount summed part by part); or None
    parts: int  # the number of micro-batches


def reduce_outputs(
    model: FSDP | None, out: Outputs, replicas: Any = None
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """The step's loss, total count and auxiliary outputs, over the data ranks: one
    all-reduce of everything at once (the loss's, which every step spends anyway). With
    ``replicas`` (a :class:`~functional_fsdp.ft.ReplicaGroup`), then summed over the
    step's replica groups: the data ranks of every group alive.

    A scalar loss: the mean over ranks and micro-batches. A ``(sum, count)`` loss: the
    global sum over the global count. Auxiliary values: plain tensors averaged over ranks
    and micro-batches, :class:`SumCount` ones the global sum over the global count.
    """
    ranks = 1
    if model is not None:
        sizes = axis_sizes(model.mesh)
        ranks = math.prod(sizes[a] for a in model.data_axes)
    means = out.parts * ranks  # what a scalar loss's or plain aux's sum is divided by
    if out.count is None and out.aux is None:  # a scalar loss, as DDP and FSDP2 average it
        loss = out.value / out.parts
        if model is not None:
            loss = C.wait(C.raw_all_reduce(loss, model.mesh, model.data_axes, op="mean"))
        if replicas is not None:
            loss = replicas.sum_outputs(loss.reshape(1))[0]
            loss = (loss / replicas.contributors).to(out.value.dtype)
        return loss, None, None
    device = out.value.device

    def flat(x: Any) -> torch.Tensor:
        return torch.as_tensor(x, device=device).detach().to(torch.float64).reshape(-1)

    items, treedef = optree.tree_flatten(out.aux, is_leaf=lambda x: isinstance(x, SumCount))
    parts = [flat(out.value)] + ([] if out.count is None else [flat(out.count)])
    for item in items:
        parts += [flat(item.sum), flat(item.count)] if isinstance(item, SumCount) else [flat(item)]
    total = torch.cat(parts)
    if model is not None:  # one all-reduce (sum) of the loss, the count and every aux value
        total = C.wait(C.raw_all_reduce(total, model.mesh, model.data_axes))
    if replicas is not None:  # a group joining at this step counts nothing (its flag: 0)
        total = replicas.sum_outputs(total)
        means *= replicas.contributors
    dtype = out.value.dtype
    if out.count is None:
        loss, count, at = (total[0] / means).to(dtype), None, 1
    else:
        count = total[1]
        loss, at = (total[0] / count).to(dtype), 2
        kind = out.count.dtype if isinstance(out.count, torch.Tensor) else None
        if (kind is not None and not kind.is_floating_point) or isinstance(out.count, int):
            count = count.round().to(torch.int64)
    values = []
    for item in items:
        if isinstance(item, SumCount):
            n = torch.as_tensor(item.sum).numel()
            s, c = total[at : at + n], total[at + n : at + 2 * n]
            values.append(_like(s / c, item.sum))
            at += 2 * n
        else:
            n = torch.as_tensor(item).numel()
            values.append(_like(total[at : at + n] / means, item))
            at += n
    aux = None if out.aux is None else optree.tree_unflatten(treedef, values)
    return loss, count, aux


def _like(x: torch.Tensor, like: Any) -> torch.Tensor:
    """``x`` in ``like``'s shape, and its dtype where that is floating (else float32)."""
    like = torch.as_tensor(like)
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return x.reshape(like.shape).to(dtype)


def to_token_mean(model: FSDP | None, grads: Any, parts: int, count: torch.Tensor) -> Any:
    """Gradients of a ``(sum, count)`` loss as the step computed them (averaged over the
    micro-batches and divided by the gradient rule's
    :func:`~functional_fsdp.fsdp.gradients.mean_divisor`), divided by the global count
    instead: the gradient of the global sum over the global count."""
    divided = parts
    if model is not None:
        divided *= mean_divisor(axis_sizes(model.mesh), model.data_axes, model.policy)
    scale = (divided / count.to(torch.float64)).to(torch.float32)
    return optree.tree_map(lambda t: t * scale, grads, namespace=NAMESPACE)
