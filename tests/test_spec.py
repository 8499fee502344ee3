"""Tier 1: partition specs and the layout algebra (pure, no process group)."""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import numpy as np
import optree
import pytest
import torch.utils._pytree as torch_pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fsdp as ff
from functional_fsdp.spec import Layout, P

# --------------------------------------------------------------------------- P


def test_p_normalizes_entries():
    assert P(["tp", "dp"], None) == P(("tp", "dp"), None)
    assert P(("dp",)) == P("dp")
    assert P(()) == P(None)
    assert P(ff.Axis.DP, (ff.Axis.TP, "x")) == P("dp", ("tp", "x"))
    assert type(P(ff.Axis.DP)[0]) is str
    assert repr(P(ff.Axis.DP, None, ("tp", "x"))) == "P('dp', None, ('tp', 'x'))"
    assert repr(P()) == "P()"


def test_p_is_immutable_and_hashable():
    spec = P(("tp", "dp"), None)
    with pytest.raises(AttributeError, match="immutable"):
        spec._entries = ()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        spec.anything = 1  # type: ignore[attr-defined]
    assert hash(spec) == hash(P(["tp", "dp"], None))
    assert {spec: 1}[P(("tp", "dp"), None)] == 1
    assert len({P("dp"), P("dp"), P("dp", None), P()}) == 3
    assert P("dp") != ("dp",) and P() != ()
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec


def test_p_cannot_be_subclassed():
    with pytest.raises(TypeError, match="P cannot be subclassed"):

        class MyP(P):  # pragma: no cover - the class statement raises
            pass


def test_p_queries():
    spec = P(None, ("tp", "dp"), "pp")
    assert spec.axes == ("tp", "dp", "pp")
    assert len(spec) == 3 and list(spec) == [None, ("tp", "dp"), "pp"]
    assert spec.entry(0) == () and spec.entry(1) == ("tp", "dp") and spec.entry(7) == ()
    assert spec.dim_of("dp") == 1 and spec.dim_of("pp") == 2 and spec.dim_of("zz") is None
    assert spec.without("dp") == P(None, "tp", "pp")
    assert spec.without("pp").without("tp") == P(None, "dp", None)
    assert P("dp").padded(3) == P("dp", None, None)
    assert P("dp", None, None).trimmed() == P("dp")
    assert P(None, None).trimmed() == P()


@pytest.mark.parametrize(
    "tree",
    [P("dp"), {"w": P(("tp", "dp"), None), "b": [P(), P(None, "tp")]}],
    ids=["single", "tree"],
)
def test_p_is_a_pytree_leaf(tree):
    """Neither optree (with or without the namespace) nor torch's pytree looks inside a P."""
    expected = [tree] if isinstance(tree, P) else [tree["b"][0], tree["b"][1], tree["w"]]
    assert optree.tree_leaves(tree) == expected
    assert ff.tree_leaves(tree) == expected
    assert sorted(map(repr, torch_pytree.tree_leaves(tree))) == sorted(map(repr, expected))
    assert torch_pytree.tree_map(lambda s: s.without("dp"), tree) == optree.tree_map(
        lambda s: s.without("dp"), tree
    )


def test_p_rejects_a_duplicate_axis():
    with pytest.raises(ValueError, match=r"uses mesh axis 'dp' twice \(in dims 0 and 2\)"):
        P("dp", None, "dp")
    with pytest.raises(ValueError, match=r"'dp' twice \(in the tuple of dim 1\).*write a tuple"):
        P(None, ("dp", "dp"))
    with pytest.raises(ValueError, match=r"'tp' twice \(in dims 0 and 1\)"):
        P(("tp", "dp"), "tp")


def test_p_rejects_bad_entries():
    with pytest.raises(TypeError, match=r"P entry 1 is 3 \(int\); each entry must be None"):
        P("dp", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"P entry 0 is \('dp', 1\)"):
        P(("dp", 1))  # type: ignore[arg-type]


