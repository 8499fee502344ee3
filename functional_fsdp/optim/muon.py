"""Muon (Jordan et al. 2024), optax.contrib's, on sharded weights.

Muon keeps a momentum per weight matrix and replaces each step's update by the momentum
orthogonalized with a few Newton–Schulz iterations. The iteration needs the **whole**
matrix, which FSDP and TP split over ranks. Here each matrix is orthogonalized once per step,
by one owner rank, as in "Muon is Scalable for LLM Training" (Liu et al. 2025):

1. every rank updates the momentum of its own blocks (element-wise, no communication);
2. one all-to-all over the whole mesh sends each block of a matrix's momentum to the matrix's
   owner (one copy of each block: over the axes where a value is replicated, the rank at
   the owner's coordinate sends it);
3. each owner orthogonalizes the matrices it owns, whole;
4. a second all-to-all sends each rank its blocks of the results.

Owners are chosen by :func:`assign_owners` so that the Newton–Schulz flops are balanced over
ranks (largest first, each to the least loaded rank). A rank sends and receives about
``(N-1)/N`` of the blocks it holds and of the matrices it owns, in each direction: about
``2 Ψ (N-1)/N²`` per rank for matrices sharded over all ``N`` ranks, against ``Ψ (N-1)/N``
for gathering every matrix on every rank (and orthogonalizing it ``N`` times).

On one process, and on a simulated mesh (which cannot express an all-to-all whose sizes
differ by rank; every simulated rank then gathers and orthogonalizes every matrix), the
numbers are the same.

Example:
    >>> import torch
    >>> from functional_fsdp.optim.transforms import apply_updates
    >>> params = {"w": torch.eye(3), "b": torch.zeros(3)}
    >>> opt = muon(0.1)
    >>> grads = {"w": torch.diag(torch.tensor([1.0, 2.0, 3.0])), "b": torch.ones(3)}
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> [round(x, 3) for x in torch.diagonal(updates["w"]).tolist()]
    [-0.07, -0.068, -0.112]
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch

from .._tree import dotted
from ..distributed import collectives as C
from ..distributed import process
from ..distributed.axes import axis_sizes, mesh_grid
from ..distributed.simulate import is_simulated
from ..sharded import Sharded, unpad
from ._tree import check_dtype, check_real, check_tensor_tree, leaves_like, zeros_like_tree
from .schedules import Schedule
from .transforms import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    Mask,
    OptState,
    Params,
    Updates,
    _bias_correction,
    _rounded,
    _takes_one,
    adamw,
    add_decayed_weights,
    chain,
    scale_by_learning_rate,
)

Preconditioning = Literal["frobenius", "spectral", "aol", "schatten"]
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
DION_NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
NS_COEFFS_PRESETS = {"standard": DEFAULT_NS_COEFFS, "dion": DION_NS_COEFFS}


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


# A tree of MuonDimensionNumbers (None: not a Muon leaf) like the params or a prefix of
# them, fn(params) returning one, or a predicate fn(dotted_path, leaf).
WeightDimNumOrFn = Any


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon` (optax's fields).

    Example:
        >>> import torch
        >>> scale_by_muon().init({"w": torch.ones(2, 2)})
        MuonState(count=0, mu={'w': tensor([[0., 0.],
                [0., 0.]])}, ns_coeffs=(3.4445, -4.775, 2.0315))
    """

    count: int | torch.Tensor  # updates so far (an int64 scalar tensor under apply_if_finite)
    mu: Any  # like params (same shapes, specs; dtype: mu_dtype if given): the momentum
    ns_coeffs: Any  # the Newton-Schulz coefficients: (a, b, c), or one triple per step


# --------------------------------------------------------------------------- Newton-Schulz


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


def _ns_step(x: torch.Tensor, c: torch.Tensor, first: bool, kind: str, eps: float) -> torch.Tensor:
    """One quintic step ``c0 X + (c1 A + c2 A A) X``, ``A = X Xᵀ`` (optax's order of
    operations); the first step of ``aol``/``schatten`` rescales ``X`` first."""
    a = x @ x.T
    if first and kind == "aol":
        s = torch.rsqrt(torch.clamp(a.abs().sum(-1), min=eps)).unsqueeze(-1)
        x, a = x * s, a * s * s.T
    elif first and kind == "schatten":
        s = torch.rsqrt(torch.clamp(torch.linalg.matrix_norm(a), min=eps)).reshape(1, 1)
        x, a = x * s, a * s**2
    b = c[1] * a + (c[2] * a) @ a
    return c[0] * x + b @ x


