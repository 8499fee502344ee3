"""Buffers as state under :meth:`FSDP.apply(mutable=...) <functional_fsdp.FSDP.apply>` (private).

Flax's ``model.apply(variables, x, mutable=["batch_stats"])``: the forward runs on clones of
the given buffers, installed on the call's module copies, and the call returns their new values;
the caller's module and tensors are never written. Two modes:

* ``"per_rank"``: each rank normalises with the statistics of its own share (BatchNorm's own
  kernel), and the new buffers are data rank 0's, on every rank: torch DDP's behaviour with its
  default ``broadcast_buffers=True``, which broadcasts rank 0's buffers before each forward.
* ``"sync"``: SyncBatchNorm's. A BatchNorm layer in training mode normalises with the mean and
  (biased) variance of the global batch, from one all-reduce of the per-channel sum, sum of
  squares and count over the data axes; its running statistics are updated with the global
  mean and unbiased variance, as one process on the global batch updates them. The gradient
  flows through the statistics to every rank's inputs (the all-reduce's backward sums the
  incoming gradients, as SyncBatchNorm's does).
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
    dims = [0, *range(2, x.ndim)]
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xw = x.to(wide)
    count = torch.full((1,), x.numel() // x.shape[1], dtype=wide, device=x.device)
    stats = torch.cat([xw.sum(dims), (xw * xw).sum(dims), count])
    if axes:
        # Forward: the sums over the data axes; backward: the incoming gradients summed over
        # them too, since every rank's loss depends on every rank's inputs through the sums.
        stats = C.all_reduce(C.all_reduce_grad(stats, mesh, axes), mesh, axes)
    c = x.shape[1]
    n = stats[-1]
    mean = stats[:c] / n
    var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0)
    shape = [1, c] + [1] * (x.ndim - 2)
    y = (xw - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
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
