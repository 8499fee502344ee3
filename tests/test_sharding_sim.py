"""Tier 2: numerics on simulated meshes (N ranks in one process), against plain-torch
single-process references."""

from __future__ import annotations

import collections
import contextlib
import itertools

import numpy as np
import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch.distributed._local_tensor import enabled_local_tensor_mode

import functional_fsdp as ff
from functional_fsdp.distributed.mesh import axis_names, coordinate_of
from functional_fsdp.distributed.simulate import per_coordinate

P = ff.P
NT = collections.namedtuple("NT", ["a", "b"])


@pytest.fixture
def mesh22():
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        yield mesh


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def outside_simulation():
    """Create plain tensors: inside a simulation, factories return per-rank LocalTensors."""
    mode = enabled_local_tensor_mode()
    with mode.disable() if mode is not None else contextlib.nullcontext():
        yield


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A plain random tensor (the same value for every rank), also inside a simulation."""
    with outside_simulation():
        return torch.randn(*shape, dtype=dtype)


def world(mesh) -> int:
    return mesh.mesh.numel()


def per_rank(mesh, values: list[torch.Tensor]) -> torch.Tensor:
    """A simulated tensor holding ``values[r]`` on rank ``r``."""
    names = axis_names(mesh)
    return per_coordinate(mesh, lambda c: values[int(mesh.mesh[tuple(c[a] for a in names)])])


def values_of(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Per-rank values (a tensor that is the same everywhere counts for every rank)."""
    vals = [v.detach() for v in ff.rank_values(t)]
    return vals * n if len(vals) == 1 else vals


def assert_ranks_equal(t: torch.Tensor, expected: list[torch.Tensor], what: str = "") -> None:
    got = values_of(t, len(expected))
    assert len(got) == len(expected), what
    for r, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, (what, r, g.shape, e.shape)
        torch.testing.assert_close(g, e, msg=lambda m, r=r: f"{what} rank {r}: {m}")


def group(mesh, rank: int, axis: str) -> list[int]:
    """The ranks in ``rank``'s group along ``axis``, ordered by their index on ``axis``."""
    names = axis_names(mesh)
    coord = coordinate_of(mesh, rank)
    ranks = mesh.mesh
    index = tuple(slice(None) if a == axis else coord[a] for a in names)
    return [int(r) for r in ranks[index].reshape(-1)]


def randn_per_rank(n: int, *shape: int) -> list[torch.Tensor]:
    return [randn(*shape) for _ in range(n)]


def check_grads_four_ways(f, x: torch.Tensor, w: torch.Tensor, expected, what: str) -> None:
    """The gradient of ``(w * f(x)).sum()`` by torch.func.grad, grad_and_value, vjp and
    plain autograd (each rank's loss back-propagated, as on real processes) is ``expected``."""

    def loss(x):
        return (w * f(x)).sum()

    n = len(expected)
    assert_ranks_equal(torch.func.grad(loss)(x), expected, f"{what} grad")
    g, value = torch.func.grad_and_value(loss)(x)
    assert_ranks_equal(g, expected, f"{what} grad_and_value")
    assert_ranks_equal(value, values_of(loss(x), n), f"{what} value")
    _, pullback = torch.func.vjp(f, x)
    assert_ranks_equal(pullback(w)[0], expected, f"{what} vjp")
    leaf = x.detach().clone().requires_grad_()
    loss(leaf).backward()
    assert_ranks_equal(leaf.grad, expected, f"{what} backward")


# --------------------------------------------------------------------------- Sharded as a pytree


