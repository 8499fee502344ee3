"""Tier 3: real gloo processes at world sizes 1, 2 and 4 (and a 2x2 mesh), the ground truth.

Worker functions are module-level (they run on a reused pool of gloo processes). Random cases
are generated from a seed inside the workers, so every rank agrees; references are computed
here, in one process, from the same seeds. Tests are grouped by world size, in file order, so
the pool is restarted only twice.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.spec import Layout

pytestmark = pytest.mark.multiprocess
P = ff.P

# --------------------------------------------------------------------------- shared helpers


def random_cases(seed: int, axes: dict[str, int], n: int) -> list[tuple[tuple[int, ...], P]]:
    """Random shapes (uneven and tiny dims included) and specs (2-axis tuples included)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 9]) for _ in range(rng.randint(1, 3)))
        free = list(axes)
        rng.shuffle(free)
        entries: list[object] = []
        for _ in shape:
            pick = rng.choice(["none", "one", "two", "one"])
            if pick == "two" and len(free) >= 2:
                entries.append((free.pop(), free.pop()))
            elif pick != "none" and free:
                entries.append(free.pop())
            else:
                entries.append(None)
        cases.append((shape, P(*entries)))
    return cases


def case_tensors(seed: int, shape: tuple[int, ...], world: int):
    """The full tensor and one weight tensor per rank for a case (the same on every process)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g)
    weights = [torch.randn(shape, generator=g) for _ in range(world)]
    return full, weights


def coordinates(axes: dict[str, int]) -> list[dict[str, int]]:
    """Mesh coordinates in rank order (meshes from make_mesh are row-major over all ranks)."""
    return [dict(zip(axes, c)) for c in itertools.product(*(range(s) for s in axes.values()))]


def padded_block(full: torch.Tensor, layout: Layout, coord: dict[str, int]) -> torch.Tensor:
    slices, _ = layout.owned(coord)
    out = torch.zeros(layout.local_shape, dtype=full.dtype)
    out[tuple(slice(0, s.stop - s.start) for s in slices)] = full[slices]
    return out


# --------------------------------------------------------------------------- workers


def roundtrip_and_grads(axes: dict[str, int], seed: int, n: int) -> list[dict]:
    """Shard then gather random cases, and take gradients through the gather under
    torch.func.grad of loss_r = sum_i (w_ir * sin(gathered_i)) with rank-dependent w."""
    import torch.distributed as dist

    mesh = ff.make_mesh(axes)
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = random_cases(seed, axes, n)
    fulls, weights = {}, {}
    for i, (shape, _) in enumerate(cases):
        fulls[f"t{i}"], ws = case_tensors(seed + i, shape, world)
        weights[f"t{i}"] = ws[rank]
    specs = {f"t{i}": spec for i, (_, spec) in enumerate(cases)}
    sharded = ff.shard(fulls, mesh, specs)
    with ff.count_comms() as comms:
        gathered = ff.gather(sharded)

    def loss(params):
        g = ff.gather(params)
        return sum((weights[k] * g[k].sin()).sum() for k in params)

    grads = torch.func.grad(loss)(sharded)
    return [
        {
            "shape": shape,
            "spec": specs[f"t{i}"],
            "gathered": gathered[f"t{i}"],
            "local": sharded[f"t{i}"].local,
            "grad_spec": grads[f"t{i}"].spec,
            "grad": grads[f"t{i}"].local,
            "all_gathers": comms.count("all_gather"),
        }
        for i, (shape, _) in enumerate(cases)
    ]


def collectives_every_way(axes: dict[str, int], axis: str, seed: int) -> dict[str, object]:
    """Every collective's value and gradient (torch.func.grad, grad_and_value, vjp and plain
    autograd) with this rank's input x and cotangent w; the references are computed by the
    test from the same seed."""
    import torch.distributed as dist

    mesh = ff.make_mesh(axes)
    rank, world = dist.get_rank(), dist.get_world_size()
    size = axes[axis]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(4, 6, generator=g) for _ in range(world)]
    ws_big = [torch.randn(4 * size, 6, generator=g) for _ in range(world)]
    ws_small = [torch.randn(4 // size, 6, generator=g) for _ in range(world)]
    ws_same = [torch.randn(4, 6, generator=g) for _ in range(world)]
    x = xs[rank]
    fns = {
        "all_gather": (lambda t: ff.all_gather(t, mesh, axis), ws_big[rank]),
        "reduce_scatter": (lambda t: ff.reduce_scatter(t, mesh, axis), ws_small[rank]),
        "reduce_scatter_mean": (
            lambda t: ff.reduce_scatter(t, mesh, axis, op="mean"),
            ws_small[rank],
        ),
        "all_reduce": (lambda t: ff.all_reduce(t, mesh, axis), ws_same[rank]),
        "all_reduce_mean": (lambda t: ff.all_reduce(t, mesh, axis, "mean"), ws_same[rank]),
        "all_reduce_grad": (lambda t: ff.all_reduce_grad(t, mesh, axis), ws_same[rank]),
        "all_reduce_grad_mean": (
            lambda t: ff.all_reduce_grad(t, mesh, axis, "mean"),
            ws_same[rank],
        ),
    }
    out: dict[str, object] = {}
    for name, (f, w) in fns.items():

        def loss(t, f=f, w=w):
            return (w * f(t)).sum()

        out[name] = f(x)
        out[name + "/grad"] = torch.func.grad(loss)(x)
        gv, value = torch.func.grad_and_value(loss)(x)
        out[name + "/grad_and_value"] = gv
        out[name + "/value"] = value
        out[name + "/vjp"] = torch.func.vjp(f, x)[1](w)[0]
        leaf = x.clone().requires_grad_()
        loss(leaf).backward()
        out[name + "/backward"] = leaf.grad
    return out


def reshard_every_pair(shapes: list[tuple[int, ...]], specs: list[P], seed: int) -> dict:
    """reshard(shard(full, a), b) for every pair: the local blocks (padding included) equal
    shard(full, b)'s, and gathering gives the full tensor back."""
    mesh = ff.make_mesh({"dp": 2, "tp": 2})
    checked, bad = 0, []
    for j, shape in enumerate(shapes):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed + j))
        sharded = {spec: ff.shard(full, mesh, spec) for spec in specs}
        for a, b in itertools.product(specs, specs):
            out = ff.reshard(sharded[a], b)
            ok = (
                out.spec == b.padded(len(shape))
                and torch.equal(out.local, sharded[b].local)
                and torch.equal(ff.gather(out), full)
            )
            checked += 1
            if not ok:
                bad.append((shape, a, b))
    return {"checked": checked, "bad": bad}


