"""Simulated meshes: N ranks in one process, with real numerics.

Built on ``torch.distributed._local_tensor.LocalTensorMode`` and the fake process group: a
value on the simulated mesh holds one tensor per rank, and the c10d functional collectives
compute exactly what N real processes would, inside ``torch.func.grad`` too. The same user
code runs unchanged under ``torchrun``, where real gloo or NCCL runs are the ground truth.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .mesh import coordinate_of


def _local_tensor_module() -> Any:
    try:
        from torch.distributed import _local_tensor
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            f"simulated meshes need torch.distributed._local_tensor (torch >= 2.10); this is "
            f"torch {torch.__version__}. Upgrade torch, or run the same code on real processes "
            f"with `torchrun --nproc-per-node N` or ff.launch."
        ) from e
    return _local_tensor


def is_simulated() -> bool:
    """True inside :func:`simulated_mesh`.

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}):
        ...     ff.is_simulated()
        True
    """
    if not dist.is_available():
        return False
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # pragma: no cover
        return False
    return enabled_local_tensor_mode() is not None


@contextlib.contextmanager
def simulated_mesh(axes: Mapping[str, int]) -> Iterator[DeviceMesh]:
    """Simulate a mesh of ``prod(axes.values())`` ranks in this process.

    Inside the block, every tensor that differs between ranks is a ``LocalTensor`` holding
    one value per rank, and collectives run for all ranks at once. Use :func:`rank_values`
    to look at the per-rank values. A process group must not already exist.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 4}) as mesh:
        ...     x = ff.shard(torch.arange(10.0), mesh, ff.P("dp"))
        ...     [tuple(t.tolist()) for t in ff.rank_values(x.local)]
        [(0.0, 1.0, 2.0), (3.0, 4.0, 5.0), (6.0, 7.0, 8.0), (9.0, 0.0, 0.0)]
    """
    lt = _local_tensor_module()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "simulated_mesh() needs to create its own (fake) process group, but one already "
            "exists. Use the real mesh (make_mesh) here, or call "
            "torch.distributed.destroy_process_group() first."
        )
    world = math.prod(int(s) for s in axes.values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with lt.LocalTensorMode(world):
            yield init_device_mesh(
                "cpu", tuple(int(s) for s in axes.values()), mesh_dim_names=tuple(axes)
            )
    finally:
        dist.destroy_process_group()


def per_coordinate(mesh: DeviceMesh, fn: Callable[[dict[str, int]], torch.Tensor]) -> torch.Tensor:
    """Build this rank's tensor from its mesh coordinate: ``fn({"dp": i, ...})``.

    On real processes it calls ``fn`` once with this rank's coordinate; on a simulated mesh it
    calls it for every rank and returns a ``LocalTensor``.
    """
    if is_simulated():
        lt = _local_tensor_module()
        # Build the per-rank tensor outside any torch.func transform: one made inside it is
        # not a valid input to later ops (it holds the transform's wrappers per rank).
        with torch._C._DisableFuncTorch():
            return lt.rank_map(lambda r: fn(coordinate_of(mesh, r)))
    return fn(coordinate_of(mesh, dist.get_rank()))


def on_rank(t: Any, rank: int) -> Any:
    """The value ``t`` has on ``rank``: itself unless it is a simulated per-rank tensor."""
    local_tensors = getattr(t, "_local_tensors", None)
    return local_tensors[rank] if local_tensors is not None else t


def rank_values(t: torch.Tensor) -> list[torch.Tensor]:
    """The per-rank values of a tensor on a simulated mesh, in rank order.

    Outside a simulation (or for a value that is the same on every rank) it returns ``[t]``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = ff.shard(torch.tensor([1.0, 2.0]), mesh, ff.P("dp")).local
        ...     [t.tolist() for t in ff.rank_values(x)]
        [[1.0], [2.0]]
    """
    local_tensors = getattr(t, "_local_tensors", None)
    if local_tensors is None:
        return [t]
    return [local_tensors[r] for r in sorted(local_tensors)]