def orthogonalize_via_newton_schulz(
    x: torch.Tensor,
    ns_coeffs: Any,
    ns_steps: int = 5,
    preconditioning: Preconditioning = "frobenius",
    eps: float = 1e-8,
    dimension_numbers: MuonDimensionNumbers | None = None,
) -> torch.Tensor:
    """Orthogonalize a whole matrix (or a batch of them) with Newton–Schulz, optax's.

    Args:
        x: the matrix, or a tensor whose ``dimension_numbers`` name its matrix dims.
        ns_coeffs: ``(a, b, c)``, or one such triple per step (``ns_steps`` is then unused);
            a tuple of floats or a tensor of shape ``(3,)`` or ``(n, 3)``.
        ns_steps: the number of steps.
        preconditioning: ``"frobenius"`` (divide by the Frobenius norm + ``eps``),
            ``"spectral"`` (by the largest singular value + ``eps``), ``"aol"`` or
            ``"schatten"`` (a rescaled first step).
        eps: added to denominators.
        dimension_numbers: the reduction and output dims (needed for ``x.ndim != 2``).

    Example:
        >>> import torch
        >>> q = orthogonalize_via_newton_schulz(torch.diag(torch.tensor([1.0, 4.0])), DEFAULT_NS_COEFFS)
        >>> [round(v, 2) for v in torch.diagonal(q).tolist()]
        [0.74, 0.74]
    """
    if x.ndim != 2 and not isinstance(dimension_numbers, MuonDimensionNumbers):
        raise ValueError(
            f"orthogonalize_via_newton_schulz: shape {tuple(x.shape)} is not a matrix; pass "
            f"dimension_numbers=MuonDimensionNumbers(reduction_axis=..., output_axis=...)."
        )
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(
            f"orthogonalize_via_newton_schulz: unknown preconditioning {preconditioning!r}; "
            f"choose one of {PRECONDITIONINGS}."
        )
    dims = dimension_numbers if x.ndim != 2 else MuonDimensionNumbers()
    _check_dims("orthogonalize_via_newton_schulz", x.shape, dims)
    coeffs = _coeff_tensor(ns_coeffs).to(device=x.device, dtype=x.dtype)
    steps = [coeffs] * int(ns_steps) if coeffs.ndim == 1 else list(coeffs)
    red, out = _axes(x.ndim, dims)
    batch = tuple(a for a in range(x.ndim) if a not in red and a not in out)
    order = batch + red + out
    shape = [x.shape[a] for a in order]
    flat = x.permute(order).reshape(
        math.prod(shape[: len(batch)]),
        math.prod(x.shape[a] for a in red),
        math.prod(x.shape[a] for a in out),
    )
    results = []
    for m in flat:
        transposed = m.shape[0] > m.shape[1]
        if transposed:
            m = m.T
        if preconditioning == "frobenius":
            m = m / (torch.linalg.matrix_norm(m) + eps)
        elif preconditioning == "spectral":
            m = m / (torch.linalg.matrix_norm(m, ord=2) + eps)
        for i, c in enumerate(steps):
            m = _ns_step(m, c, i == 0, preconditioning, eps)
        results.append(m.T if transposed else m)
    inverse = sorted(range(x.ndim), key=lambda i: order[i])
    return torch.stack(results).reshape(shape).permute(inverse)


def _coeff_tensor(ns_coeffs: Any) -> torch.Tensor:
    """The coefficients as a float64 tensor (from floats, or from the float64 scalar tensors
    that apply_if_finite makes of a state's numbers), without reading a device value."""
    if isinstance(ns_coeffs, torch.Tensor):
        return ns_coeffs.to(torch.float64)
    if all(isinstance(c, (tuple, list)) for c in ns_coeffs):
        return torch.stack([_coeff_tensor(c) for c in ns_coeffs])
    return torch.stack([torch.as_tensor(c, dtype=torch.float64).cpu() for c in ns_coeffs])


def _check_coeffs(ns_coeffs: Any, ns_steps: int) -> tuple[Any, ...]:
    """optax's checks: shape (3,) or (n, 3), n <= ns_steps; the last ns_steps rows kept."""
    try:
        coeffs = torch.tensor(ns_coeffs, dtype=torch.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"scale_by_muon: ns_coeffs must be (a, b, c) or a tuple of such triples, got "
            f"{ns_coeffs!r}."
        ) from e
    if coeffs.ndim not in (1, 2) or coeffs.shape[-1] != 3:
        raise ValueError(
            f"scale_by_muon: ns_coeffs must have shape (3,) or (n, 3), got {tuple(coeffs.shape)}."
        )
    if coeffs.ndim == 2:
        if coeffs.shape[0] > ns_steps:
            raise ValueError(
                f"scale_by_muon: {coeffs.shape[0]} rows of ns_coeffs for ns_steps={ns_steps}; "
                f"pass ns_steps >= {coeffs.shape[0]}."
            )
        return tuple(tuple(float(v) for v in row) for row in coeffs[-ns_steps:].tolist())
    return tuple(float(v) for v in coeffs.tolist())


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


