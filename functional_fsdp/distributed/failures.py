"""Named failures: a collective that times out or loses a peer raises :class:`CollectiveError`.

The message says which collective, over which mesh axis, with which buffer, what usually
causes it and how to change the timeout. :func:`wait_tensor` is the one place a pending
c10d result is waited on with that translation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..spec import format_mesh
from .axes import axis_sizes


class CollectiveError(dist.DistError):
    """A collective failed: it timed out waiting for the other ranks, or a peer went away.

    The message names the collective, the mesh axis (with the mesh's axis names and sizes),
    the buffer's shape and dtype, and this rank, then says what usually causes it (another
    rank raised, skipped a collective or died) and how to change the timeout. The backend's
    own error is chained as ``__cause__``. A ``torch.distributed.DistError``, so code that
    catches torch's distributed errors catches it too. Raised where the backend reports the
    failure to the waiting rank: always on gloo; on NCCL torch's watchdog ends the process
    instead, unless ``TORCH_NCCL_BLOCKING_WAIT=1``.

    Example:
        >>> raise CollectiveError("all_gather over mesh axis 'dp' ... failed")
        Traceback (most recent call last):
        ...
        functional_fsdp.distributed.failures.CollectiveError: all_gather over mesh axis 'dp' ... failed
    """


# (kind, mesh, axis, shape, dtype): what a pending collective is, for its error message.
# Built per collective from values at hand, and formatted only when something fails.
What = tuple[str, DeviceMesh, str, torch.Size, torch.dtype]

_CAUSES = (
    "The other ranks of this group did not take part in time. Usually one of them raised an "
    "exception (look for its traceback first), skipped a collective (a branch, a loop or an "
    "early return that differs between ranks), or its process died (out of memory, killed)."
)


def _timeout_of(group: Any, device_type: str) -> str:
    try:
        seconds = group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
    except Exception:  # pragma: no cover - backends without readable options
        return "unknown"
    return f"{seconds:g} s"


def failure(what: What | None, error: BaseException, phase: str = "") -> CollectiveError:
    """A :class:`CollectiveError` for ``what`` that failed with the backend's ``error``."""
    backend = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    rank = dist.get_rank() if dist.is_initialized() else 0
    if what is None:
        head = f"a collective failed on rank {rank}"
        limit = "unknown"
    else:
        kind, mesh, axis, shape, dtype = what
        group = mesh.get_group(axis)
        try:
            ranks = dist.get_process_group_ranks(group)
        except Exception:  # pragma: no cover
            ranks = []
        sizes = axis_sizes(mesh)
        head = (
            f"{kind}{phase} over mesh axis {axis!r} (size {sizes[axis]}) of the mesh "
            f"{format_mesh(sizes)} failed on rank {rank}, waiting for global ranks {ranks}: "
            f"this rank's buffer is {str(dtype).removeprefix('torch.')} of shape {tuple(shape)}"
        )
        limit = _timeout_of(group, mesh.device_type)
    return CollectiveError(
        f"{head}.\n  backend: {backend}\n{_CAUSES} If a rank is only slow (saving a "
        f"checkpoint, evaluating or loading data on one rank), raise the limit (now {limit}): "
        f"ff.init_distributed(timeout=datetime.timedelta(minutes=30)) before make_mesh, or "
        f"FUNCTIONAL_FSDP_TIMEOUT=1800 in the environment. To find a collective that differs "
        f"between ranks, run with FUNCTIONAL_FSDP_CHECK=1."
    )


def wait_tensor(t: torch.Tensor, what: What, phase: str = "") -> torch.Tensor:
    try:
        return torch.ops._c10d_functional.wait_tensor(t)
    except RuntimeError as e:
        raise failure(what, e, phase) from e
