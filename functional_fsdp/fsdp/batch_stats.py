"""Buffers as state under :meth:`FSDP.apply(mutable=...) <functional_fsdp.FSDP.apply>` (private).

Flax's ``model.apply(variables, x, mutable=["batch_stats"])``: the forward runs on clones of
the given buffers, installed on the call's module copies, and the call returns their new values;
the caller's module and tensors are never written. Two modes:

* ``"per_rank"``: each rank normalises with the statistics of its own share (BatchNorm's own
  kernel), and the new buffers are data rank 0's, on every rank: torch DDP's behaviour with its
  default ``broadcast_buffers=True``, which broadcasts rank 0's buffers before each forward.
* ``"sync"``: SyncBatchNorm's. A BatchNorm layer in training mode normalises with the mean and
  (biased) variance of the global batch; its running statistics are updated with the global
  mean and unbiased variance, as one process on the global batch updates them. Each rank
  computes its share's count, mean and sum of squared deviations from that mean (two passes,
  so a large mean cancels nothing), one all-gather per data axis brings every rank's three,
  and Chan's parallel formula combines them (torch's SyncBatchNorm combines per-rank means
  and variances the same way). The global sum of squares minus the squared mean, the one-pass
  formula, would lose every digit of the variance to a mean far from zero in float32. The
  gradient flows through the statistics to every rank's inputs (the all-gather's backward, a
  reduce-scatter, sums the incoming gradients, as SyncBatchNorm's does).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import collectives as C
from ..distributed.axes import local_coordinate

MODES = ("per_rank", "sync")


def clones(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The call's own copies of the given buffers (the caller's are never written)."""
    return {k: v.clone() for k, v in buffers.items()}