# --------------------------------------------------------------------------- whole matrices


class _Leaf(NamedTuple):
    path: str
    value: Any  # the Sharded (or plain tensor) whose layout the momentum has
    local: torch.Tensor  # this rank's block of the momentum estimate to orthogonalize
    dims: MuonDimensionNumbers


def _orthogonalize_all(
    leaves: list[_Leaf], ns: Callable[[torch.Tensor, MuonDimensionNumbers], torch.Tensor]
) -> list[torch.Tensor]:
    """Each leaf's block of its whole matrix, orthogonalized by ``ns``."""
    out: list[torch.Tensor | None] = [None] * len(leaves)
    spread: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        v = leaf.value
        if not isinstance(v, Sharded) or math.prod(axis_sizes(v.mesh).values()) == 1:
            out[i] = ns(leaf.local, leaf.dims)  # whole here (replicated: each rank's copy)
        else:
            spread.setdefault(v.mesh, []).append(i)
    for mesh, indices in spread.items():
        group = [leaves[i] for i in indices]
        results = _on_simulated(group, ns) if is_simulated() else _on_owners(mesh, group, ns)
        for i, r in zip(indices, results):
            out[i] = r
    return out  # type: ignore[return-value]


def _on_simulated(
    leaves: list[_Leaf], ns: Callable[[torch.Tensor, MuonDimensionNumbers], torch.Tensor]
) -> list[torch.Tensor]:
    """A simulated mesh runs one all-to-all size for every rank: each rank gathers and
    orthogonalizes every matrix (the same numbers, without the balance)."""
    from ..resharding import gather, shard

    out = []
    for leaf in leaves:
        v = leaf.value
        full = gather(v.replace(leaf.local))
        out.append(shard(ns(full, leaf.dims), v.mesh, v.spec).local)
    return out


def _on_owners(
    mesh: Any,
    leaves: list[_Leaf],
    ns: Callable[[torch.Tensor, MuonDimensionNumbers], torch.Tensor],
) -> list[torch.Tensor]:
    """Each matrix to its owner (one all-to-all per dtype), orthogonalized there, and each
    rank's blocks back (another)."""
    grid = mesh_grid(mesh)
    coords = [grid.coordinate(r) for r in grid.ranks]
    me = grid.ranks.index(process.rank())
    owners = plan_owners(mesh, [(tuple(x.value.global_shape), x.dims) for x in leaves])
    for book in _RECORDERS:
        book.append(
            (
                axis_sizes(mesh),
                [
                    (tuple(x.value.global_shape), x.value.spec, x.dims, x.local.dtype)
                    for x in leaves
                ],
            )
        )
    out: list[torch.Tensor | None] = [None] * len(leaves)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.local.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        chosen = [leaves[i] for i in indices]
        _exchange(mesh, coords, me, chosen, [owners[i] for i in indices], dtype, ns, out, indices)
    return out  # type: ignore[return-value]


def plan_owners(
    mesh: Any, shapes: Sequence[tuple[tuple[int, ...], MuonDimensionNumbers]]
) -> list[int]:
    """The owner (index in the mesh's row-major rank order) of each matrix, by flops (the
    step count scales every matrix alike, so it does not change the choice)."""
    n = math.prod(axis_sizes(mesh).values())
    return assign_owners([ns_flops(s, d, 1) for s, d in shapes], n)


def exchange_bytes(
    matrices: Sequence[tuple[Sequence[int], Any, MuonDimensionNumbers]],
    axis_sizes: dict[str, int],
    itemsize: int = 4,
) -> list[int]:
    """Bytes each rank sends per step in Muon's two all-to-alls, from shapes alone: the
    blocks it sends to the owners, plus the blocks of its own matrices it sends back.

    Args:
        matrices: ``(global shape, spec, dimension numbers)`` of each Muon leaf sharded on the
            mesh, in the order of the params tree.
        axis_sizes: the mesh's axes and sizes, in mesh order.
        itemsize: bytes per element of the momentum (4 for float32).

    Example:
        >>> from functional_fsdp.spec import P
        >>> exchange_bytes([((8, 4), P("dp"), MuonDimensionNumbers())] * 2, {"dp": 2})
        [128, 128]
    """
    from ..spec import Layout

    coords = _coordinates(axis_sizes)
    n = len(coords)
    owners = assign_owners([ns_flops(tuple(s), d, 1) for s, _, d in matrices], n)
    sent = [0] * n
    for (shape, spec, _), o in zip(matrices, owners):
        layout = Layout.make(tuple(shape), spec, axis_sizes)
        sizes = [math.prod(x.stop - x.start for x in layout.owned(c)[0]) for c in coords]
        for k in _sources(layout, coords[o], coords):
            if k != o:
                sent[k] += sizes[k] * itemsize
        sent[o] += sum(sizes[k] for k in range(n) if k != o) * itemsize
    return sent


