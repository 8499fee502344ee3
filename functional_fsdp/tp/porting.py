"""``parallelize_module`` with torch's signature: a 2D script ports by changing one call.

A script written for torch::

    model = parallelize_module(model, mesh["tp"], plan)   # DTensor parameters, hooks
    for block in model.layers: fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

runs here as::

    tp = ff.parallelize_module(model, mesh["tp"], plan)   # the same plan, torch's styles
    sharded = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)

The model is not changed; the plan is translated (:mod:`functional_fsdp.tp.torch_styles`) and
resolved by :func:`functional_fsdp.tensor_parallel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.mesh import axis_names
from .plan import TensorParallel, tensor_parallel


def _root(mesh: DeviceMesh) -> tuple[DeviceMesh, str | None]:
    """The whole mesh and the sliced axis, for a 1D slice such as ``mesh["tp"]``."""
    names = axis_names(mesh)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is not None and root is not mesh and len(names) == 1:
        return root, names[0]
    return mesh, None


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: Any,
    *,
    fsdp_axes: Sequence[str] | None = None,
) -> TensorParallel:
    """torch's ``parallelize_module``, as a pure function: the plan's specs and wrappers.

    Args:
        module: the model (never modified: no DTensor parameters, no hooks).
        device_mesh: the tensor-parallel slice of a named mesh (``mesh["tp"]``, as torch
            takes it), or the whole mesh (the axis is then ``"tp"``).
        parallelize_plan: a torch ``ParallelStyle``, a ``{module path: style}`` dict or nested
            dicts, with torch's styles (``ColwiseParallel``, ``RowwiseParallel``,
            ``SequenceParallel``, ``PrepareModuleInput``, ``PrepareModuleOutput``,
            ``PrepareModuleInputOutput``) and/or this library's.
        fsdp_axes: as :func:`functional_fsdp.tensor_parallel` (default: the other axes).

    Returns:
        :class:`functional_fsdp.tp.plan.TensorParallel` on the whole mesh: pass ``specs`` and
        ``wrappers`` to :func:`functional_fsdp.fsdp`.

    Raises:
        ValueError: an entry matches nothing or has no equivalent here (named, with the
            style's fields); see :func:`functional_fsdp.tensor_parallel`.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ...     tp = parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        ...     f = ff.fsdp(mlp, mesh, specs=tp.specs, wrappers=tp.wrappers)
        ...     y = f.apply(f.shard(), torch.ones(3, 4))
        ...     tp.specs["0.weight"], torch.allclose(ff.rank_values(y)[0], mlp(torch.ones(3, 4)))
        (P(('tp', 'dp'), None), True)
    """
    mesh, axis = _root(device_mesh)
    plan = parallelize_plan
    if not isinstance(plan, dict):
        plan = {"": plan}
    return tensor_parallel(module, mesh, plan, axis=axis or "tp", fsdp_axes=fsdp_axes)
