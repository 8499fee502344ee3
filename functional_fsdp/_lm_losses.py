"""Causal language-model losses in Hugging Face's label convention.

**The convention** (transformers' ``labels=``, TRL, ``DataCollatorForLanguageModeling``,
``DataCollatorWithFlattening``): ``labels`` has the shape of ``input_ids`` and is aligned
with it, ``labels[..., t]`` being the token at position ``t`` itself, or ``-100`` where the
token does not count (prompt, padding, the first token of each packed document). The loss
shifts: the logits at ``t`` predict ``labels[..., t + 1]``, as transformers'
``ForCausalLMLoss`` does; a packed row's labels are ``-100`` at each document's first token, so
no document predicts the next one's first token.

* :func:`causal_lm_loss` returns the summed cross entropy and its count
  (:class:`~functional_fsdp.SumCount`), so that ``train_step`` divides the global sum by the
  global count: the token mean of the global batch, Trainer's ``num_items_in_batch``.
* :func:`sequence_logps` returns each row's summed log-probability of its labelled tokens (what
  DPO compares).

Both are vocabulary-parallel when given the tensor-parallel ``mesh``: the logits are then this
rank's block of the vocabulary (a plan's ``loss_parallel=True``) and the full vocabulary is
never gathered (:func:`~functional_fsdp.vocab_parallel_cross_entropy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ._loss import SumCount
from .tp.ops import vocab_parallel_cross_entropy


def _shifted(
    who: str,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
) -> torch.Tensor:
    """The targets of each position: ``labels`` moved one to the left, ``ignore_index`` last."""
    if (labels is None) == (shift_labels is None):
        raise ValueError(
            f"{who}: pass labels (aligned with input_ids, as transformers' labels=) or "
            f"shift_labels (already shifted, as transformers' shift_labels=), not "
            f"{'both' if labels is not None else 'neither'}."
        )
    given = labels if labels is not None else shift_labels
    assert given is not None
    if tuple(given.shape) != tuple(logits.shape[:-1]):
        name = "labels" if labels is not None else "shift_labels"
        raise ValueError(
            f"{who}: {name} has shape {tuple(given.shape)} but the logits {tuple(logits.shape)}; "
            f"they must agree but for the vocabulary. Labels follow Hugging Face's convention: "
            f"aligned with input_ids (labels = input_ids, -100 where a token does not count), "
            f"and the loss shifts them. Labels already shifted by one (targets = ids[:, 1:]) "
            f"fed with logits of ids[:, :-1] go through shift_labels=."
        )
    if shift_labels is not None:
        return shift_labels
    assert labels is not None
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _token_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    mesh: DeviceMesh | None,
    axis: str,
    reduction: str,
) -> torch.Tensor:
    if mesh is not None:
        return vocab_parallel_cross_entropy(
            logits, targets, mesh, axis, ignore_index=ignore_index, reduction=reduction
        )  # type: ignore[arg-type]
    out = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return out if reduction == "sum" else out.reshape(targets.shape)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    mesh: DeviceMesh | None = None,
    axis: str = "tp",
) -> SumCount:
    """The next-token cross entropy of a causal LM as ``(sum, count)``, with labels aligned
    with ``input_ids`` (Hugging Face's convention): the logits at ``t`` predict
    ``labels[..., t + 1]``.

    ``sum / count`` is transformers' own ``model(input_ids, labels=labels).loss``; returned
    from ``loss_fn``, the step divides the global sum by the global count (the token mean of
    the global batch, as Trainer computes it).

    Args:
        logits: ``[..., seq, vocab]`` (computed in float32), or ``[..., seq, vocab / tp]``
            with ``mesh``.
        labels: ``[..., seq]``, aligned with ``input_ids``; ``ignore_index`` where a token
            does not count. The loss shifts them.
        shift_labels: instead of ``labels``, targets already shifted (``shift_labels[..., t]``
            is what the logits at ``t`` predict), as transformers' ``shift_labels=``.
        ignore_index: the label of tokens that do not count.
        mesh: the mesh, when the logits are split over the vocabulary along ``axis``
            (tensor parallel, ``loss_parallel=True``): vocabulary-parallel cross entropy.
        axis: the tensor-parallel axis.

    Returns:
        ``SumCount(sum, count)``: the summed cross entropy (a 0-dim float32 tensor) and the
        number of counted targets (a 0-dim int64 tensor).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> logits = torch.randn(1, 4, 10)
        >>> labels = torch.tensor([[-100, 3, 5, -100]])      # aligned with input_ids
        >>> loss = ff.causal_lm_loss(logits, labels)
        >>> loss.count                                       # positions 0 and 1 predict 3 and 5
        tensor(2)
        >>> reference = torch.nn.functional.cross_entropy(logits[0, :2], torch.tensor([3, 5]))
        >>> torch.allclose(loss.sum / loss.count, reference)
        True
    """
    targets = _shifted("causal_lm_loss", logits, labels, shift_labels, ignore_index)
    total = _token_losses(logits, targets, ignore_index, mesh, axis, "sum")
    return SumCount(total, (targets != ignore_index).sum())


def sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    mesh: DeviceMesh | None = None,
    axis: str = "tp",
) -> torch.Tensor:
    """Each sequence's summed log-probability of its labelled tokens (labels aligned with
    ``input_ids``, shifted as :func:`causal_lm_loss` shifts them): what DPO compares, as TRL's
    trainers compute it (``per_token_logps.sum(-1)`` over the completion).

    Args:
        logits: ``[batch, seq, vocab]`` (or ``[batch, seq, vocab / tp]`` with ``mesh``).
        labels: ``[batch, seq]``, aligned with ``input_ids``, ``ignore_index`` where a token
            does not count (the prompt, padding).
        shift_labels: instead of ``labels``, targets already shifted.
        ignore_index: the label of tokens that do not count.
        mesh: the mesh, when the logits are split over the vocabulary along ``axis``.
        axis: the tensor-parallel axis.

    Returns:
        ``[batch]`` float32 log-probabilities.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> logits = torch.randn(2, 3, 5)
        >>> labels = torch.tensor([[-100, 1, 2], [-100, 4, -100]])
        >>> logps = ff.sequence_logps(logits, labels)
        >>> ref = logits.log_softmax(-1)[0, 0, 1] + logits.log_softmax(-1)[0, 1, 2]
        >>> torch.allclose(logps[0], ref)
        True
    """
    targets = _shifted("sequence_logps", logits, labels, shift_labels, ignore_index)
    losses = _token_losses(logits, targets, ignore_index, mesh, axis, "none")
    return -losses.reshape(targets.shape).flatten(1).sum(-1)
