"""The shapes side of Muon: which dims of a leaf form its matrices, what orthogonalizing
them costs, which rank owns each, and which dim a matrix split over ranks is cut along.

Pure functions of shapes: the step and the planner (which prices the step from shapes
alone) both call them, so their choices cannot differ.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple


class MuonDimensionNumbers(NamedTuple):
    """Which dims of a weight are the matrix's reduction (input) and output dims, optax's.

    optax's default, ``reduction_axis=0, output_axis=1``, is JAX's ``x @ W`` layout
    ``[in, out]``. A ``torch.nn.Linear`` weight is ``[out, in]``: pass
    ``MuonDimensionNumbers(reduction_axis=1, output_axis=0)`` for optax's width scaling of
    such weights (the orthogonalization itself is the same either way). Dims in neither are
    batch dims, each orthogonalized on its own.

    Example:
        >>> MuonDimensionNumbers()
        MuonDimensionNumbers(reduction_axis=0, output_axis=1)
    """

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


def _axes(ndim: int, dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
    red = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis
    out = (dims.output_axis,) if isinstance(dims.output_axis, int) else dims.output_axis
    return tuple(a % ndim for a in red), tuple(a % ndim for a in out)


def _fans(shape: Sequence[int], dims: MuonDimensionNumbers) -> tuple[int, int]:
    red, out = _axes(len(shape), dims)
    return math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)


def _check_dims(where: str, shape: Sequence[int], dims: MuonDimensionNumbers) -> None:
    if len(shape) < 2:
        raise ValueError(
            f"{where}: shape {tuple(shape)} is not a matrix: Muon orthogonalizes leaves of "
            f"rank >= 2. Give it None in muon_weight_dimension_numbers (it then goes to the "
            f"Adam branch)."
        )
    red, out = _axes(len(shape), dims)
    if set(red) & set(out):
        raise ValueError(
            f"{where}: reduction axes {red} and output axes {out} of {dims} overlap for shape "
            f"{tuple(shape)}; they must be disjoint."
        )


def ns_flops(shape: Sequence[int], dims: MuonDimensionNumbers, ns_steps: int) -> int:
    """Multiply-add flops (×2) of orthogonalizing a whole leaf of ``shape``: per matrix of
    ``m <= n`` and per step, ``X Xᵀ`` (2m²n), ``A A`` (2m³) and ``B X`` (2m²n).

    Example:
        >>> ns_flops((4, 8), MuonDimensionNumbers(), 5)
        3200
    """
    fan_in, fan_out = _fans(shape, dims)
    m, n = sorted((fan_in, fan_out))
    batch = math.prod(shape) // max(1, fan_in * fan_out)
    return batch * ns_steps * (4 * m * m * n + 2 * m**3)


def assign_owners(flops: Sequence[int], ranks: int) -> list[int]:
    """An owner rank per matrix, balancing the flops: largest first, each to the rank with
    the least work so far (ties to the lower rank; equal matrices in their order).

    Example:
        >>> assign_owners([10, 1, 9, 2, 8], 2)
        [0, 0, 1, 0, 1]
    """
    heap = [(0, r) for r in range(ranks)]
    owners = [0] * len(flops)
    for i in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + flops[i], r))
    return owners


def split_dim(shape: Sequence[int], dims: MuonDimensionNumbers) -> int:
    """The tensor dim along which a matrix split over ranks is cut: the major dim of its
    longer side (the columns of optax's orientation, which puts the shorter side first), so
    that the product each rank adds to the others' is ``X Xᵀ`` of the shorter side.

    Example:
        >>> split_dim((4, 8), MuonDimensionNumbers())  # (in, out): out is longer
        1
        >>> split_dim((16, 8), MuonDimensionNumbers(reduction_axis=1, output_axis=0))
        0
    """
    red, out = _axes(len(shape), dims)
    fan_in, fan_out = (math.prod(shape[a] for a in side) for side in (red, out))
    return (red if fan_in > fan_out else out)[0]


def coordinates(axis_sizes: dict[str, int]) -> list[dict[str, int]]:
    """Each rank's coordinates, in the mesh's row-major rank order.

    Example:
        >>> coordinates({"dp": 2, "tp": 2})[1]
        {'dp': 0, 'tp': 1}
    """
    names = list(axis_sizes)
    coords = []
    for index in range(math.prod(axis_sizes.values())):
        values = []
        for name in reversed(names):
            values.append(index % axis_sizes[name])
            index //= axis_sizes[name]
        coords.append(dict(zip(names, reversed(values))))
    return coords