def collect(copies: dict[str, nn.Module], buffers: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The new value of each given buffer, as the forward left it on the module copies.

    Detached copies: a checkpointed unit that recomputes in backward writes its module copies
    again, not these, and buffers are state, not differentiated values.
    """
    new = {}
    for name in buffers:
        path, _, attr = name.rpartition(".")
        new[name] = copies[path]._buffers[attr].detach().clone()  # type: ignore[union-attr]
    return new


def from_first_data_rank(
    new: dict[str, torch.Tensor], mesh: DeviceMesh, axes: tuple[str, ...], simulated: bool
) -> dict[str, torch.Tensor]:
    """Data rank 0's ``new`` on every rank of its data group (DDP's buffer broadcast).

    One all-reduce per buffer of the value on data rank 0 and zeros elsewhere: adding zeros
    changes no bit, so every rank receives rank 0's values exactly.
    """
    if not axes:
        return new
    if simulated:
        raise ValueError(
            "FSDP.apply(mutable='per_rank') runs on real processes only (its buffers are data "
            "rank 0's, broadcast); on a simulated mesh use mutable='sync'."
        )
    coord = local_coordinate(mesh)
    first = all(coord[a] == 0 for a in axes)
    out = {}
    for k, t in new.items():
        sent = t if first else torch.zeros_like(t)
        out[k] = C.all_reduce(sent, mesh, axes)
    return out


def install_sync(
    copies: dict[str, nn.Module],
    mutable: set[str],
    mesh: DeviceMesh,
    axes: tuple[str, ...],
) -> None:
    """Give every BatchNorm copy whose running statistics are in ``mutable`` the synchronised
    forward (its own forward still runs in evaluation mode or without running statistics)."""
    for path, module in copies.items():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        key = f"{path}.running_mean" if path else "running_mean"
        if module.running_mean is None or key not in mutable:
            continue
        own = module.__dict__.get("forward")
        module.__dict__["forward"] = types.MethodType(_synced_forward(own, mesh, axes), module)


def _synced_forward(own: Any, mesh: DeviceMesh, axes: tuple[str, ...]) -> Any:
    def forward(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return own(x) if own is not None else type(module).forward(module, x)
        module._check_input_dim(x)  # type: ignore[attr-defined]
        return sync_batch_norm(module, x, mesh, axes)

    return forward


def sync_batch_norm(
    module: nn.modules.batchnorm._BatchNorm,
    x: torch.Tensor,
    mesh: DeviceMesh,
    axes: tuple[str, ...],
) -> torch.Tensor:
    """BatchNorm in training mode over the global batch of the data axes; the module copy's
    running statistics are replaced (not written) by their updated values."""
    c = x.shape[1]
    shape = [1, c] + [1] * (x.ndim - 2)
    mean, var, n = global_moments(x, mesh, axes)
    wide = mean.dtype
    y = (x.to(wide) - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    if module.weight is not None:
        y = y * module.weight.to(wide).view(shape) + module.bias.to(wide).view(shape)  # type: ignore[union-attr]
    with torch.no_grad():
        tracked = module.num_batches_tracked
        factor = module.momentum
        if tracked is not None:
            tracked = tracked + 1
            module._buffers["num_batches_tracked"] = tracked
            if factor is None:  # a cumulative moving average
                factor = 1.0 / float(tracked)
        factor = 0.0 if factor is None else factor
        n_ = n.detach()
        unbiased = var.detach() * n_ / (n_ - 1).clamp_min(1)
        rm, rv = module.running_mean, module.running_var
        module._buffers["running_mean"] = (1 - factor) * rm + factor * mean.detach().to(rm.dtype)  # type: ignore[operator]
        module._buffers["running_var"] = (1 - factor) * rv + factor * unbiased.to(rv.dtype)  # type: ignore[operator]
    return y.to(x.dtype)


def global_moments(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-channel (dim 1) mean and biased variance of ``x`` over the global batch of the
    data ``axes``, and its count: float32 for half-precision inputs, else ``x``'s dtype.

    Each rank's count ``n``, mean ``m`` and sum of squared deviations ``M2`` (two passes over
    its share) are all-gathered over each axis, then combined by Chan's formula:
    ``mean = Σ n·m / N`` and ``M2 = Σ M2 + Σ n·(m - mean)²``. Every term is a deviation, so
    the variance keeps its digits however far the mean is from zero; and every sum is of
    small deviations from a reference value (a rank's mean from its first item, the global
    mean from the largest share's mean), so the mean is rounded once, as a float64
    accumulator rounded to float32 would give it.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> x = 1e4 + torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     share = ff.shard(x, mesh, ff.P("dp")).local
        ...     mean, var, n = global_moments(share, mesh, ("dp",))
        ...     got = ff.rank_values(var)[1]
        >>> want = x.double().var(0, unbiased=False)
        >>> bool(((got - want).abs() / want).max() < 1e-3), ff.rank_values(n)[0].item()
        (True, 64.0)
    """
    dims = [0, *range(2, x.ndim)]
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xw = x.to(wide)
    c = x.shape[1]
    shape = [1, c] + [1] * (x.ndim - 2)
    count = x.numel() // c
    n = torch.full((c,), float(count), dtype=wide, device=x.device)
    # The share's first item per channel (0 for an empty share, whose m = 0 is weighted by
    # n = 0 below); detached, it shifts the sum without changing any derivative.
    first = xw.detach().reshape(x.shape[0], c, -1)[0, :, 0] if count else torch.zeros_like(n)
    m = first + (xw - first.view(shape)).sum(dims) / max(count, 1)
    m2 = (xw - m.view(shape)).square().sum(dims)
    moments = torch.stack([n, m, m2]).unsqueeze(0)  # [1, 3, C]: this rank's
    for axis in axes:  # [ranks, 3, C]; backward: the incoming gradients summed over the ranks
        moments = C.all_gather(moments, mesh, axis)
    n, m, m2 = moments.unbind(1)
    total = n.sum(0)
    base = m.detach().gather(0, n.argmax(0, keepdim=True))[0]  # the largest share's mean
    delta = m - base
    shift = (n * delta).sum(0) / total
    mean = base + shift
    var = (m2.sum(0) + (n * (delta - shift).square()).sum(0)) / total
    return mean, var, total[0]