def dtensor_round_trips(cases: list[tuple[tuple[int, ...], P]], seed: int) -> list[dict]:
    """to_dtensor / from_dtensor on a 2x2 mesh, and whether DTensor's own local piece (torch's
    distribute_tensor) holds the same rows as ours (it does not for some uneven 2-axis dims,
    where the conversion has to move rows)."""
    from torch.distributed.tensor import distribute_tensor  # src_data_rank=None: split locally

    from functional_fsdp.sharded import unpad

    mesh = ff.make_mesh({"dp": 2, "tp": 2})
    coord = dict(zip(("dp", "tp"), mesh.get_coordinate()))
    results = []
    for i, (shape, spec) in enumerate(cases):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed + i))
        x = ff.shard(full, mesh, spec)
        dt = x.to_dtensor()
        back = ff.Sharded.from_dtensor(dt)
        torch_dt = distribute_tensor(full, mesh, dt.placements, src_data_rank=None)
        # Also a DTensor that torch itself distributed converts to the same Sharded value.
        theirs = ff.Sharded.from_dtensor(torch_dt)
        ours = unpad(x.local, x.layout, coord)
        results.append(
            {
                # (kind, tensor dim, split factor): torch's placement classes, not their reprs.
                "placements": [
                    (
                        type(p).__name__.lstrip("_"),
                        getattr(p, "dim", None),
                        getattr(p, "split_factor", None),
                    )
                    for p in dt.placements
                ],
                "full_ok": torch.equal(dt.full_tensor(), full),
                "local_is_torchs": torch.equal(dt.to_local(), torch_dt.to_local()),
                "back_ok": back.spec == x.spec and torch.equal(back.local, x.local),
                "theirs_ok": theirs.spec == x.spec and torch.equal(theirs.local, x.local),
                "same_rows_as_dtensor": torch_dt.to_local().shape == ours.shape
                and torch.equal(torch_dt.to_local(), ours),
            }
        )
    return results


# --------------------------------------------------------------------------- checks


