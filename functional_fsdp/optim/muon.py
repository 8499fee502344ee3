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

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import optree
import torch

from .._tree import dotted
from ..distributed import collectives as C
from ..distributed import process
from ..distributed.accounting import labelled
from ..distributed.axes import axis_sizes, mesh_grid
from ..distributed.simulate import is_simulated
from ..sharded import Sharded
from . import _muon_exchange as X
from ._muon_exchange import COMM_LABEL as COMM_LABEL
from ._muon_exchange import exchange_bytes as exchange_bytes
from ._muon_exchange import exchange_memory as exchange_memory
from ._muon_exchange import recording_exchanges as recording_exchanges
from ._muon_shapes import MuonDimensionNumbers as MuonDimensionNumbers
from ._muon_shapes import _axes, _check_dims, _fans
from ._muon_shapes import assign_owners as assign_owners
from ._muon_shapes import ns_flops as ns_flops
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


def _ns_step(
    x: torch.Tensor,
    c: torch.Tensor,
    first: bool,
    kind: str,
    eps: float,
    psum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One quintic step ``c0 X + (c1 A + c2 A A) X``, ``A = X Xᵀ`` (optax's order of
    operations; ``A`` summed by ``psum`` over the blocks of a split matrix); the first step
    of ``aol``/``schatten`` rescales ``X`` first. ``x`` may be a batch of matrices."""
    a = x @ x.mT
    if psum is not None:
        a = psum(a)
    if first and kind == "aol":
        s = torch.rsqrt(torch.clamp(a.abs().sum(-1), min=eps)).unsqueeze(-1)
        x, a = x * s, a * s * s.mT
    elif first and kind == "schatten":
        s = torch.rsqrt(torch.clamp(torch.linalg.matrix_norm(a), min=eps))[..., None, None]
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


def orthogonalize_split(
    block: torch.Tensor,
    ns_coeffs: Any,
    ns_steps: int,
    preconditioning: Preconditioning,
    eps: float,
    dimension_numbers: MuonDimensionNumbers,
    split: Split,
) -> torch.Tensor:
    """This rank's block of a matrix split over ranks, orthogonalized together with the
    other ranks' blocks: :func:`orthogonalize_via_newton_schulz`'s iteration, where each
    step's ``X Xᵀ`` (of the matrix's shorter side, which every block holds whole) is the sum
    of the blocks' own products, one all-reduce per step (and one for the norm).

    ``block`` is cut along :func:`~functional_fsdp.optim._muon_shapes.split_dim` (the major
    dim of the longer side), whole on every other dim; any cut of that side works, since
    ``X Xᵀ`` is a sum over its columns and ``B X`` acts on each column alone. ``spectral``
    takes the largest singular value as the square root of ``X Xᵀ``'s largest eigenvalue.
    """
    shape = split.shape
    coeffs = _coeff_tensor(ns_coeffs).to(device=block.device, dtype=block.dtype)
    steps = [coeffs] * int(ns_steps) if coeffs.ndim == 1 else list(coeffs)
    red, out = _axes(len(shape), dimension_numbers)
    batch = tuple(a for a in range(len(shape)) if a not in red and a not in out)
    order = batch + red + out
    x = block.permute(order).reshape(
        math.prod(block.shape[a] for a in batch),
        math.prod(block.shape[a] for a in red),
        math.prod(block.shape[a] for a in out),
    )
    fan_in, fan_out = _fans(shape, dimension_numbers)
    transposed = fan_in > fan_out  # optax's orientation: the shorter side first
    if transposed:
        x = x.mT
    if preconditioning == "frobenius":
        norm = torch.sqrt(split.psum(x.square().sum((-2, -1))))
        x = x / (norm + eps)[:, None, None]
    elif preconditioning == "spectral":
        top = torch.linalg.eigvalsh(split.psum(x @ x.mT))[:, -1]
        x = x / (torch.sqrt(torch.clamp(top, min=0)) + eps)[:, None, None]
    for i, c in enumerate(steps):
        x = _ns_step(x, c, i == 0, preconditioning, eps, split.psum)
    if transposed:
        x = x.mT
    inverse = sorted(range(len(shape)), key=lambda i: order[i])
    return x.reshape([block.shape[a] for a in order]).permute(inverse)


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


# --------------------------------------------------------------------------- whole matrices


class _Leaf(NamedTuple):
    path: str
    value: Any  # the Sharded (or plain tensor) whose layout the momentum has
    local: torch.Tensor  # this rank's block of the momentum estimate to orthogonalize
    dims: MuonDimensionNumbers
    split: bool = False  # over the budget: orthogonalized by all ranks of its mesh together


class Split(NamedTuple):
    """What :func:`orthogonalize_split` needs besides a rank's block: the matrix's global
    shape, and the sum over the ranks that hold its other blocks."""

    shape: tuple[int, ...]
    psum: Callable[[torch.Tensor], torch.Tensor]


# ns(x, dims, split): x whole (split None), or this rank's block of a split matrix.
Orthogonalize = Callable[..., torch.Tensor]


def _orthogonalize_all(leaves: list[_Leaf], ns: Orthogonalize) -> list[torch.Tensor]:
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


def _on_simulated(leaves: list[_Leaf], ns: Orthogonalize) -> list[torch.Tensor]:
    """A simulated mesh runs one all-to-all size for every rank: each rank gathers and
    orthogonalizes every matrix (the same numbers, without the balance or the split)."""
    from ..resharding import gather, shard

    out = []
    for leaf in leaves:
        v = leaf.value
        full = gather(v.replace(leaf.local))
        out.append(shard(ns(full, leaf.dims), v.mesh, v.spec).local)
    return out


def _on_owners(mesh: Any, leaves: list[_Leaf], ns: Orthogonalize) -> list[torch.Tensor]:
    """Each whole matrix to its owner and each split one to every rank's region (one
    all-to-all per dtype), orthogonalized there, and each rank's blocks back (another)."""
    grid = mesh_grid(mesh)
    coords = [grid.coordinate(r) for r in grid.ranks]
    me = grid.ranks.index(process.rank())
    sizes = axis_sizes(mesh)
    matrices = [
        X.Matrix(tuple(x.value.global_shape), x.value.spec, x.dims, x.local.dtype, x.split)
        for x in leaves
    ]
    X.record(sizes, matrices)
    routes = X.routes(matrices, sizes)
    axes = tuple(sizes)

    def psum(t: torch.Tensor) -> torch.Tensor:
        with labelled(COMM_LABEL):  # the optimizer's, over every axis (tp too)
            return C.wait(C.raw_all_reduce(t, mesh, axes))

    out: list[torch.Tensor | None] = [None] * len(leaves)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.local.dtype, []).append(i)
    for indices in by_dtype.values():
        items = [X.Item(leaves[i].value.layout, leaves[i].local, routes[i]) for i in indices]

        def orthogonalize(k: int, region: torch.Tensor, indices: list[int] = indices) -> Any:
            m = matrices[indices[k]]
            if m.split:
                return ns(region, m.dims, Split(m.shape, psum))
            return ns(region, m.dims)

        for i, r in zip(indices, X.run(mesh, coords, me, items, orthogonalize)):
            out[i] = r
    return out  # type: ignore[return-value]


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
            dtype) on the rank that orthogonalizes it. A larger leaf is orthogonalized by
            all the ranks of its mesh together, each holding a block of it (see
            :func:`orthogonalize_split`); ``init`` refuses one that is not sharded over
            several ranks (see :func:`check_budget`). ``None``: every matrix whole on one
            rank. Not optax's (an extension).

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
        for path, v, m, d, kept in zip(paths, values, mu_hat, dims, mu):
            d = MuonDimensionNumbers() if d is None else d
            _check_dims(f"scale_by_muon: {dotted(path) or '<root>'}", tuple(v.shape), d)
            split = _over_budget(v, kept.dtype, matrix_budget_bytes) and _splittable(v)
            leaves.append(_Leaf(dotted(path), v, m, d, split))
        c = state.ns_coeffs

        def ns(x: torch.Tensor, d: MuonDimensionNumbers, split: Split | None = None) -> Any:
            if split is None:
                return orthogonalize_via_newton_schulz(x, c, int(ns_steps), preconditioning, eps, d)
            return orthogonalize_split(x, c, int(ns_steps), preconditioning, eps, d, split)

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


