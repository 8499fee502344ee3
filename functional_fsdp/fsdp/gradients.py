"""The gradient rule (private): which data axes a parameter's gradient is reduced over, how.

A trainable parameter's gradient is reduced over every data-parallel mesh axis:

* **reduce-scattered** over the data axes its spec shards (the transpose of gathering them),
* **all-reduced** over the data axes where it is replicated,
* and, under ``Policy(grad_reduce="mean")``, divided by the number of data ranks, so that the
  loss is the mean over the global batch.

A loss given as ``(sum, count)`` (``train_step``) is divided by the global count instead:
the step multiplies the reduced gradients, averaged over its micro-batches and divided by
:func:`mean_divisor`, by ``micro-batches × mean_divisor / global count``, once, after the
count's all-reduce (the count is known only after every micro-batch's forward). The result
is the gradient of the global sum over the global count, whatever ``grad_reduce`` says.

Model axes (tp) get nothing from the library: the tensor-parallel collectives in the forward
already make those gradients right. Frozen parameters get no gradient and no reduction.

Everything that reduces gradients asks here: the unit layouts (:func:`.layout.model_layout`
and the ZeRO unit of :mod:`.zero`), :meth:`.units.Unit.reduce` (its divisor) and
``train_step(accumulate_mode="local")`` (:func:`to_compute_layout`, the whole model at once).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import collectives as C
from ..distributed.mesh import axis_sizes
from ..resharding import reshard
from ..sharded import Sharded
from ..spec import P
from .policy import Policy


@dataclass(frozen=True)
class Reduction:
    """How one parameter's gradient is reduced over the data axes.

    Example:
        >>> import functional_fsdp as ff
        >>> reduction(ff.P("shard"), ("replicate", "shard"))
        Reduction(scattered=('shard',), replicated=('replicate',))
    """

    scattered: tuple[str, ...]  # data axes the spec shards: reduce-scatter (in spec order)
    replicated: tuple[str, ...]  # data axes it is replicated over: all-reduce (mesh order)


def reduction(spec: P, data_axes: Sequence[str]) -> Reduction:
    """The gradient rule for a parameter laid out by ``spec`` (see the module docstring)."""
    data = tuple(data_axes)
    return Reduction(
        scattered=tuple(a for a in spec.axes if a in data),
        replicated=tuple(a for a in data if a not in spec.axes),
    )


def mean_divisor(sizes: Mapping[str, int], data_axes: Sequence[str], policy: Policy) -> int:
    """What the reduced gradients are divided by: the number of data ranks for
    ``grad_reduce="mean"``, else 1 (a sum, or no reduction at all)."""
    if policy.grad_reduce != "mean":
        return 1
    return math.prod(sizes[a] for a in data_axes)


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


def to_compute_layout(
    values: list[Any], mesh: DeviceMesh, data_axes: tuple[str, ...], policy: Policy
) -> list[Any]:
    """``values`` with their data axes gathered (the compute layout), differentiable with the
    gradient rule: the gradient comes back reduce-scattered over the axes each spec shards,
    all-reduced over those it replicates, and divided by :func:`mean_divisor`.

    ``train_step(accumulate_mode="local")`` applies it once per step to the whole model (the
    units then compute on full values and reduce nothing). Values that are not ``Sharded``
    pass through; frozen values go through it outside any differentiation and cost only
    their gather.
    """
    sharded = [v for v in values if isinstance(v, Sharded)]
    targets = [
        functools.reduce(P.without, reduction(v.spec, data_axes).scattered, v.spec) for v in sharded
    ]
    gathered = iter(reshard(sharded, targets, check=False))
    scale = 1.0 / mean_divisor(axis_sizes(mesh), data_axes, policy)
    out = []
    for v in values:
        if not isinstance(v, Sharded):
            out.append(v)
            continue
        g = next(gathered)
        replicated = reduction(v.spec, data_axes).replicated
        local = C.all_reduce_grad(g.local, mesh, replicated) if replicated else g.local
        out.append(
            Sharded._unchecked(_ScaleGrad.apply(local, scale), g.global_shape, g.spec, g.mesh)
        )
    return out