def test_layout_rejects_an_unknown_axis_and_too_many_entries():
    with pytest.raises(
        ValueError,
        match=r"cannot lay out shape \(4, 3\) with P\('zz'\) on Mesh\(dp=2\): P\('zz'\) names "
        r"mesh axis 'zz', which the mesh does not have \(its axes are \('dp',\)\); use one of",
    ):
        Layout.make((4, 3), P("zz"), {"dp": 2})
    with pytest.raises(
        ValueError, match=r"P\('dp', None\) has 2 entries but the tensor has only 1 dims"
    ):
        Layout.make((4,), P("dp", None), {"dp": 2})


def test_layout_example_uneven_two_axes():
    """7 rows over ("tp", "dp") on tp=2, dp=2: blocks of 4, then 2: [0:2] [2:4] [4:6] [6:7]."""
    layout = Layout.make((7, 3), P(("tp", "dp")), {"dp": 2, "tp": 2})
    assert layout.local_shape == (2, 3) and layout.local_numel == 6
    assert layout.block_sizes(0) == [7, 4, 2] and layout.block_sizes(1) == [3]
    owned = {
        (dp, tp): layout.owned({"dp": dp, "tp": tp})
        for dp, tp in itertools.product(range(2), range(2))
    }
    assert owned[(0, 0)] == ((slice(0, 2), slice(0, 3)), (0, 0))
    assert owned[(1, 0)] == ((slice(2, 4), slice(0, 3)), (0, 0))
    assert owned[(0, 1)] == ((slice(4, 6), slice(0, 3)), (0, 0))
    assert owned[(1, 1)] == ((slice(6, 7), slice(0, 3)), (1, 0))
    assert layout.gathered("dp") == Layout.make((7, 3), P("tp"), {"dp": 2, "tp": 2})


def test_layout_small_dim_leaves_whole_blocks_of_padding():
    """1 row over 4 ranks: rank 0 owns it, ranks 1-3 own nothing and hold one padding row."""
    layout = Layout.make((1,), P("dp"), {"dp": 4})
    assert layout.local_shape == (1,)
    assert [layout.owned({"dp": i}) for i in range(4)] == [
        ((slice(0, 1),), (0,)),
        ((slice(1, 1),), (1,)),
        ((slice(1, 1),), (1,)),
        ((slice(1, 1),), (1,)),
    ]


# --------------------------------------------------------------------------- property tests

AXES = ("a", "b", "c")


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """Random meshes (1-3 axes of size 1-4), shapes (dims 0-9) and specs (incl. 2-axis tuples)."""
    n_axes = draw(st.integers(1, 3))
    sizes = {a: draw(st.integers(1, 4)) for a in AXES[:n_axes]}
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    free = list(draw(st.permutations(list(sizes))))
    entries: list[object] = []
    for _ in range(ndim):
        kind = draw(st.sampled_from(["none", "one", "two"]))
        if kind == "one" and free:
            entries.append(free.pop())
        elif kind == "two" and len(free) >= 2:
            entries.append((free.pop(), free.pop()))
        else:
            entries.append(None)
    entries = entries[: draw(st.integers(0, ndim))]  # trailing entries may be left out
    return Layout.make(shape, P(*entries), sizes)


def coords(layout: Layout, axes: tuple[str, ...] | None = None) -> list[dict[str, int]]:
    """Every mesh coordinate (over ``axes``, all axes by default), as ``{axis: index}``."""
    sizes = layout.sizes
    axes = tuple(sizes) if axes is None else axes
    return [dict(zip(axes, c)) for c in itertools.product(*(range(sizes[a]) for a in axes))]


def np_block(full: np.ndarray, layout: Layout, coord: dict[str, int]) -> np.ndarray:
    """The coordinate's padded block (zeros for padding), cut with numpy from ``full``."""
    slices, pads = layout.owned(coord)
    return np.pad(full[slices], [(0, p) for p in pads])