def check_roundtrip_and_grads(axes: dict[str, int], seed: int, results: list[list[dict]]) -> int:
    """Compare every rank's results with single-process references; returns cases checked."""
    world = math.prod(axes.values())
    coords = coordinates(axes)
    n_cases = len(results[0])
    for i in range(n_cases):
        shape, spec = results[0][i]["shape"], results[0][i]["spec"]
        full, weights = case_tensors(seed + i, shape, world)
        layout = Layout.make(shape, spec, axes)
        # The reference gradient of sum_r loss_r, on the full tensor.
        ref = sum(weights) * full.cos()
        by_owner: dict[tuple, list[int]] = {}
        for r, coord in enumerate(coords):
            res = results[r][i]
            assert torch.equal(res["gathered"], full), (shape, spec, r)
            assert torch.equal(res["local"], padded_block(full, layout, coord)), (shape, spec, r)
            assert res["grad_spec"] == spec.padded(len(shape))
            key = tuple(coord[a] for a in spec.axes)
            by_owner.setdefault(key, []).append(r)
        # Ranks that hold the same block (replicas over axes the spec does not use) each hold a
        # partial gradient; their sum is the reference block, with zero padding.
        for ranks in by_owner.values():
            total = sum(results[r][i]["grad"] for r in ranks)
            expected = padded_block(ref, layout, coords[ranks[0]])
            torch.testing.assert_close(total, expected, msg=lambda m: f"{shape} {spec}: {m}")
    # Bucketing: one all-gather per mesh axis (of size > 1) for the whole tree, plus one when
    # dims split (dp, tp) and (tp, dp) both occur (each needs the other's axis gathered first).
    specs = [res["spec"] for res in results[0]]
    entries = {spec.entry(d) for spec in specs for d in range(len(spec))}
    cycle = any(e[::-1] in entries for e in entries if len(e) == 2)
    assert results[0][0]["all_gathers"] <= sum(s > 1 for s in axes.values()) + cycle
    return n_cases


