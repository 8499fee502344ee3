"""``Sharded``: a local shard plus its global shape, spec and mesh.

A ``Sharded`` is registered with optree under the library's namespace, and with
``torch.utils._pytree`` (which ``torch.func`` uses), as a node whose only child is the local
tensor. So ``tree_map`` over a tree of ``Sharded`` maps over local shards, and
``torch.func.grad(loss)(tree_of_sharded)`` returns a tree of ``Sharded`` gradients. The layout
is static auxiliary data.

The local tensor is the coordinate's padded block (see :mod:`functional_fsdp.spec`): every
rank holds the same shape, and padding is kept at zero. Padding never appears in a gathered
value or in :meth:`Sharded.to_dtensor`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.device_mesh import DeviceMesh

from ._tree import NAMESPACE
from .distributed.axes import axis_sizes
from .spec import Layout, P, format_mesh


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], spec: P, sizes: tuple[tuple[str, int], ...]) -> Layout:
    return Layout.make(shape, spec, dict(sizes))


class Sharded:
    """A DTensor-like value: this rank's padded local block of a global tensor.

    Attributes:
        local: this rank's block, of shape ``layout.local_shape`` (the same on every rank).
        global_shape: the shape of the full tensor.
        spec: how the dims are split over mesh axes.
        mesh: the named ``DeviceMesh``.

    Build one with :func:`functional_fsdp.shard` rather than by hand.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     w = ff.shard(torch.zeros(5, 3), mesh, ff.P("dp"))
        ...     print(w)
        Sharded(shape=(5, 3), dtype=torch.float32, spec=P('dp'), mesh=Mesh(dp=2), local=(3, 3))
    """

    __slots__ = ("global_shape", "local", "mesh", "spec")
    local: torch.Tensor
    global_shape: tuple[int, ...]
    spec: P
    mesh: DeviceMesh

    def __init__(
        self, local: torch.Tensor, global_shape: tuple[int, ...], spec: P, mesh: DeviceMesh
    ) -> None:
        if not isinstance(local, torch.Tensor):
            raise TypeError(
                f"Sharded needs its local block as a torch.Tensor, got {type(local).__name__}; "
                f"build Sharded values with ff.shard(full_tensor, mesh, spec)."
            )
        global_shape = tuple(int(s) for s in global_shape)
        if not isinstance(spec, P):
            raise TypeError(
                f"Sharded needs a P spec, got {spec!r} ({type(spec).__name__}); write "
                f"P('dp', None) rather than a tuple."
            )
        problem = local_shape_problem(tuple(local.shape), global_shape, spec, mesh)
        if problem:
            raise ValueError(problem)
        self.local = local
        self.global_shape = global_shape
        self.spec = spec.padded(len(global_shape))
        self.mesh = mesh

    @classmethod
    def _unchecked(
        cls, local: Any, global_shape: tuple[int, ...], spec: P, mesh: DeviceMesh
    ) -> Sharded:
        obj = object.__new__(cls)
        obj.local, obj.global_shape, obj.spec, obj.mesh = local, global_shape, spec, mesh
        return obj

    def replace(self, local: torch.Tensor) -> Sharded:
        """The same layout with another local block (its shape must match)."""
        return Sharded(local, self.global_shape, self.spec, self.mesh)

    @property
    def layout(self) -> Layout:
        return _layout(self.global_shape, self.spec, _sizes_key(self.mesh))

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return torch.Size(self.global_shape)

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def numel(self) -> int:
        """Elements of the global tensor."""
        return math.prod(self.global_shape)

    def __repr__(self) -> str:
        local = getattr(self.local, "shape", self.local)
        local_str = tuple(local) if isinstance(local, torch.Size) else repr(local)
        return (
            f"Sharded(shape={self.global_shape}, dtype={getattr(self.local, 'dtype', None)}, "
            f"spec={self.spec.trimmed()}, mesh={format_mesh(axis_sizes(self.mesh))}, "
            f"local={local_str})"
        )

    def _repr_html_(self) -> str:
        """The layout as a small HTML table (Jupyter shows it): which mesh coordinate owns
        which block, with padding, as :func:`functional_fsdp.visualize` draws it. Reads only
        the layout: no process group, no communication."""
        return _provided("_repr_html_", "functional_fsdp.display")(self)

    def to_dtensor(self) -> torch.distributed.tensor.DTensor:
        """Convert to a ``DTensor`` (lossless; padding is dropped).

        A dim split over axes in mesh order uses ``Shard``; a dim split over two axes against
        mesh order (FSDP on top of TP) uses torch's ``_StridedShard``.
        """
        return _provided("to_dtensor", "functional_fsdp.dtensor")(self)

    @staticmethod
    def from_dtensor(dtensor: torch.distributed.tensor.DTensor) -> Sharded:
        """Convert a ``DTensor`` with ``Shard``/``_StridedShard``/``Replicate`` placements."""
        return _provided("from_dtensor", "functional_fsdp.dtensor")(dtensor)


# Methods of Sharded whose code lives in a layer above this one: the picture (display.py)
# and the DTensor bridge (dtensor.py, which needs gather/reshard). Each of those modules
# provides its method when it is imported, which importing the package always does; the
# core never imports upward, and the method's signature and docstring stay on the class.
_PROVIDERS: dict[str, Callable[..., Any]] = {}


def provide(method: str, fn: Callable[..., Any]) -> None:
    """Install the implementation of ``Sharded.<method>`` (called once, by its module)."""
    _PROVIDERS[method] = fn


def _provided(method: str, module: str) -> Callable[..., Any]:
    fn = _PROVIDERS.get(method)
    if fn is None:  # only if the package was bypassed: fail loudly, never do nothing
        raise RuntimeError(
            f"Sharded.{method} is implemented in {module}, which has not been imported; "
            f"import functional_fsdp (or {module}) first."
        )
    return fn


def _sizes_key(mesh: DeviceMesh) -> tuple[tuple[str, int], ...]:
    return tuple(axis_sizes(mesh).items())


def local_shape_problem(
    local_shape: tuple[int, ...], global_shape: tuple[int, ...], spec: P, mesh: DeviceMesh
) -> str | None:
    """Why a local block of ``local_shape`` cannot belong to this layout, or ``None``."""
    layout = _layout(global_shape, spec.padded(len(global_shape)), _sizes_key(mesh))
    if tuple(local_shape) == layout.local_shape:
        return None
    return (
        f"Sharded local shape {tuple(local_shape)} contradicts its layout: global shape "
        f"{global_shape} with {spec.trimmed()} on {format_mesh(axis_sizes(mesh))} has padded "
        f"local blocks of shape {layout.local_shape}. Build Sharded values with "
        f"ff.shard(full_tensor, mesh, spec), or pass the padded block; a function mapped over "
        f"local shards must keep their shape."
    )


def _flatten(s: Sharded) -> tuple[tuple[Any], tuple[Any, ...], tuple[str]]:
    return (s.local,), (s.global_shape, s.spec, s.mesh), ("local",)


def _unflatten(aux: tuple[Any, ...], children: tuple[Any, ...]) -> Sharded:
    return Sharded._unchecked(children[0], *aux)


optree.register_pytree_node(Sharded, _flatten, _unflatten, namespace=NAMESPACE)
torch_pytree.register_pytree_node(
    Sharded,
    lambda s: ([s.local], (s.global_shape, s.spec, s.mesh)),
    lambda children, aux: Sharded._unchecked(children[0], *aux),
    serialized_type_name="functional_fsdp.Sharded",
    flatten_with_keys_fn=lambda s: (
        [(torch_pytree.GetAttrKey("local"), s.local)],
        (s.global_shape, s.spec, s.mesh),
    ),
)


def unpad(local: torch.Tensor, layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    """The real (unpadded) part of a coordinate's block, as a view."""
    _, pads = layout.owned(coord)
    out = local
    for dim, pad in enumerate(pads):
        if pad:
            out = out.narrow(dim, 0, out.shape[dim] - pad)
    return out


def block_of(full: torch.Tensor, layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    """A coordinate's padded block cut from the full tensor (a new tensor)."""
    slices, pads = layout.owned(coord)
    piece = full[slices]
    if any(pads):
        padding: list[int] = []
        for pad in reversed(pads):
            padding += [0, pad]
        return torch.nn.functional.pad(piece, padding)
    return piece.clone()