def exchange_memory(
    matrices: Sequence[tuple[Sequence[int], Any, MuonDimensionNumbers, torch.dtype]],
    axis_sizes: dict[str, int],
) -> list[int]:
    """The most bytes each rank holds at once in Muon's exchange, from shapes alone.

    Per dtype of momentum (in order of first appearance), a rank holds: in the first
    all-to-all its send buffer ``S1`` (its blocks for the owners) and its receive buffer
    ``R1`` (the other blocks of the matrices it owns); then ``R1`` and its matrices whole
    ``W`` (each orthogonalized in place of its input); in the second all-to-all ``W``, its
    send buffer ``S2`` (the others' blocks of its results) and its receive buffer ``R2``
    (its blocks of the others' results); and at the end ``W``, ``R2`` and the blocks it
    returns ``O`` (its padded shards of the update). The peak is the largest of ``S1 + R1``,
    ``R1 + W``, ``W + S2 + R2`` and ``W + R2 + O``, on top of the blocks returned for the
    dtypes before. Newton–Schulz's own temporaries (a few matrices of the size of the one
    being orthogonalized) are not included.

    Args:
        matrices: ``(global shape, spec, dimension numbers, momentum dtype)`` of each Muon
            leaf sharded on the mesh, in the order of the params tree.
        axis_sizes: the mesh's axes and sizes, in mesh order.

    Example:
        >>> import torch
        >>> from functional_fsdp.spec import P
        >>> m = ((8, 4), P("dp"), MuonDimensionNumbers(), torch.float32)
        >>> exchange_memory([m, m], {"dp": 2})  # each rank: one matrix whole (128 B)
        [320, 320]
    """
    from ..spec import Layout

    coords = _coordinates(axis_sizes)
    n = len(coords)
    owners = assign_owners([ns_flops(tuple(s), d, 1) for s, _, d, _ in matrices], n)
    peaks = [0] * n
    returned = [0] * n
    groups: dict[torch.dtype, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault(m[3], []).append(i)
    for dtype, chosen in groups.items():
        size = dtype.itemsize
        s1, r1, whole, s2, r2, blocks = ([0] * n for _ in range(6))
        for i in chosen:
            shape, spec, _, _ = matrices[i]
            o = owners[i]
            layout = Layout.make(tuple(shape), spec, axis_sizes)
            sizes = [math.prod(x.stop - x.start for x in layout.owned(c)[0]) * size for c in coords]
            for k in _sources(layout, coords[o], coords):
                if k != o:
                    s1[k] += sizes[k]
                    r1[o] += sizes[k]
            whole[o] += math.prod(shape) * size
            s2[o] += sum(sizes[k] for k in range(n) if k != o)
            for k in range(n):
                if k != o:
                    r2[k] += sizes[k]
                blocks[k] += layout.local_numel * size
        for k in range(n):
            peak = max(
                s1[k] + r1[k],
                r1[k] + whole[k],
                whole[k] + s2[k] + r2[k],
                whole[k] + r2[k] + blocks[k],
            )
            peaks[k] = max(peaks[k], returned[k] + peak)
            returned[k] += blocks[k]
    return peaks


def _coordinates(axis_sizes: dict[str, int]) -> list[dict[str, int]]:
    """Each rank's coordinates, in the mesh's row-major rank order."""
    names = list(axis_sizes)
    coords = []
    for index in range(math.prod(axis_sizes.values())):
        values = []
        for name in reversed(names):
            values.append(index % axis_sizes[name])
            index //= axis_sizes[name]
        coords.append(dict(zip(names, reversed(values))))
    return coords


# Open recorders of recording_exchanges(): each gets (axis sizes, matrices) per exchange.
_RECORDERS: list[list[tuple[dict[str, int], list[Any]]]] = []


@contextlib.contextmanager
def recording_exchanges() -> Iterator[list[tuple[dict[str, int], list[Any]]]]:
    """Record the exchanges Muon runs inside the block: for each, the mesh's axis sizes and
    the ``(global shape, spec, dimension numbers, momentum dtype)`` of its matrices (the
    arguments of :func:`exchange_memory`). The planner prices the owners' memory this way.

    Example:
        >>> import torch
        >>> t, g = scale_by_muon(), {"w": torch.ones(2, 2)}
        >>> with recording_exchanges() as book:
        ...     _ = t.update(g, t.init(g))
        >>> book  # one process: nothing to exchange
        []
    """
    book: list[tuple[dict[str, int], list[Any]]] = []
    _RECORDERS.append(book)
    try:
        yield book
    finally:
        _RECORDERS.remove(book)


def _sources(layout: Any, owner: dict[str, int], coords: list[dict[str, int]]) -> list[int]:
    """The ranks that send their block to ``owner``: one per distinct block, the one at the
    owner's coordinate on every axis the value is replicated over."""
    split = set(layout.spec.axes)
    return [
        k for k, c in enumerate(coords) if all(c[a] == owner[a] for a in owner if a not in split)
    ]


def _exchange(
    mesh: Any,
    coords: list[dict[str, int]],
    me: int,
    leaves: list[_Leaf],
    owners: list[int],
    dtype: torch.dtype,
    ns: Callable[[torch.Tensor, MuonDimensionNumbers], torch.Tensor],
    out: list[torch.Tensor | None],
    indices: list[int],
) -> None:
    """The two all-to-alls of one dtype's matrices. What a rank holds is what
    :func:`exchange_memory` prices: a flat send buffer and the receive buffer of each
    all-to-all (each send buffer freed once sent), the matrices it owns whole (from the
    first receive until the end), and the blocks it returns."""
    n = len(coords)
    layouts = [leaf.value.layout for leaf in leaves]
    sources = [_sources(lay, coords[o], coords) for lay, o in zip(layouts, owners)]

    def numel(lay: Any, k: int) -> int:
        return math.prod(s.stop - s.start for s in lay.owned(coords[k])[0])

    # Gather: my block of each matrix to its owner, if I am its source; the owner keeps its own.
    send: list[list[torch.Tensor]] = [[] for _ in range(n)]
    recv_sizes = [0] * n
    for leaf, lay, o, src in zip(leaves, layouts, owners, sources):
        if me in src and o != me:
            send[o].append(unpad(leaf.local, lay, coords[me]))
        if o == me:
            for k in src:
                if k != me:
                    recv_sizes[k] += numel(lay, k)
    received = _all_to_all(mesh, send, recv_sizes, dtype, leaves[0].local)
    full: dict[int, torch.Tensor] = {}
    offsets = _offsets(recv_sizes)
    for j, (leaf, lay, o, src) in enumerate(zip(leaves, layouts, owners, sources)):
        if o != me:
            continue
        whole = leaf.local.new_empty(lay.global_shape)
        for k in src:
            slices = lay.owned(coords[k])[0]
            if k == me:
                whole[slices] = unpad(leaf.local, lay, coords[me])
            else:
                size = numel(lay, k)
                whole[slices] = received[offsets[k] : offsets[k] + size].view(whole[slices].shape)
                offsets[k] += size
        full[j] = ns(whole, leaf.dims)
        del whole
    C.release(received)
    del received
    # Scatter: each rank's block of the matrices I own, from me; mine from their owners.
    send = [[] for _ in range(n)]
    recv_sizes = [0] * n
    for j, (lay, o) in enumerate(zip(layouts, owners)):
        if o == me:
            for k in range(n):
                if k != me:
                    send[k].append(full[j][lay.owned(coords[k])[0]])
        else:
            recv_sizes[o] += numel(lay, me)
    received = _all_to_all(mesh, send, recv_sizes, dtype, leaves[0].local)
    offsets = _offsets(recv_sizes)
    for j, (leaf, lay, o) in enumerate(zip(leaves, layouts, owners)):
        mine = torch.zeros_like(leaf.local)
        real = unpad(mine, lay, coords[me])
        if o == me:
            real.copy_(full[j][lay.owned(coords[me])[0]])
        else:
            size = real.numel()
            real.copy_(received[offsets[o] : offsets[o] + size].view(real.shape))
            offsets[o] += size
        out[indices[j]] = mine
    C.release(received)


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def _all_to_all(
    mesh: Any,
    send: list[list[torch.Tensor]],
    recv_sizes: list[int],
    dtype: torch.dtype,
    like: torch.Tensor,
) -> torch.Tensor:
    """Copy the blocks (views, any strides) into one flat buffer, send it, free it."""
    sizes = [sum(p.numel() for p in chunk) for chunk in send]
    flat = like.new_empty(sum(sizes), dtype=dtype)
    at = 0
    for chunk in send:
        for p in chunk:
            flat[at : at + p.numel()].view(p.shape).copy_(p)
            at += p.numel()
    send.clear()
    received = C.raw_all_to_all(flat, mesh, sizes, recv_sizes)
    C.release(flat)
    return received


# --------------------------------------------------------------------------- which leaves


def _is_dims(x: object) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def resolve_dims(
    where: str, rule: WeightDimNumOrFn, tree: Any
) -> list[MuonDimensionNumbers | None]:
    """One entry per leaf of ``tree`` (``Sharded`` values are leaves): its dimension numbers,
    or ``None`` for a leaf Muon does not take.

    ``rule``: ``None`` (every leaf of rank 2, with optax's default numbers); one
    :class:`MuonDimensionNumbers` for every leaf; a tree of them (``None`` for a leaf Muon
    does not take) like ``tree`` or a prefix of it; ``fn(params)`` returning such a tree; or
    a predicate ``fn(dotted_path, leaf)`` returning the numbers or ``None``.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    if rule is None:
        return [MuonDimensionNumbers() if x.ndim == 2 else None for x in leaves]
    if callable(rule) and not isinstance(rule, (dict, list, tuple)):
        if not _takes_one(rule):
            out = [rule(dotted(p), x) for p, x in zip(paths, leaves)]
            for p, d in zip(paths, out):
                if not _is_dims(d):
                    raise TypeError(
                        f"{where}: the rule gives {d!r} for {dotted(p) or '<root>'}; it must "
                        f"give MuonDimensionNumbers(...) or None (the Adam branch)."
                    )
            return out
        rule = rule(tree)
    p_paths, p_leaves, _ = optree.tree_flatten_with_path(rule, is_leaf=_is_dims, none_is_leaf=True)
    for p, d in zip(p_paths, p_leaves):
        if not _is_dims(d):
            raise TypeError(
                f"{where}: muon_weight_dimension_numbers holds {d!r} at {dotted(p) or '<root>'}; "
                f"its leaves are MuonDimensionNumbers(...) or None."
            )
    out = []
    for path in paths:
        found = [d for q, d in zip(p_paths, p_leaves) if tuple(path[: len(q)]) == tuple(q)]
        if not found:
            raise ValueError(
                f"{where}: muon_weight_dimension_numbers has no entry for {dotted(path)}; give "
                f"a tree like the params (or a prefix of it), with None where Adam applies."
            )
        out.append(found[0])
    return out


def _value(x: Any) -> torch.Tensor:
    return x.local if isinstance(x, Sharded) else x


# --------------------------------------------------------------------------- transformations


def scale_by_muon(
    ns_coeffs: Any = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    weight_dimension_numbers: WeightDimNumOrFn = None,
    matrix_budget_bytes: int | None = None,
) -> GradientTransformation:
    """Muon's rescaling, optax.contrib's: momentum, then each matrix's (Nesterov) momentum
    orthogonalized whole with Newton–Schulz.

    Sharded matrices are brought whole to one owner rank each, balanced by flops, and the
    results sent back as blocks (see the module's text). Every leaf it sees is a Muon leaf
    (:func:`muon` gives the others to Adam).

    Args:
        ns_coeffs: ``(a, b, c)`` or a tuple of per-step triples (the last ``ns_steps`` kept).
        ns_steps: Newton–Schulz steps (unused with per-step triples).
        beta: the momentum's decay.
        eps: added to denominators.
        mu_dtype: the momentum's dtype (the params' by default).
        nesterov: Nesterov momentum (optax's default, ``True``).
        adaptive: scale each result by ``<momentum, result>`` (Bernstein et al.).
        preconditioning: see :func:`orthogonalize_via_newton_schulz`.
        weight_dimension_numbers: see :func:`resolve_dims`; ``None`` is optax's default
            numbers for every leaf (optax raises for a tree of several leaves there).
        matrix_budget_bytes: the most bytes one leaf may take whole (in the momentum's
            dtype) on the rank that orthogonalizes it; ``init`` refuses a larger one (see
            :func:`check_budget`). ``None``: no limit. Not optax's (an extension).

    Example:
        >>> import torch
        >>> t = scale_by_muon()
        >>> g = {"w": torch.tensor([[3.0, 0.0], [0.0, 1.0]])}
        >>> u, state = t.update(g, t.init(g))
        >>> [round(v, 3) for v in torch.diagonal(u["w"]).tolist()]
        [0.753, 1.134]
    """
    coeffs = _check_coeffs(ns_coeffs, int(ns_steps))
    beta = check_real("scale_by_muon", "beta", beta, low=0.0)
    eps = check_real("scale_by_muon", "eps", eps, low=0.0)
    mu_dtype = check_dtype("scale_by_muon", "mu_dtype", mu_dtype)
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(
            f"scale_by_muon: unknown preconditioning {preconditioning!r}; choose one of "
            f"{PRECONDITIONINGS}."
        )

    def init(params: Params) -> MuonState:
        check_tensor_tree(params, "scale_by_muon.init")
        if matrix_budget_bytes is not None:
            check_budget("scale_by_muon", params, mu_dtype, matrix_budget_bytes)
        return MuonState(count=0, mu=zeros_like_tree(params, mu_dtype), ns_coeffs=coeffs)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        mu = leaves_like("scale_by_muon", "state.mu", state.mu, updates)
        paths, values, treedef = optree.tree_flatten_with_path(updates)
        g = [_value(x) for x in values]
        count = state.count + 1
        same = all(m.dtype == x.dtype for m, x in zip(mu, g))
        b = beta if same else None
        new_mu = [
            (1.0 - beta) * x + (b if b is not None else _rounded(beta, m.dtype)) * m
            for x, m in zip(g, mu)
        ]
        bc = _bias_correction(beta, count)
        if nesterov:
            bc_next = _bias_correction(beta, count + 1)
            mu_hat = [beta * (m / bc_next) + (1.0 - beta) * (x / bc) for m, x in zip(new_mu, g)]
        else:
            mu_hat = [m / bc for m in new_mu]
        dims = resolve_dims("scale_by_muon", weight_dimension_numbers, updates)
        leaves = []
        for path, v, m, d in zip(paths, values, mu_hat, dims):
            d = MuonDimensionNumbers() if d is None else d
            _check_dims(f"scale_by_muon: {dotted(path) or '<root>'}", tuple(v.shape), d)
            leaves.append(_Leaf(dotted(path), v, m, d))
        c = state.ns_coeffs

        def ns(x: torch.Tensor, d: MuonDimensionNumbers) -> torch.Tensor:
            return orthogonalize_via_newton_schulz(x, c, int(ns_steps), preconditioning, eps, d)

        out = _orthogonalize_all(leaves, ns)
        if adaptive:
            out = [_whole_dot(v, m, o) * o for v, m, o in zip(values, mu_hat, out)]
        stored = new_mu if same else [n.to(m.dtype) for n, m in zip(new_mu, mu)]
        return optree.tree_unflatten(
            treedef, [_like(v, o) for v, o in zip(values, out)]
        ), MuonState(
            count, optree.tree_unflatten(treedef, [_like(v, s) for v, s in zip(values, stored)]), c
        )

    return GradientTransformationExtraArgs(init, update)


def check_budget(where: str, params: Params, mu_dtype: torch.dtype | None, budget: int) -> None:
    """Refuse a leaf whose momentum, whole, takes more than ``budget`` bytes.

    Newton–Schulz needs the whole matrix, and one rank (its owner) holds it whole: a leaf
    above the budget is not split over several ranks (not provided yet); the error names it,
    and the fixes.

    Example:
        >>> import torch
        >>> try:
        ...     check_budget("scale_by_muon", {"w": torch.ones(4, 4)}, None, 32)
        ... except ValueError as e:
        ...     print(str(e).split(". ")[0])
        scale_by_muon: w of shape (4, 4) (torch.float32) takes 64 B whole on its owner, over matrix_budget_bytes=32
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise TypeError(f"{where}: matrix_budget_bytes must be a positive int, got {budget!r}.")
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    for path, x in zip(paths, leaves):
        dtype = mu_dtype or x.dtype
        nbytes = math.prod(x.shape) * dtype.itemsize
        if nbytes > budget:
            where_is = ""
            if isinstance(x, Sharded):
                where_is = f", spec {x.spec} on mesh {dict(axis_sizes(x.mesh))}"
            raise ValueError(
                f"{where}: {dotted(path) or '<root>'} of shape {tuple(x.shape)} ({dtype}"
                f"{where_is}) takes {nbytes} B whole on its owner, over matrix_budget_bytes="
                f"{budget}. Muon orthogonalizes each matrix whole on one rank; splitting one "
                f"over several ranks is not provided. Raise matrix_budget_bytes to at least "
                f"{nbytes}, or give this leaf to Adam (None for it in "
                f"muon_weight_dimension_numbers)."
            )


def _like(value: Any, local: torch.Tensor) -> Any:
    return (
        Sharded._unchecked(local, value.global_shape, value.spec, value.mesh)
        if isinstance(value, Sharded)
        else local
    )


def _whole_dot(value: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` over the whole leaf (padding is zero in both; summed over the mesh
    axes that split it)."""
    total = (a * b).sum()
    if isinstance(value, Sharded) and value.spec.axes:
        total = C.wait(C.raw_all_reduce(total, value.mesh, value.spec.axes))
    return total


def scale_by_shape(
    weight_dimension_numbers: WeightDimNumOrFn = None, consistent_rms: float | None = None
) -> GradientTransformation:
    """Scale each matrix's update by ``sqrt(max(1, fan_out / fan_in))`` (Jordan's width
    scaling), or by ``sqrt(max(fan_in, fan_out)) * consistent_rms`` (Moonlight's), optax's.

    Example:
        >>> import torch
        >>> t = scale_by_shape()
        >>> t.update({"w": torch.ones(1, 4)}, t.init(None))[0]["w"]
        tensor([[2., 2., 2., 2.]])
    """
    if consistent_rms is not None:
        consistent_rms = check_real("scale_by_shape", "consistent_rms", consistent_rms)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        values, treedef = optree.tree_flatten(updates)
        dims = resolve_dims("scale_by_shape", weight_dimension_numbers, updates)
        out = []
        for v, d in zip(values, dims):
            fan_in, fan_out = _fans(tuple(v.shape), MuonDimensionNumbers() if d is None else d)
            if consistent_rms is None:
                factor = math.sqrt(max(1.0, fan_out / fan_in))
            else:
                factor = math.sqrt(max(fan_in, fan_out)) * consistent_rms
            out.append(_like(v, factor * _value(v)))
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformationExtraArgs(lambda params: EmptyState(), update)


def muon(
    learning_rate: float | Schedule,
    ns_coeffs: Any = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask | None = None,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: float | Schedule | None = None,
    muon_weight_dimension_numbers: WeightDimNumOrFn = None,
    consistent_rms: float | None = None,
    matrix_budget_bytes: int | None = None,
) -> GradientTransformation:
    """Muon, optax.contrib's: the same arguments, order, defaults and numbers.

    Matrices (by default every leaf of rank 2; choose with ``muon_weight_dimension_numbers``,
    see :func:`resolve_dims`) get :func:`scale_by_muon`, :func:`scale_by_shape`, decoupled
    weight decay (``weight_decay_mask`` selects, as in :func:`~functional_fsdp.masked`) and
    the learning rate; the other leaves get ``adamw(adam_learning_rate or learning_rate,
    adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, adam_weight_decay, nesterov=nesterov)``.
    ``ns_coeffs`` may name a preset: ``"standard"`` or ``"dion"``. ``matrix_budget_bytes``
    (not optax's) refuses, at ``init``, a matrix whose momentum takes more bytes whole (see
    :func:`check_budget`).

    Embeddings and output heads are matrices too; Muon's authors give them to Adam. Say so by
    name, e.g. ``muon_weight_dimension_numbers=lambda path, p: None if "embed" in path or
    "lm_head" in path or p.ndim != 2 else MuonDimensionNumbers()``.

    Example:
        >>> import torch
        >>> from functional_fsdp.optim.transforms import apply_updates
        >>> params = {"w": torch.zeros(2, 2), "norm": torch.ones(2)}
        >>> opt = muon(0.1)
        >>> grads = {"w": torch.tensor([[1.0, 0.0], [0.0, 2.0]]), "norm": torch.ones(2)}
        >>> updates, state = opt.update(grads, opt.init(params), params)
        >>> apply_updates(params, updates)["norm"]  # Adam's step, with optax's Nesterov default
        tensor([0.8526, 0.8526])
    """
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in NS_COEFFS_PRESETS:
            raise ValueError(
                f"muon: unknown ns_coeffs preset {ns_coeffs!r}; choose one of "
                f"{sorted(NS_COEFFS_PRESETS)} or pass (a, b, c)."
            )
        ns_coeffs = NS_COEFFS_PRESETS[ns_coeffs]
    rule = muon_weight_dimension_numbers

    def labels(params: Params) -> Any:
        treedef = optree.tree_structure(params)
        dims = resolve_dims("muon", rule, params)
        return optree.tree_unflatten(treedef, ["adam" if d is None else "muon" for d in dims])

    # The Muon group's leaves all get numbers: the rule's (a tree keyed by the params' paths,
    # a predicate, or fn(params), which optax too calls on the group's masked tree).
    inner_rule: WeightDimNumOrFn = MuonDimensionNumbers() if rule is None else rule

    from .wrappers import multi_transform

    return multi_transform(
        {
            "muon": chain(
                scale_by_muon(
                    ns_coeffs,
                    ns_steps,
                    beta,
                    eps,
                    mu_dtype,
                    nesterov=nesterov,
                    adaptive=adaptive,
                    preconditioning=preconditioning,
                    weight_dimension_numbers=inner_rule,
                    matrix_budget_bytes=matrix_budget_bytes,
                ),
                scale_by_shape(inner_rule, consistent_rms),
                add_decayed_weights(weight_decay, weight_decay_mask),
                scale_by_learning_rate(learning_rate),
            ),
            "adam": adamw(
                learning_rate if adam_learning_rate is None else adam_learning_rate,
                adam_b1,
                adam_b2,
                eps,
                adam_eps_root,
                mu_dtype,
                adam_weight_decay,
                nesterov=nesterov,
            ),
        },
        labels,
    )