def test_sharded_is_an_optree_node_under_the_namespace(mesh22):
    full = {"w": randn(5, 3), "b": randn(7)}
    x = ff.shard(full, mesh22, {"w": P(("tp", "dp")), "b": P("dp")})
    # Without the namespace a Sharded is a leaf; with it, its only child is the local tensor.
    assert [type(v) for v in optree.tree_leaves(x)] == [ff.Sharded, ff.Sharded]
    assert all(a is b for a, b in zip(ff.tree_leaves(x), [x["b"].local, x["w"].local]))
    doubled = ff.tree_map(lambda t: t * 2, x)
    for k in full:
        assert isinstance(doubled[k], ff.Sharded)
        assert (doubled[k].global_shape, doubled[k].spec, doubled[k].mesh) == (
            x[k].global_shape,
            x[k].spec,
            x[k].mesh,
        )
        assert_ranks_equal(doubled[k].local, [2 * v for v in values_of(x[k].local, 4)])
    gathered = ff.gather(doubled)
    for k in full:
        assert_ranks_equal(gathered[k], [2 * full[k]] * 4)
    # tree_map over two trees pairs local shards.
    summed = ff.tree_map(torch.add, x, doubled)
    assert_ranks_equal(summed["w"].local, [3 * v for v in values_of(x["w"].local, 4)])


def test_sharded_is_a_torch_pytree_node(mesh22):
    x = {"w": ff.shard(randn(5, 3), mesh22, P("dp"))}
    leaves, spec = torch_pytree.tree_flatten(x)
    assert len(leaves) == 1 and leaves[0] is x["w"].local
    back = torch_pytree.tree_unflatten([leaves[0] + 1], spec)
    assert isinstance(back["w"], ff.Sharded) and back["w"].spec == P("dp", None)
    (path, _), *_ = torch_pytree.tree_flatten_with_path(x)[0]
    assert path == (torch_pytree.MappingKey("w"), torch_pytree.GetAttrKey("local"))
    assert torch_pytree.keystr(path) == "['w'].local"


def test_repr(mesh22):
    w = ff.shard(torch.zeros(5, 3), mesh22, P(("tp", "dp")))
    assert repr(w) == (
        "Sharded(shape=(5, 3), dtype=torch.float32, spec=P(('tp', 'dp')), "
        "mesh=Mesh(dp=2, tp=2), local=(2, 3))"
    )
    b = ff.shard(torch.zeros(3, 6, dtype=torch.bfloat16), mesh22, P(None, "tp"))
    assert repr(b) == (
        "Sharded(shape=(3, 6), dtype=torch.bfloat16, spec=P(None, 'tp'), "
        "mesh=Mesh(dp=2, tp=2), local=(3, 3))"
    )
    r = ff.shard(torch.zeros(()), mesh22, P())
    assert repr(r) == (
        "Sharded(shape=(), dtype=torch.float32, spec=P(), mesh=Mesh(dp=2, tp=2), local=())"
    )


def test_sharded_properties(mesh22):
    w = ff.shard(torch.zeros(5, 3, dtype=torch.float64), mesh22, P(None, ("dp", "tp")))
    assert w.shape == torch.Size([5, 3]) and w.ndim == 2 and w.numel() == 15
    assert w.dtype == torch.float64 and w.device == torch.device("cpu")
    assert w.layout == ff.Layout.make((5, 3), P(None, ("dp", "tp")), {"dp": 2, "tp": 2})
    assert tuple(w.local.shape) == w.layout.local_shape == (5, 1)
    assert w.replace(torch.ones(5, 1)).spec == w.spec


# --------------------------------------------------------------------------- collectives

