"""Direct preference optimisation's loss, as TRL 1.16's ``DPOTrainer`` computes it.

The policy's and the frozen reference's summed log-probabilities of each pair's chosen and
rejected completions (:func:`~functional_fsdp.sequence_logps`) give the log-ratios
``chosen_logps - ref_chosen_logps`` and ``rejected_logps - ref_rejected_logps``; their
difference ``delta`` is scored by ``loss_type``. The loss is the mean over pairs, returned as
``(sum, count)`` so that the step's loss is the mean over every pair of the global batch;
TRL's logged metrics come back as auxiliary outputs (``train_step(has_aux=True)``), each the
mean over the global batch's pairs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._loss import SumCount

LOSS_TYPES = ("sigmoid", "robust")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[SumCount, dict[str, SumCount]]:
    """TRL's DPO loss and metrics from the policy's and the reference's log-probabilities.

    ``loss_type`` and ``label_smoothing`` mean what they mean in TRL 1.16's ``DPOConfig``:
    ``"sigmoid"`` (the DPO paper's ``-logsigmoid(beta * delta)``; TRL ignores
    ``label_smoothing`` there, so a non-zero value is refused here) and ``"robust"`` (robust
    DPO, ``label_smoothing`` the probability that a preference is flipped, in ``[0, 0.5)``).

    Args:
        chosen_logps: ``[pairs]``, the policy's summed log-probabilities of the chosen
            completions (differentiated).
        rejected_logps: ``[pairs]``, of the rejected ones.
        ref_chosen_logps: ``[pairs]``, the frozen reference's, of the chosen completions
            (detached here).
        ref_rejected_logps: ``[pairs]``, the reference's, of the rejected ones.
        beta: how far the policy may move from the reference (TRL's ``beta``).
        loss_type: ``"sigmoid"`` or ``"robust"``.
        label_smoothing: ``"robust"``'s flip probability.

    Returns:
        ``(loss, metrics)``: ``loss`` a :class:`~functional_fsdp.SumCount` of the pairs'
        losses, and TRL's metrics (``rewards/chosen``, ``rewards/rejected``,
        ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``),
        each a ``SumCount`` over the pairs, so that the step reports their global means.
        Return both from ``loss_fn`` with ``train_step(..., has_aux=True)``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> logps = torch.tensor([-5.0, -6.0]), torch.tensor([-7.0, -6.5])
        >>> ref = torch.tensor([-5.5, -6.0]), torch.tensor([-6.0, -6.0])
        >>> loss, metrics = ff.dpo_loss(*logps, *ref, beta=0.1)
        >>> delta = (logps[0] - ref[0]) - (logps[1] - ref[1])
        >>> torch.allclose(loss.sum / loss.count, -torch.nn.functional.logsigmoid(0.1 * delta).mean())
        True
        >>> metrics["rewards/accuracies"].sum / metrics["rewards/accuracies"].count
        tensor(1.)
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"dpo_loss: loss_type {loss_type!r} is not implemented; the ones here are "
            f"{list(LOSS_TYPES)} (TRL's names and formulas)."
        )
    if loss_type == "sigmoid" and label_smoothing != 0.0:
        raise ValueError(
            f"dpo_loss: label_smoothing={label_smoothing} with loss_type='sigmoid'. TRL 1.16's "
            f"'sigmoid' loss ignores label_smoothing; robust DPO (loss_type='robust') is the one "
            f"that reads it, as the probability that a preference label is flipped."
        )
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"dpo_loss: loss_type='robust' needs 0 <= label_smoothing < 0.5 (the probability "
            f"that a preference is flipped), got {label_smoothing}."
        )
    shapes = {tuple(t.shape) for t in (chosen_logps, rejected_logps, ref_chosen_logps)}
    shapes.add(tuple(ref_rejected_logps.shape))
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(
            f"dpo_loss: the four log-probabilities must be 1-D tensors of one length (one per "
            f"pair), got shapes {sorted(shapes)}."
        )
    chosen_ratio = chosen_logps - ref_chosen_logps.detach()
    rejected_ratio = rejected_logps - ref_rejected_logps.detach()
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    else:
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    pairs = losses.numel()
    chosen_rewards = beta * chosen_ratio.detach()
    rejected_rewards = beta * rejected_ratio.detach()

    def mean(x: torch.Tensor) -> SumCount:
        return SumCount(x.detach().float().sum(), pairs)

    metrics: dict[str, Any] = {
        "rewards/chosen": mean(chosen_rewards),
        "rewards/rejected": mean(rejected_rewards),
        "rewards/accuracies": mean((chosen_rewards > rejected_rewards).float()),
        "rewards/margins": mean(chosen_rewards - rejected_rewards),
        "logps/chosen": mean(chosen_logps),
        "logps/rejected": mean(rejected_logps),
    }
    return SumCount(losses.sum(), pairs), metrics
