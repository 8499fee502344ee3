"""Error messages: each names the key path, shape, spec and mesh, and says what to do.

The tests pin the wording. Mesh-dependent errors run on simulated meshes.
"""

from __future__ import annotations

import re

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.resharding import resolve_specs

P = ff.P


@pytest.fixture
def mesh4():
    """A simulated 4-rank world with a 1D mesh; tests build a second (2x2) mesh in it."""
    with ff.simulated_mesh({"dp": 4}) as mesh:
        yield mesh


def test_duplicate_axis():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "P('dp', 'dp') uses mesh axis 'dp' twice (in dims 0 and 1). A mesh axis may split "
            "at most one dim; to split one dim over several axes write a tuple, "
            "e.g. P(('tp', 'dp'))."
        ),
    ):
        P("dp", "dp")
    with pytest.raises(ValueError, match=r"uses mesh axis 'tp' twice \(in the tuple of dim 0\)"):
        P(("tp", "tp"))


def test_unknown_axis_names_path_shape_spec_and_mesh(mesh4):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannot lay out ['blocks'][1]['w'] (shape (4, 3)) with P('zz') on Mesh(dp=4): "
            "P('zz') names mesh axis 'zz', which the mesh does not have (its axes are ('dp',)); "
            "use one of those names."
        ),
    ):
        ff.shard({"blocks": [{}, {"w": torch.ones(4, 3)}]}, mesh4, P("zz"))
    with pytest.raises(ValueError, match=r"cannot lay out <root> \(shape \(4,\)\) with P\('tp'\)"):
        ff.shard(torch.ones(4), mesh4, P("tp"))
    with pytest.raises(
        ValueError, match=re.escape("cannot lay out ['w'] (shape (4,)) with P('tp') on Mesh(dp=4)")
    ):
        ff.reshard({"w": ff.shard(torch.ones(4), mesh4, P("dp"))}, P("tp"))


def test_spec_longer_than_ndim(mesh4):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannot lay out ['b'] (shape (3,)) with P('dp', None) on Mesh(dp=4): P('dp', None) "
            "has 2 entries but the tensor has only 1 dims; give at most one entry per dim."
        ),
    ):
        ff.shard({"w": torch.ones(3, 3), "b": torch.ones(3)}, mesh4, P("dp", None))


def test_specs_tree_that_does_not_match_the_tree():
    tree = {"enc": {"w": torch.ones(4, 3), "b": torch.ones(3)}, "dec": [torch.ones(2)]}
    fix = (
        "Give specs with the same structure as the tree, or a prefix of it (one P for a whole "
        "subtree), a single P for every tensor, or a rule fn(path, tensor) -> P."
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "the specs do not match the tree at ['enc']: the tree has a dict with keys "
            "['b', 'w'], but the specs have a dict with keys ['w']. " + fix
        ),
    ):
        resolve_specs(tree, {"enc": {"w": P("dp")}, "dec": P()})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "at ['dec']: the tree has a list of 1, but the specs have a tuple of 1. " + fix
        ),
    ):
        resolve_specs(tree, {"enc": P(), "dec": (P(),)})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "at ['enc']['w']: the tree has a tensor of shape (4, 3), but the specs have a tuple "
            "of 2 (a tuple or list in a specs tree is structure, not a spec: write "
            "P('dp', None))."
        ),
    ):
        resolve_specs(tree, {"enc": {"w": ("dp", None), "b": P()}, "dec": P()})


def test_spec_that_is_not_a_p():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "the spec for ['w'] (shape (4, 3)) is 'dp' (str); specs must be P objects, "
            "e.g. P('dp', None)."
        ),
    ):
        resolve_specs({"w": torch.ones(4, 3)}, {"w": "dp"})
    with pytest.raises(TypeError, match=r"the spec for \['w'\] .* is \('dp',\) \(tuple\)"):
        resolve_specs({"w": torch.ones(4, 3)}, lambda path, t: ("dp",))


def test_gather_mixing_meshes(mesh4):
    mesh22 = ff.make_mesh({"dp": 2, "tp": 2})
    tree = {
        "a": ff.shard(torch.ones(4), mesh4, P("dp")),
        "b": ff.shard(torch.ones(4), mesh22, P("dp")),
    }
    message = (
        "got values on different meshes: ['a'] is on Mesh(dp=4) over ranks [0, 1, 2, 3] but "
        "['b'] is on Mesh(dp=2, tp=2) over ranks [[0, 1], [2, 3]]. Call {0}() once per mesh, "
        "or reshard the values onto one mesh first."
    )
    with pytest.raises(ValueError, match=re.escape("gather() " + message.format("gather"))):
        ff.gather(tree)
    with pytest.raises(ValueError, match=re.escape("reshard() " + message.format("reshard"))):
        ff.reshard(tree, P())