def numbered(shape: tuple[int, ...]) -> np.ndarray:
    """1, 2, 3, ... so that 0 can only be padding."""
    return np.arange(1, math.prod(shape) + 1, dtype=np.int64).reshape(shape)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_owned_pieces_tile_the_tensor_exactly_once(layout: Layout):
    """Coordinates that differ in a used axis own disjoint pieces, and together all elements.

    Axes the spec does not use replicate: each element is owned by exactly
    prod(sizes of unused axes) coordinates, i.e. once per distinct used-axes coordinate.
    """
    count = np.zeros(layout.global_shape, dtype=np.int64)
    for coord in coords(layout):
        slices, pads = layout.owned(coord)
        count[slices] += 1
        for dim, (sl, pad) in enumerate(zip(slices, pads)):
            assert 0 <= sl.start <= sl.stop <= layout.global_shape[dim]
            assert pad == layout.local_shape[dim] - (sl.stop - sl.start) >= 0
    unused = [s for a, s in layout.axis_sizes if a not in layout.spec.axes]
    assert (count == math.prod(unused)).all()
    # And per distinct coordinate of the used axes: exactly once.
    once = np.zeros(layout.global_shape, dtype=np.int64)
    for coord in coords(layout, layout.spec.axes):
        once[layout.owned({**dict.fromkeys(layout.sizes, 0), **coord})[0]] += 1
    assert (once == 1).all()


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_padding_is_minimal(layout: Layout):
    """Every dim's local block has ceil(n / product of the sizes splitting it) entries."""
    sizes = layout.sizes
    for dim, n in enumerate(layout.global_shape):
        parts = math.prod(sizes[a] for a in layout.spec.entry(dim))
        assert layout.local_shape[dim] == -(-n // parts)
    assert layout.local_numel == math.prod(layout.local_shape)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_gathering_the_minor_axis_gives_the_major_axis_shard(layout: Layout, data: st.DataObject):
    """Concatenating the blocks of a minor axis, cut to the parent block's length, gives exactly
    the block of the layout without that axis (padding included), and what is cut off is
    padding only."""
    split = [d for d in range(len(layout.global_shape)) if layout.spec.entry(d)]
    if not split:
        return
    dim = data.draw(st.sampled_from(split))
    minor = layout.spec.entry(dim)[-1]
    parent = layout.gathered(minor)
    assert parent.spec == layout.spec.without(minor)
    full = numbered(layout.global_shape)
    others = tuple(a for a in layout.sizes if a != minor)
    for coord in coords(layout, others):
        pieces = [np_block(full, layout, {**coord, minor: i}) for i in range(layout.sizes[minor])]
        joined = np.concatenate(pieces, axis=dim)
        length = parent.local_shape[dim]
        assert joined.shape[dim] >= length
        kept, cut = np.split(joined, [length], axis=dim)
        np.testing.assert_array_equal(kept, np_block(full, parent, coord))
        assert not cut.any(), "a block beyond the parent's length holds data"


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_gathering_every_axis_minor_first_gives_the_tensor_without_padding(layout: Layout):
    """Repeatedly gathering minor axes (as ``gather`` does) ends at the exact global tensor."""
    full = numbered(layout.global_shape)
    blocks = {tuple(sorted(c.items())): np_block(full, layout, c) for c in coords(layout)}
    current = layout
    while current.spec.axes:
        dim = next(d for d in range(len(current.global_shape)) if current.spec.entry(d))
        minor = current.spec.entry(dim)[-1]
        parent = current.gathered(minor)
        merged = {}
        for c in coords(current):
            if c[minor]:
                continue
            parts = [
                blocks[tuple(sorted({**c, minor: i}.items()))] for i in range(current.sizes[minor])
            ]
            value = np.concatenate(parts, axis=dim).take(range(parent.local_shape[dim]), axis=dim)
            for i in range(current.sizes[minor]):
                merged[tuple(sorted({**c, minor: i}.items()))] = value
        blocks, current = merged, parent
    assert current.local_shape == layout.global_shape
    for value in blocks.values():
        np.testing.assert_array_equal(value, full)