MESHES = [({"dp": 4}, "dp"), ({"dp": 2, "tp": 2}, "dp"), ({"dp": 2, "tp": 2}, "tp")]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(("axes", "axis"), MESHES, ids=["dp4", "2x2-dp", "2x2-tp"])
def test_all_gather_and_reduce_scatter(axes, axis, dim):
    """Forward values and gradients (four ways) against plain-torch references; each one's
    gradient is the other one."""
    with ff.simulated_mesh(axes) as mesh:
        n, size = world(mesh), axes[axis]
        xs = randn_per_rank(n, 4, 8)
        ws_ag = randn_per_rank(n, *((4 * size, 8) if dim == 0 else (4, 8 * size)))
        ws_rs = randn_per_rank(n, *((4 // size, 8) if dim == 0 else (4, 8 // size)))
        x = per_rank(mesh, xs)

        # all_gather: rank r gets its group's tensors concatenated in axis order.
        ag_ref = [torch.cat([xs[s] for s in group(mesh, r, axis)], dim) for r in range(n)]
        assert_ranks_equal(ff.all_gather(x, mesh, axis, dim), ag_ref)
        leaves = [t.clone().requires_grad_() for t in xs]
        total = sum(
            (ws_ag[r] * torch.cat([leaves[s] for s in group(mesh, r, axis)], dim)).sum()
            for r in range(n)
        )
        ag_grad_ref = list(torch.autograd.grad(total, leaves))
        check_grads_four_ways(
            lambda x: ff.all_gather(x, mesh, axis, dim), x, per_rank(mesh, ws_ag), ag_grad_ref, "AG"
        )

        # reduce_scatter (sum and mean): rank r keeps its block of the group's sum.
        for op, scale in (("sum", 1.0), ("mean", 1.0 / size)):

            def rs_ref(ts):
                return [
                    scale
                    * sum(ts[s] for s in group(mesh, r, axis)).chunk(size, dim)[
                        group(mesh, r, axis).index(r)
                    ]
                    for r in range(n)
                ]

            assert_ranks_equal(ff.reduce_scatter(x, mesh, axis, dim, op), rs_ref(xs))
            leaves = [t.clone().requires_grad_() for t in xs]
            total = sum((w * y).sum() for w, y in zip(ws_rs, rs_ref(leaves)))
            rs_grad_ref = list(torch.autograd.grad(total, leaves))
            check_grads_four_ways(
                lambda x, op=op: ff.reduce_scatter(x, mesh, axis, dim, op),
                x,
                per_rank(mesh, ws_rs),
                rs_grad_ref,
                f"RS {op}",
            )

        # Transposes: sum_r <AG(x)_r, y_r> == sum_r <x_r, RS(y)_r>, and vjp(AG) == RS.
        y = per_rank(mesh, ws_ag)
        lhs = sum(v.sum() for v in values_of(ff.all_gather(x, mesh, axis, dim) * y, n))
        rhs = sum(v.sum() for v in values_of(x * ff.reduce_scatter(y, mesh, axis, dim), n))
        torch.testing.assert_close(lhs, rhs)
        _, pullback = torch.func.vjp(lambda x: ff.all_gather(x, mesh, axis, dim), x)
        assert_ranks_equal(pullback(y)[0], values_of(ff.reduce_scatter(y, mesh, axis, dim), n))
        _, pullback = torch.func.vjp(lambda y: ff.reduce_scatter(y, mesh, axis, dim), y)
        assert_ranks_equal(pullback(x)[0], values_of(ff.all_gather(x, mesh, axis, dim), n))


@pytest.mark.parametrize(
    ("axes", "axis"),
    [*MESHES, ({"dp": 2, "tp": 2}, ("dp", "tp"))],
    ids=["dp4", "2x2-dp", "2x2-tp", "2x2-both"],
)
def test_all_reduce_and_all_reduce_grad(axes, axis):
    """all_reduce: psum forward, identity backward (the cotangent of a replicated value counts
    once); all_reduce_grad: identity forward, psum backward. Each is the other's transpose."""
    with ff.simulated_mesh(axes) as mesh:
        n = world(mesh)
        axes_ = (axis,) if isinstance(axis, str) else axis

        def members(r):
            out = {r}
            for a in axes_:
                out = {m for o in out for m in group(mesh, o, a)}
            return sorted(out)

        size = len(members(0))
        xs, ws = randn_per_rank(n, 3, 2), randn_per_rank(n, 3, 2)
        x, w = per_rank(mesh, xs), per_rank(mesh, ws)
        for op, scale in (("sum", 1.0), ("mean", 1.0 / size)):
            psum_x = [scale * sum(xs[s] for s in members(r)) for r in range(n)]
            psum_w = [scale * sum(ws[s] for s in members(r)) for r in range(n)]
            assert_ranks_equal(ff.all_reduce(x, mesh, axis, op), psum_x)
            assert_ranks_equal(ff.all_reduce_grad(x, mesh, axis, op), xs)
            check_grads_four_ways(
                lambda x, op=op: ff.all_reduce(x, mesh, axis, op),
                x,
                w,
                [scale * v for v in ws],
                f"all_reduce {op}",
            )
            check_grads_four_ways(
                lambda x, op=op: ff.all_reduce_grad(x, mesh, axis, op),
                x,
                w,
                psum_w,
                f"all_reduce_grad {op}",
            )

        # Single-process references. A replicated cotangent through all_reduce: the gradient
        # of the one global loss (w . sum_s x_s) is w. A replicated parameter used through
        # all_reduce_grad on every rank: the gradient of sum_r (w_r . x) is sum_r w_r.
        w_rep = randn(3, 2)
        leaves = [t.clone().requires_grad_() for t in xs]
        (ref,) = torch.autograd.grad((w_rep * sum(leaves[s] for s in members(0))).sum(), leaves[0])
        g = torch.func.grad(lambda x: (w_rep * ff.all_reduce(x, mesh, axis)).sum())(x)
        assert_ranks_equal(g, [ref] * n)
        param = randn(3, 2).requires_grad_()
        (ref,) = torch.autograd.grad(sum((ws[s] * param).sum() for s in members(0)), param)
        g = torch.func.grad(lambda p: (w * ff.all_reduce_grad(p, mesh, axis)).sum())(param.detach())
        torch.testing.assert_close(values_of(g, n)[0], ref)


def test_collective_over_a_size_one_axis_is_skipped():
    with ff.simulated_mesh({"dp": 4, "tp": 1}) as mesh:
        x = per_rank(mesh, randn_per_rank(4, 2, 3))
        with ff.count_comms() as comms:
            assert_ranks_equal(ff.all_gather(x, mesh, "tp"), values_of(x, 4))
            assert_ranks_equal(ff.reduce_scatter(x, mesh, "tp", 1), values_of(x, 4))
            assert_ranks_equal(ff.all_reduce(x, mesh, "tp"), values_of(x, 4))
            w = ff.shard(randn(6, 2), mesh, P(("tp", "dp")))
            ff.gather(w)
        assert comms.count(axis="tp") == 0
        assert comms.count() == 1 and comms.count("all_gather", "dp") == 1
        # The gathered value is a new tensor even without communication: writing to it leaves
        # the shard alone.
        v = ff.shard(randn(3), mesh, P("tp"))
        before = [t.clone() for t in values_of(v.local, 4)]
        ff.gather(v).add_(1)
        assert_ranks_equal(v.local, before)


# --------------------------------------------------------------------------- shard / gather


def example_tree() -> dict:
    return {
        "dense": {"w": randn(5, 3), "b": randn(3)},
        "blocks": [randn(2, 7), 5, "name"],
        "pair": (randn(9), None),
        "nt": NT(a=randn(4, 4, 2), b=3.0),
        "scalar": randn(()),
    }


SPEC_FORMS = {
    "single": P(),
    "tree": {
        "dense": {"w": P(("tp", "dp")), "b": P("tp")},
        "blocks": [P(None, "dp"), None, None],
        "pair": (P("dp"), None),
        "nt": NT(a=P("tp", None, "dp"), b=None),
        "scalar": P(),
    },
    "prefix": {
        "dense": P("dp"),
        "blocks": P(None, ("dp", "tp")),
        "pair": P("tp"),
        "nt": P(("dp", "tp")),
        "scalar": None,
    },
    "rule": lambda path, t: P() if t.ndim == 0 else P("dp") if path.endswith("w") else P("tp"),
}


@pytest.mark.parametrize("form", list(SPEC_FORMS))
def test_shard_then_gather_is_the_identity_on_any_pytree(mesh22, form):
    tree = example_tree()
    before = optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)
    sharded = ff.shard(tree, mesh22, SPEC_FORMS[form])
    assert optree.tree_structure(sharded, none_is_leaf=True) == optree.tree_structure(
        tree, none_is_leaf=True
    )
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    out_leaves = optree.tree_leaves(sharded, none_is_leaf=True)
    for path, leaf, out in zip(paths, leaves, out_leaves):
        if isinstance(leaf, torch.Tensor):
            assert isinstance(out, ff.Sharded) and out.global_shape == tuple(leaf.shape), path
        else:
            assert out is leaf, path  # non-tensor leaves pass through unchanged
    if form == "tree":
        assert sharded["dense"]["w"].spec == P(("tp", "dp"), None)
        assert sharded["nt"].a.spec == P("tp", None, "dp") and sharded["nt"].b == 3.0
    if form == "prefix":
        assert sharded["blocks"][0].spec == P(None, ("dp", "tp"))
        assert sharded["scalar"].spec == P()
    if form == "rule":
        assert sharded["dense"]["w"].spec == P("dp", None) and sharded["pair"][0].spec == P("tp")
    gathered = ff.gather(sharded)
    assert isinstance(gathered["nt"], NT) and isinstance(gathered["pair"], tuple)
    for path, leaf, out in zip(paths, leaves, optree.tree_leaves(gathered, none_is_leaf=True)):
        if isinstance(leaf, torch.Tensor):
            assert_ranks_equal(out, [leaf] * 4)
        else:
            assert out is leaf, path
    # Nothing was mutated.
    for a, b in zip(leaves, optree.tree_leaves(before, none_is_leaf=True)):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)


def test_rules_receive_dotted_paths(mesh22):
    seen = {}

    def rule(path, t):
        seen[path] = tuple(t.shape)
        return P("dp") if path == "dense.w" else None

    sharded = ff.shard(example_tree(), mesh22, rule)
    assert seen["dense.w"] == (5, 3) and seen["blocks.0"] == (2, 7) and seen["pair.0"] == (9,)
    assert len(seen) == 6  # tensors only
    assert sharded["dense"]["w"].spec == P("dp", None) and sharded["dense"]["b"].spec == P(None)


def test_padding_is_zero_and_local_blocks_match_the_layout(mesh22):
    with outside_simulation():
        full = torch.arange(1.0, 1 + 7 * 3).reshape(7, 3)
    w = ff.shard(full, mesh22, P(("tp", "dp")))  # rows [0:2] [2:4] [4:6] [6:7] + 1 pad row
    blocks = values_of(w.local, 4)
    # Ranks are row-major over (dp, tp): rank = 2 * dp + tp; tp is the major split of rows.
    assert torch.equal(blocks[0], full[0:2]) and torch.equal(blocks[2], full[2:4])
    assert torch.equal(blocks[1], full[4:6])
    assert torch.equal(blocks[3], torch.cat([full[6:7], torch.zeros(1, 3)]))


def test_gather_one_axis_gives_the_major_axis_shard(mesh22):
    full = randn(9, 4)
    w = ff.shard(full, mesh22, P(("tp", "dp")))
    part = ff.gather(w, "dp")
    assert isinstance(part, ff.Sharded) and part.spec == P("tp", None)
    assert_ranks_equal(part.local, values_of(ff.shard(full, mesh22, P("tp")).local, 4))
    # Naming both axes, or all by default, gives the plain tensor.
    assert_ranks_equal(ff.gather(w, ["tp", "dp"]), [full] * 4)
    assert_ranks_equal(ff.gather(part), [full] * 4)
    # A value whose spec does not use the axis is returned as it is; plain leaves pass.
    v = ff.shard(randn(3), mesh22, P("dp"))
    out = ff.gather({"v": v, "t": full}, "tp")
    assert out["v"] is v and out["t"] is full
    # Minor axis of a dim split over (dp, tp) in mesh order.
    w2 = ff.shard(full, mesh22, P(None, ("dp", "tp")))
    assert_ranks_equal(
        ff.gather(w2, "tp").local, values_of(ff.shard(full, mesh22, P(None, "dp")).local, 4)
    )


def test_gather_is_differentiable_its_gradient_is_the_reduce_scatter(mesh22):
    """vjp of gather with per-rank cotangents c_r: each rank gets its block of the sum of c
    over the ranks the value was gathered across (not over axes its spec does not use)."""
    full = {"a": randn(5, 3), "b": randn(7)}
    x = ff.shard(full, mesh22, {"a": P(("tp", "dp")), "b": P("dp")})
    cs = {k: randn_per_rank(4, *v.shape) for k, v in full.items()}
    _, pullback = torch.func.vjp(ff.gather, x)
    (grads,) = pullback({k: per_rank(mesh22, cs[k]) for k in full})
    assert isinstance(grads["a"], ff.Sharded) and grads["a"].spec == x["a"].spec
    total_a = sum(cs["a"])
    assert_ranks_equal(
        grads["a"].local, values_of(ff.shard(total_a, mesh22, P(("tp", "dp"))).local, 4)
    )
    # "b" is replicated over tp: its gradient sums over each dp group only (ranks {0,2}, {1,3}).
    for tp in range(2):
        dp_sum = cs["b"][tp] + cs["b"][2 + tp]
        expected = values_of(ff.shard(dp_sum, mesh22, P("dp")).local, 4)
        got = values_of(grads["b"].local, 4)
        for r in (tp, 2 + tp):
            assert torch.allclose(got[r], expected[r])


def test_grad_through_gather_matches_the_single_process_reference(mesh22):
    """loss_r = sum_i (w_ir * sin(gathered_i)) with rank-dependent weights; the gradient of
    sum_r loss_r, computed on full tensors in one process, equals the Sharded gradients."""
    full = {"a": randn(5, 3), "b": randn(7), "c": randn(3, 10)}
    specs = {"a": P(("tp", "dp")), "b": P(("dp", "tp")), "c": P("tp", "dp")}
    x = ff.shard(full, mesh22, specs)
    ws = {k: randn_per_rank(4, *v.shape) for k, v in full.items()}
    w = {k: per_rank(mesh22, v) for k, v in ws.items()}

    def loss(params):
        g = ff.gather(params)
        return sum((w[k] * g[k].sin()).sum() for k in full)

    ref = torch.func.grad(lambda f: sum((sum(ws[k]) * f[k].sin()).sum() for k in full))(full)
    expected = ff.shard(ref, mesh22, specs)
    grads = torch.func.grad(loss)(x)
    for k in full:
        assert isinstance(grads[k], ff.Sharded) and grads[k].spec == x[k].spec
        # Local blocks, padding (zero) included, and the gathered gradient.
        assert_ranks_equal(grads[k].local, values_of(expected[k].local, 4))
        assert_ranks_equal(ff.gather(grads[k]), [ref[k]] * 4)
    # The same under plain autograd.
    leaves = {k: v.local.detach().clone().requires_grad_() for k, v in x.items()}
    loss({k: x[k].replace(leaves[k]) for k in full}).backward()
    for k in full:
        assert_ranks_equal(leaves[k].grad, values_of(expected[k].local, 4))


# --------------------------------------------------------------------------- bucketing


def test_gather_is_bucketed_one_collective_per_axis_and_dtype(mesh22):
    full = {
        "colwise": randn(8, 4),  # FSDP + TP: P(("tp", "dp"))
        "rowwise": randn(4, 8),  # P("dp", "tp")
        "tp_only": randn(6),
        "dp_only": randn(5, 2),
        "bias": randn(4),
        "other": randn(3, 3),
    }
    specs = {
        "colwise": P(("tp", "dp")),
        "rowwise": P("dp", "tp"),
        "tp_only": P("tp"),
        "dp_only": P("dp"),
        "bias": P(("tp", "dp")),
        "other": P(None, "tp"),
    }
    x = ff.shard(full, mesh22, specs)
    with ff.count_comms() as comms:
        out = ff.gather(x)
    assert comms.by_kind_and_axis().keys() == {("all_gather", "dp"), ("all_gather", "tp")}
    assert comms.count("all_gather", "dp") == 1 and comms.count("all_gather", "tp") == 1
    for k in full:
        assert_ranks_equal(out[k], [full[k]] * 4)
    # Bytes: each rank sends its local blocks to the other rank of its dp group (dp is
    # gathered first, being minor wherever it splits a dim together with tp).
    dp_bytes = sum(x[k].layout.local_numel * 4 for k in full if "dp" in x[k].spec.axes)
    assert comms.bytes("all_gather", "dp") == dp_bytes * (2 - 1)
    # Backward: one bucketed reduce-scatter per axis.
    with ff.count_comms() as comms:
        torch.func.grad(lambda p: sum(v.sum() for v in ff.gather(p).values()))(x)
    assert comms.count("reduce_scatter", "dp") == 1 and comms.count("reduce_scatter", "tp") == 1
    assert comms.count("all_gather") == 2

    # An axis waits until it is minor-most in every value that needs it: with one (tp, dp)
    # value and many tp-only values, gathering tp first would cost a second tp collective.
    fsdp_tp = {"colwise": x["colwise"], **{f"tp{i}": x["tp_only"] for i in range(3)}}
    with ff.count_comms() as comms:
        out = ff.gather(fsdp_tp)
    assert comms.count("all_gather", "dp") == 1 and comms.count("all_gather", "tp") == 1
    assert_ranks_equal(out["colwise"], [full["colwise"]] * 4)
    # Dims split (tp, dp) and (dp, tp) need three rounds: each needs the other's axis first.
    crossed = {"colwise": x["colwise"], "bias": ff.shard(full["bias"], mesh22, P(("dp", "tp")))}
    with ff.count_comms() as comms:
        out = ff.gather(crossed)
    assert comms.count("all_gather") == 3
    assert_ranks_equal(out["bias"], [full["bias"]] * 4)

    # One bucket per dtype.
    mixed = {**x, "half": ff.shard(randn(6, 2, dtype=torch.bfloat16), mesh22, P("dp"))}
    with ff.count_comms() as comms:
        out = ff.gather(mixed)
    assert comms.count("all_gather", "dp") == 2 and comms.count("all_gather", "tp") == 1
    assert out["half"].dtype == torch.bfloat16
    assert {r.dtype for r in comms.records if r.axis == "dp"} == {torch.float32, torch.bfloat16}

    # A size cap splits buckets; values are unchanged.
    with ff.count_comms() as comms:
        out = ff.gather(x, bucket_bytes=4 * 8)
    assert comms.count("all_gather", "dp") > 1 and comms.count("all_gather", "tp") > 1
    for k in full:
        assert_ranks_equal(out[k], [full[k]] * 4)
    with ff.count_comms() as comms:
        ff.gather(x, bucket_bytes=1)  # every tensor in its own bucket
    assert comms.count("all_gather", "dp") == sum("dp" in s.axes for s in specs.values())


# --------------------------------------------------------------------------- reshard


RESHARD_SPECS = [P(), P("dp"), P(None, "tp"), P(("tp", "dp")), P(("dp", "tp")), P("tp", "dp")]


@pytest.mark.parametrize("shape", [(5, 3), (0, 2)])
def test_reshard_between_specs_preserves_values_and_padding(mesh22, shape):
    full = randn(*shape)
    sharded = {spec: ff.shard(full, mesh22, spec) for spec in RESHARD_SPECS}
    for a, b in itertools.product(RESHARD_SPECS, RESHARD_SPECS):
        out = ff.reshard(sharded[a], b)
        assert isinstance(out, ff.Sharded) and out.spec == b.padded(2), (a, b)
        assert_ranks_equal(out.local, values_of(sharded[b].local, 4))  # zero padding too


def test_reshard_trees_and_its_gradient(mesh22):
    full = {"w": randn(6, 5), "b": randn(3), "n": 4}
    x = ff.shard(full, mesh22, {"w": P("dp"), "b": P(), "n": None})
    y = ff.reshard(x, {"w": P(None, ("tp", "dp")), "b": P("tp"), "n": None})
    assert y["n"] == 4 and y["w"].spec == P(None, ("tp", "dp")) and y["b"].spec == P("tp")
    assert_ranks_equal(ff.gather(y)["w"], [full["w"]] * 4)
    # A plain tensor cannot be laid out by reshard (shard() splits full tensors): it says so.
    with pytest.raises(TypeError, match=r"\['t'\] \(shape \(6, 5\)\) is a plain tensor"):
        ff.reshard({"t": full["w"]}, P("dp"))
    # Differentiable: the gradient lands back on the source layout. "w" is replicated over
    # tp, so (as for gather) each tp replica holds a partial gradient of sum_r loss_r; their
    # sum is the reference (the library's gradient rule reduces replicated data axes).
    cs = randn_per_rank(4, 6, 5)
    c = per_rank(mesh22, cs)
    g = torch.func.grad(lambda p: (c * ff.gather(ff.reshard(p, P(None, "tp")))).sum())(x["w"])
    assert isinstance(g, ff.Sharded) and g.spec == P("dp", None)
    partial = values_of(g.local, 4)
    expected = values_of(ff.shard(sum(cs), mesh22, P("dp")).local, 4)
    for dp in range(2):  # rank = 2 * dp + tp
        torch.testing.assert_close(partial[2 * dp] + partial[2 * dp + 1], expected[2 * dp])


def test_reshard_gradient_without_replication():
    """On a 1D mesh every value is sharded over the only axis: the gradient of a reshard is
    exactly the reference gradient, laid out like the source."""
    with ff.simulated_mesh({"dp": 4}) as mesh:
        full = randn(7, 6)
        cs = randn_per_rank(4, 7, 6)
        c = per_rank(mesh, cs)
        for src, dst in [(P("dp"), P(None, "dp")), (P(None, "dp"), P()), (P("dp"), P("dp"))]:
            x = ff.shard(full, mesh, src)
            g = torch.func.grad(lambda p, dst=dst: (c * ff.gather(ff.reshard(p, dst)).cos()).sum())(
                x
            )
            ref = -sum(cs) * full.sin()
            assert g.spec == src.padded(2)
            assert_ranks_equal(
                g.local, values_of(ff.shard(ref, mesh, src).local, 4), f"{src}->{dst}"
            )


# --------------------------------------------------------------------------- DTensor


@pytest.mark.parametrize(
    ("shape", "spec"),
    [((7, 3), P("dp")), ((8, 6), P(("tp", "dp"), None)), ((4, 5), P("tp", "dp")), ((3,), P())],
)
def test_dtensor_round_trip_on_a_simulated_mesh(mesh22, shape, spec):
    full = randn(*shape)
    x = ff.shard(full, mesh22, spec)
    dt = x.to_dtensor()
    assert tuple(dt.shape) == shape
    assert_ranks_equal(dt.full_tensor(), [full] * 4)
    back = ff.Sharded.from_dtensor(dt)
    assert back.spec == x.spec and back.global_shape == x.global_shape
    assert_ranks_equal(back.local, values_of(x.local, 4))


def test_numpy_reference_for_all_gather(mesh22):
    """all_gather over tp of rank-numbered tensors lists the tp group in order."""
    with outside_simulation():
        ranks = [torch.full((1,), float(r)) for r in range(4)]
    x = per_rank(mesh22, ranks)
    got = [v.tolist() for v in values_of(ff.all_gather(x, mesh22, "tp"), 4)]
    assert got == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    got = np.array([v.tolist() for v in values_of(ff.all_gather(x, mesh22, "dp"), 4)])
    np.testing.assert_array_equal(got, [[0, 2], [1, 3], [0, 2], [1, 3]])