def check_collectives(axes: dict[str, int], axis: str, seed: int, results: list[dict]) -> None:
    world = math.prod(axes.values())
    size = axes[axis]
    coords = coordinates(axes)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(4, 6, generator=g) for _ in range(world)]
    ws_big = [torch.randn(4 * size, 6, generator=g) for _ in range(world)]
    ws_small = [torch.randn(4 // size, 6, generator=g) for _ in range(world)]
    ws_same = [torch.randn(4, 6, generator=g) for _ in range(world)]

    def group(r: int) -> list[int]:
        others = {a: v for a, v in coords[r].items() if a != axis}
        return [q for q, c in enumerate(coords) if all(c[a] == v for a, v in others.items())]

    def index(r: int) -> int:
        return coords[r][axis]

    # Single-process references by autograd on plain tensors: sum_r (w_r * f_r(x)).sum().
    def autograd_ref(f_r, ws):
        leaves = [x.clone().requires_grad_() for x in xs]
        total = sum((ws[r] * f_r(r, leaves)).sum() for r in range(world))
        return [f_r(r, xs) for r in range(world)], list(torch.autograd.grad(total, leaves))

    expected = {
        "all_gather": autograd_ref(lambda r, t: torch.cat([t[s] for s in group(r)]), ws_big),
    }
    for op, scale in (("", 1.0), ("_mean", 1.0 / size)):
        expected["reduce_scatter" + op] = autograd_ref(
            lambda r, t, scale=scale: scale * sum(t[s] for s in group(r)).chunk(size)[index(r)],
            ws_small,
        )
        # all_reduce: psum forward, identity backward (scaled for the mean).
        expected["all_reduce" + op] = (
            [scale * sum(xs[s] for s in group(r)) for r in range(world)],
            [scale * ws_same[r] for r in range(world)],
        )
        # all_reduce_grad: identity forward, psum of the cotangents backward.
        expected["all_reduce_grad" + op] = (
            xs,
            [scale * sum(ws_same[s] for s in group(r)) for r in range(world)],
        )
    assert len(expected) == 7
    for name, (values, grads) in expected.items():
        for r in range(world):
            res = results[r]
            torch.testing.assert_close(res[name], values[r], msg=lambda m: f"{name} r{r}: {m}")
            for how in ("grad", "grad_and_value", "vjp", "backward"):
                torch.testing.assert_close(
                    res[f"{name}/{how}"], grads[r], msg=lambda m: f"{name}/{how} r{r}: {m}"
                )


# --------------------------------------------------------------------------- world size 1


def test_world_size_1(pools):
    results = pools.run(1, roundtrip_and_grads, {"dp": 1}, 11, 12)
    assert check_roundtrip_and_grads({"dp": 1}, 11, results) == 12
    out = pools.run(1, collectives_every_way, {"dp": 1}, "dp", 5)
    check_collectives({"dp": 1}, "dp", 5, out)


# --------------------------------------------------------------------------- world size 2


def test_world_size_2_roundtrip_and_grads(pools):
    results = pools.run(2, roundtrip_and_grads, {"dp": 2}, 21, 16)
    assert check_roundtrip_and_grads({"dp": 2}, 21, results) == 16


def test_world_size_2_collectives(pools):
    out = pools.run(2, collectives_every_way, {"dp": 2}, "dp", 7)
    check_collectives({"dp": 2}, "dp", 7, out)


# --------------------------------------------------------------------------- world size 4


def test_world_size_4_roundtrip_and_grads(pools):
    results = pools.run(4, roundtrip_and_grads, {"dp": 4}, 41, 16)
    assert check_roundtrip_and_grads({"dp": 4}, 41, results) == 16


@pytest.mark.parametrize("seed", [42, 43])
def test_2x2_roundtrip_and_grads(pools, seed):
    axes = {"dp": 2, "tp": 2}
    results = pools.run(4, roundtrip_and_grads, axes, seed, 16)
    assert check_roundtrip_and_grads(axes, seed, results) == 16


def test_2x2_collectives(pools):
    axes = {"dp": 2, "tp": 2}
    for axis, seed in (("dp", 8), ("tp", 9)):
        check_collectives(axes, axis, seed, pools.run(4, collectives_every_way, axes, axis, seed))


SPECS_2D = [
    P(a, b)
    for a, b in itertools.product([None, "dp", "tp", ("dp", "tp"), ("tp", "dp")], repeat=2)
    if not set(P(a).axes) & set(P(b).axes)
]


def test_2x2_reshard_between_every_pair_of_specs(pools):
    assert len(SPECS_2D) == 11
    out = pools.run(4, reshard_every_pair, [(5, 7), (8, 3), (1, 2), (0, 3)], SPECS_2D, 3)
    for r in out:
        assert r["checked"] == 4 * 11 * 11
        assert r["bad"] == []


def test_2x2_dtensor_round_trip(pools):
    """to_dtensor/from_dtensor are lossless (uneven shapes and ("tp", "dp") layouts included),
    and the DTensor holds exactly the local pieces torch's own distribute_tensor would. Where
    DTensor splits an uneven multi-axis dim differently from this library, the conversion
    moves rows (gather, then cut) instead of failing."""
    cases = [
        ((5, 3), P("dp")),
        ((7, 6), P("dp", "tp")),
        ((3, 5), P(None, "tp")),
        ((8, 3), P(("tp", "dp"))),  # FSDP on top of TP: _StridedShard
        ((8, 3), P(("dp", "tp"))),
        ((6, 3), P(("tp", "dp"))),  # uneven but the same rows either way
        ((7, 2), P(None, ("dp", "tp"))),  # 2 columns over 4 ranks
        ((1, 4), P("tp", "dp")),
        ((4,), P()),
        ((5, 3), P(("tp", "dp"))),  # uneven: the layouts differ
        ((5, 3), P(("dp", "tp"))),
        ((2, 9), P(None, ("tp", "dp"))),
    ]
    out = pools.run(4, dtensor_round_trips, cases, 17)
    for r, per_rank in enumerate(out):
        for i, res in enumerate(per_rank):
            assert res["full_ok"] and res["back_ok"] and res["theirs_ok"], (cases[i], r, res)
            assert res["local_is_torchs"], (cases[i], r, res)
    differ = {
        i
        for i in range(len(cases))
        if not all(per_rank[i]["same_rows_as_dtensor"] for per_rank in out)
    }
    assert differ == {9, 10, 11}
    assert out[0][3]["placements"] == [("StridedShard", 0, 2), ("Shard", 0, None)]


# --------------------------------------------------------------------------- default checks


def agreement_exchanges(axes: dict[str, int], odd_rank: int) -> dict[str, object]:
    """How many all-gathers the default agreement checks issue (count_comms does not see
    them), and what they say when one rank's value differs. Every call here is collective."""
    import torch.distributed as dist

    from functional_fsdp.distributed import agreement
    from functional_fsdp.models import GPT, GPTConfig

    mesh = ff.make_mesh(axes)
    rank = dist.get_rank()
    calls: list[str] = []
    original = agreement._all_gather

    def counted(*args, **kwargs):
        calls.append(args[2])
        return original(*args, **kwargs)

    def count(fn) -> int:
        calls.clear()
        fn()
        return len(calls)

    agreement._all_gather = counted
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
        sm = ff.fsdp(model, mesh)
        params = {n: p.detach() for n, p in model.named_parameters()}
        out: dict[str, object] = {"leaves": len(params)}
        out["shard"] = count(lambda: ff.shard(params, mesh, sm.param_specs()))
        out["shard_unchecked"] = count(lambda: ff.shard(params, mesh, P(), check=False))
        sharded = sm.shard()
        out["gather"] = count(lambda: ff.gather(sharded))
        out["gather_unchecked"] = count(lambda: ff.gather(sharded, check=False))
        out["reshard"] = count(lambda: ff.reshard(sharded, P()))
        full = ff.shard(params, mesh, P())  # replicated: resharding it only slices
        out["reshard_slicing"] = count(lambda: ff.reshard(full, sm.param_specs()))
        batch = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(1))
        data = tuple(a for a in axes if a != "tp")
        for name, specs, opt_specs in (("fsdp", None, None), ("zero1", P(), P(data))):
            f = ff.fsdp(model, mesh, specs=specs)
            opt = ff.adamw(1e-2, weight_decay=0.01)
            step = ff.train_step(
                lambda p, b, f=f: f.apply(p, b[:, :-1]).float().mean(), opt, model=f
            )
            state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
            state, _ = step(state, batch)
            out[f"step_{name}"] = count(lambda step=step, state=state: step(state, batch))
        w = torch.ones(6, 4) + (1.0 if rank == odd_rank else 0.0)
        try:
            ff.shard({"w": w, "b": torch.zeros(3)}, mesh, P("dp"))
            out["differs"] = "no error"
        except ValueError as e:
            out["differs"] = str(e)
        out["healthy"] = float(ff.all_reduce(torch.ones(1), mesh, "dp"))
    finally:
        agreement._all_gather = original
    return out


@pytest.mark.parametrize("axes", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp2", "2x2"])
def test_default_checks_cost_one_all_gather_per_call_and_axis_and_none_per_step(pools, axes):
    world = math.prod(axes.values())
    odd = world - 1  # only the last rank differs: every rank must still raise together
    out = pools.run(world, agreement_exchanges, axes, odd)
    for r in out:
        assert r["leaves"] > 10
        assert r["shard"] == len(axes)  # one per mesh axis, for the whole tree
        assert r["gather"] == r["reshard"] == 1  # the FSDP layout gathers dp only
        assert r["shard_unchecked"] == r["gather_unchecked"] == r["reshard_slicing"] == 0
        assert r["step_fsdp"] == r["step_zero1"] == 0  # never in FSDP's steps
        assert (
            "shard(): ['w'] (float32 (6, 4), P('dp')) differs between the ranks of"
            in (r["differs"])
        )
        ranks = list(range(world - 1))
        first = f"ranks {ranks}" if len(ranks) > 1 else "rank 0"
        assert f"\n  {first}: checksum " in r["differs"], r["differs"]
        assert f"\n  rank {odd}: checksum " in r["differs"]
        assert r["healthy"] == axes["dp"]


def gloo_threads(axes: dict[str, int]) -> dict[str, tuple[int, float]]:
    """How many threads each gloo group of this process runs collectives on, and its timeout
    in seconds: the world's, each mesh axis's and a checkpoint manager's
    (functional_fsdp/distributed/gloo.py)."""
    import torch.distributed as dist

    def seen(group: object) -> tuple[int, float]:
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[attr-defined]
        assert isinstance(backend, dist.ProcessGroupGloo), type(backend)
        return backend.options._threads, backend.options._timeout.total_seconds()

    mesh = ff.make_mesh(axes)
    manager = ff.checkpoint.CheckpointManager("/nonexistent-ff-dir", save_every=10)
    try:
        found = {"world": seen(dist.group.WORLD), "checkpoint": seen(manager._group)}
    finally:
        manager.close()
    return found | {axis: seen(mesh.get_group(axis)) for axis in axes}


@pytest.mark.parametrize("world,axes", [(2, {"dp": 2}), (4, {"dp": 2, "tp": 2})])
def test_every_gloo_group_runs_its_collectives_on_one_thread(pools, world, axes):
    """Two collectives of one gloo group running at once can corrupt torch 2.13's heap
    (benchmarks/gloo_threads.py reproduces it without this library): every group the library
    creates runs them on one thread, in the order they are issued, with the job's collective
    timeout (the pools': 120 s)."""
    want = {name: (1, 120.0) for name in ("world", "checkpoint", *axes)}
    for rank, found in enumerate(pools.run(world, gloo_threads, axes)):
        assert found == want, (rank, found)