def test_sharded_whose_local_shape_contradicts_its_layout(mesh4):
    message = (
        "Sharded local shape (2,) contradicts its layout: global shape (7,) with P('dp') on "
        "Mesh(dp=4) has padded local blocks of shape (2,)"
    )
    ff.Sharded(torch.zeros(2), (7,), P("dp"), mesh4)  # the right shape is accepted
    with pytest.raises(ValueError, match=re.escape(message.replace("(2,) contra", "(3,) contra"))):
        ff.Sharded(torch.zeros(3), (7,), P("dp"), mesh4)
    with pytest.raises(TypeError, match=r"Sharded needs a P spec, got \('dp',\) \(tuple\)"):
        ff.Sharded(torch.zeros(2), (7,), ("dp",), mesh4)  # type: ignore[arg-type]
    # A function mapped over local shards that changes their shape is caught, with the path.
    bad = ff.tree_map(lambda t: t[:1], {"w": ff.shard(torch.ones(7), mesh4, P("dp"))})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "gather(): ['w']: Sharded local shape (1,) contradicts its layout: global shape (7,) "
            "with P('dp') on Mesh(dp=4) has padded local blocks of shape (2,). Build Sharded "
            "values with ff.shard(full_tensor, mesh, spec), or pass the padded block; a "
            "function mapped over local shards must keep their shape."
        ),
    ):
        ff.gather(bad)
    with pytest.raises(ValueError, match=r"reshard\(\): \['w'\]: Sharded local shape \(1,\)"):
        ff.reshard(bad, P())


def test_make_mesh_whose_product_is_not_the_world_size(mesh4):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "make_mesh({'dp': 2, 'tp': 4}) needs 8 ranks, but the world size is 4. Choose axis "
            "sizes whose product is 4, or launch with `torchrun --nproc-per-node 8`."
        ),
    ):
        ff.make_mesh({"dp": 2, "tp": 4})
    with pytest.raises(ValueError, match=r"mesh axis sizes must be positive"):
        ff.make_mesh({"dp": 4, "tp": 0})


def test_gather_errors(mesh4):
    mesh22 = ff.make_mesh({"dp": 2, "tp": 2})
    w = ff.shard({"w": torch.ones(8, 2)}, mesh22, P(("tp", "dp")))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannot gather ['tp'] out of ['w'] (shape (8, 2), P(('tp', 'dp'), None), "
            "Mesh(dp=2, tp=2)): dim 0 is split major-to-minor over ('tp', 'dp'), and gathering "
            "a major axis while keeping a minor one does not give a contiguous block. Gather "
            "'dp' as well, or reshard to the target spec."
        ),
    ):
        ff.gather(w, "tp")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "gather(axes=['pp']): the mesh Mesh(dp=2, tp=2) has no axis 'pp'; name some of its "
            "axes ('dp', 'tp'), or pass axes=None to gather all of them."
        ),
    ):
        ff.gather(w, "pp")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "['w'] is already Sharded (P(('tp', 'dp'), None)); use ff.reshard(tree, specs) to "
            "change its layout."
        ),
    ):
        ff.shard(w, mesh22, P())


def test_collective_errors(mesh4):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "all_gather over 'tp': the mesh Mesh(dp=4) has no axis 'tp'; name one of its axes "
            "('dp',)."
        ),
    ):
        ff.all_gather(torch.ones(3), mesh4, "tp")
    for fn in (ff.all_reduce, ff.all_reduce_grad):
        with pytest.raises(ValueError, match=rf"{fn.__name__} over 'tp': the mesh Mesh\(dp=4\)"):
            fn(torch.ones(3), mesh4, ("dp", "tp"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "reduce_scatter over 'dp' (size 4) needs dim 1 of shape (2, 3) to divide by 4; "
            "pad it first"
        ),
    ):
        ff.reduce_scatter(torch.ones(2, 3), mesh4, "dp", dim=1)
    with pytest.raises(ValueError, match=r"all_gather: dim 2 is out of range for a tensor of"):
        ff.all_gather(torch.ones(3), mesh4, "dp", dim=2)


def test_shard_refuses_a_value_that_differs_between_simulated_ranks():
    with ff.simulated_mesh({"dp": 2}) as mesh:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, generator=g)  # each simulated rank draws its own values
        with pytest.raises(
            ValueError,
            match=re.escape(
                "shard(): ['w'] (float32 (4, 3), P('dp')) differs between the simulated ranks "
                "of Mesh(dp=2):\n  rank 0: checksum "
            )
            + r"[0-9a-f]{8}\n  rank 1: checksum [0-9a-f]{8}\n"
            + re.escape("shard() takes the full value, the same on every rank")
            + ".*"
            + re.escape("Create the values outside simulated_mesh()"),
        ):
            ff.shard({"w": x, "b": torch.zeros(3)}, mesh, P("dp"))
        # Meant to differ: each simulated rank keeps its block of its own value.
        mine = ff.shard({"w": x}, mesh, P("dp"), check=False)["w"].local
        assert [t.tolist() for t in ff.rank_values(mine)] == [
            v[i * 2 : i * 2 + 2].tolist() for i, v in enumerate(ff.rank_values(x))
        ]
        torch.manual_seed(0)
        y = torch.randn(4, 3)  # the global RNG gives every simulated rank the same values
        assert ff.shard({"w": y}, mesh, P("dp"))["w"].local.shape == (2, 3)