def _over_budget(x: Any, dtype: torch.dtype, budget: int | None) -> bool:
    return budget is not None and math.prod(x.shape) * dtype.itemsize > budget


def _splittable(x: Any) -> bool:
    return isinstance(x, Sharded) and math.prod(axis_sizes(x.mesh).values()) > 1


def check_budget(where: str, params: Params, mu_dtype: torch.dtype | None, budget: int) -> None:
    """Check ``matrix_budget_bytes``, and refuse a leaf over it that cannot be split.

    A leaf whose momentum, whole, takes more than ``budget`` bytes is orthogonalized by all
    the ranks of its mesh together (see :func:`orthogonalize_split`); a plain tensor, or a
    value on a one-rank mesh, has no ranks to split over and is refused by name.

    Example:
        >>> import torch
        >>> try:
        ...     check_budget("scale_by_muon", {"w": torch.ones(4, 4)}, None, 32)
        ... except ValueError as e:
        ...     print(str(e).split(". ")[0])
        scale_by_muon: w of shape (4, 4) (torch.float32) takes 64 B whole, over matrix_budget_bytes=32, and is not sharded over several ranks, so it cannot be split
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise TypeError(f"{where}: matrix_budget_bytes must be a positive int, got {budget!r}.")
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    for path, x in zip(paths, leaves):
        dtype = mu_dtype or x.dtype
        if not _over_budget(x, dtype, budget) or _splittable(x):
            continue
        where_is = ""
        if isinstance(x, Sharded):
            where_is = f", spec {x.spec} on mesh {dict(axis_sizes(x.mesh))}"
        nbytes = math.prod(x.shape) * dtype.itemsize
        raise ValueError(
            f"{where}: {dotted(path) or '<root>'} of shape {tuple(x.shape)} ({dtype}"
            f"{where_is}) takes {nbytes} B whole, over matrix_budget_bytes={budget}, and is "
            f"not sharded over several ranks, so it cannot be split. Shard it on a mesh of "
            f"several ranks (ff.shard, ff.fsdp; a matrix over the budget is then "
            f"orthogonalized by all of them together), raise matrix_budget_bytes to at least "
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
    (not optax's): a matrix whose momentum takes more bytes whole is orthogonalized by all
    the ranks of its mesh together instead of by one owner (see :func:`scale_by_muon`).

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
