"""Simulated meshes: the argument checks, the mesh that lives across notebook cells, values
that outlive their mesh, the fast simulation mode against torch's own, scaling, and
shapes-only simulation against real runs."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed._local_tensor as lt
from torch.distributed.device_mesh import DeviceMesh

import functional_fsdp as ff
from functional_fsdp.distributed import _local_mode
from functional_fsdp.distributed.mesh import coordinate_of, mesh_grid, rank_at
from functional_fsdp.models import GPT, GPTConfig, gpt_plan

from . import _simulate_workers as W
from . import _train_workers as T
from ._fsdp_workers import CFG


@pytest.fixture(autouse=True)
def _no_simulation_left():
    yield
    ff.end_simulation()  # a failed test must not leave its persistent simulation running


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("axes", "error", "match"),
    [
        ({"dp": 0}, ValueError, r"sizes must be positive integers, but 'dp' has size 0"),
        ({"dp": -2}, ValueError, r"sizes must be positive integers, but 'dp' has size -2"),
        ({1: 2}, TypeError, r"axis names must be strings, but 1 is not \(int\)"),
        ({"": 2}, TypeError, r"a mesh axis name is the empty string; name every axis"),
        ({"dp": 2.0}, TypeError, r"axis 'dp' has size 2.0 \(float\); sizes must be integers"),
        ({"dp": "2"}, TypeError, r"axis 'dp' has size '2' \(str\); sizes must be integers"),
        ({"dp": True}, TypeError, r"axis 'dp' has size True \(bool\); sizes must be integers"),
        ([("dp", 2)], TypeError, r"simulated_mesh takes a dict \{axis name: size\}, got \["),
        ({}, ValueError, r"simulated_mesh\(\{\}\) has no axes; .* simulated_mesh\(\{'dp': 8\}\)"),
    ],
)
@pytest.mark.parametrize("persistent", [False, True])
def test_bad_axes_are_refused_with_the_fix(axes, error, match, persistent):
    with pytest.raises(error, match=match):
        ff.simulated_mesh(axes, persistent=persistent)
    assert not ff.is_simulated()


def test_a_numpy_int_size_is_accepted():
    np = pytest.importorskip("numpy")
    with ff.simulated_mesh({"dp": np.int64(2)}) as mesh:
        assert ff.axis_sizes(mesh) == {"dp": 2}


def test_the_context_manager_used_as_a_mesh_names_both_right_forms():
    not_a_mesh = ff.simulated_mesh({"dp": 2})
    with pytest.raises(
        AttributeError,
        match=r"is a context manager, not a mesh \(it has no 'mesh_dim_names'\)\. Write "
        r"`with ff.simulated_mesh\(\{'dp': 2\}\) as mesh:`.*"
        r"`mesh = ff.simulated_mesh\(\{'dp': 2\}, persistent=True\)`",
    ):
        ff.shard(torch.ones(4), not_a_mesh, ff.P("dp"))
    assert not ff.is_simulated()  # nothing was started


def test_one_simulation_at_a_time():
    with ff.simulated_mesh({"dp": 2}):
        with pytest.raises(RuntimeError, match=r"Start it after that `with` block ends"):
            ff.simulated_mesh({"dp": 4}, persistent=True)
        with pytest.raises(RuntimeError, match=r"Start it after that `with` block ends"):
            ff.simulated_mesh({"dp": 4}).__enter__()
    ff.simulated_mesh({"dp": 2}, persistent=True)
    with (
        pytest.raises(RuntimeError, match=r"End it with ff.end_simulation\(\) first"),
        ff.simulated_mesh({"dp": 4}),
    ):
        pass
    ff.end_simulation()
    ff.end_simulation()  # nothing running: nothing to do
    assert not ff.is_simulated()


# --------------------------------------------------------------------------- notebook cells

CELLS = {
    "gpt": [
        # 1: the mesh, as a notebook user writes it
        "mesh = ff.simulated_mesh({'dp': 2}, persistent=True)",
        # 2: a model and its shards
        "torch.manual_seed(0)\n"
        "model = GPT(CFG)\n"
        "sm = ff.fsdp(model, mesh)\n"
        "opt = ff.adamw(T.LR, **T.OPT)\n"
        "state = ff.TrainState.create(sm.shard(), opt)",
        # 3: training, in a later cell
        "step = ff.train_step(lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), opt,"
        " model=sm)\n"
        "losses = []\n"
        "for b in batches:\n"
        "    state, metrics = step(state, b)\n"
        "    losses.append(ff.rank_values(metrics['loss'])[0].item())",
        # 4: results
        "params = {k: ff.rank_values(v)[0] for k, v in ff.gather(state.params).items()}",
    ],
    "llama": [
        "mesh = ff.simulated_mesh({'dp': 2}, persistent=True)",
        "torch.manual_seed(0)\n"
        "model = AutoModelForCausalLM.from_config(tiny_llama_config(use_cache=False))\n"
        "sm = ff.fsdp(model, mesh)\n"
        "opt = ff.adamw(T.LR, **T.OPT)\n"
        "state = ff.TrainState.create(sm.shard(), opt)",
        "step = ff.train_step(lambda p, b: sm.apply(p, input_ids=b, labels=b).loss, opt,"
        " model=sm)\n"
        "losses = []\n"
        "for b in batches:\n"
        "    state, metrics = step(state, b)\n"
        "    losses.append(ff.rank_values(metrics['loss'])[0].item())",
        "params = {k: ff.rank_values(v)[0] for k, v in ff.gather(state.params).items()}",
    ],
}


def _run_cells(cells: list[str], namespace: dict) -> dict:
    for i, cell in enumerate(cells):  # each cell a top-level program of its own, as in Jupyter
        exec(compile(cell, f"<cell {i + 1}>", "exec"), namespace)
    return namespace


def _namespace(batches: list[torch.Tensor]) -> dict:
    from transformers import AutoModelForCausalLM

    from functional_fsdp.models import lm_loss

    from ._hf import tiny_llama_config

    return dict(
        ff=ff,
        torch=torch,
        GPT=GPT,
        CFG=CFG,
        T=T,
        lm_loss=lm_loss,
        AutoModelForCausalLM=AutoModelForCausalLM,
        tiny_llama_config=tiny_llama_config,
        batches=batches,
    )


class _Plain:
    """``sm.apply`` for one process: ``torch.func.functional_call``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def apply(self, params: dict, *args, **kwargs):
        return torch.func.functional_call(self.model, params, args, kwargs)


def _reference(kind: str, batches: list[torch.Tensor]) -> tuple[list[float], dict]:
    """Single process, the whole global batch, the same optimizer."""
    model, loss = W.build(kind, meta=False)
    opt = ff.adamw(T.LR, **T.OPT)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state, losses = opt.init(params), []
    for b in batches:
        grads, value = torch.func.grad_and_value(lambda p, b=b: loss(_Plain(model), p, b))(params)
        updates, state = opt.update(grads, state, params)
        params = ff.apply_updates(params, updates)
        losses.append(value.item())
    return losses, params


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_persistent_mesh_lives_across_notebook_cells(kind):
    vocab = CFG.vocab_size if kind == "gpt" else 96
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (4, 13), generator=g) for _ in range(2)]
    ns = _run_cells(CELLS[kind], _namespace(batches))
    assert ff.is_simulated() and isinstance(ns["mesh"], DeviceMesh)
    losses, params = ns["losses"], ns["params"]

    ref_losses, ref_params = _reference(kind, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], atol=2e-5, rtol=1e-4, msg=k)

    # Running the first cell again replaces the simulation; the old values say what happened.
    old_state = ns["state"]
    _run_cells(CELLS[kind][:1], ns)
    with pytest.raises(
        ValueError,
        match=r"gather\(\): the value's mesh Mesh\(dp=2\) belonged to "
        r"ff.simulated_mesh\(\{'dp': 2\}, persistent=True\), which has ended.*keep the mesh "
        r"alive with `mesh = ff.simulated_mesh\(\.\.\., persistent=True\)`",
    ):
        ff.gather(old_state.params)
    ff.end_simulation()
    assert not ff.is_simulated()

    # The same cells under a `with` block give bitwise the same training.
    with ff.simulated_mesh({"dp": 2}) as mesh:
        ns2 = _namespace(batches)
        ns2["mesh"] = mesh
        _run_cells(CELLS[kind][1:], ns2)
    assert ns2["losses"] == losses
    assert all(torch.equal(ns2["params"][k], params[k]) for k in params)


def test_values_that_outlive_their_mesh_say_how_to_fix_it():
    torch.manual_seed(0)
    model = GPT(CFG)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(model, mesh)
        opt = ff.adamw(1e-2, weight_decay=0.01)
        step = ff.train_step(lambda p, b: sm.apply(p, b).sum(), opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
        x = ff.shard(torch.arange(4.0), mesh, ff.P("dp"))
    ended = (
        r"belonged to ff.simulated_mesh\(\{'dp': 2\}\), which has ended.*`with ff.simulated_mesh"
    )
    batch = torch.zeros(4, 5, dtype=torch.long)
    # No simulation running (torch alone says "Could not resolve the process group ...").
    with pytest.raises(ValueError, match=r"gather\(\): the value's mesh Mesh\(dp=2\) " + ended):
        ff.gather(x)
    with pytest.raises(ValueError, match=r"a collective over 'dp': .*" + ended):
        sm.apply(state.params, batch)
    with pytest.raises(ValueError, match=r"shard\(tree, mesh, specs\): .*" + ended):
        ff.shard(torch.ones(2), mesh, ff.P("dp"))
    # A new simulation of the same shape reuses process-group names: never silently.
    with ff.simulated_mesh({"dp": 2}):
        with pytest.raises(ValueError, match=ended):
            ff.gather(x)
        with pytest.raises(ValueError, match=ended):
            step(state, batch)
    # ... and one of another size.
    with ff.simulated_mesh({"dp": 4}):
        with pytest.raises(ValueError, match=ended):
            ff.gather(x)
        with pytest.raises(ValueError, match=r"made in another simulation, which has ended"):
            sm.apply(state.params, batch)


# --------------------------------------------------------------------------- the fast mode


def _trajectories(axes: dict[str, int], tp: bool) -> dict:
    cfg = GPTConfig(n_layer=2, vocab_size=62, n_embd=36, n_head=2, block_size=16) if tp else CFG
    torch.manual_seed(0)
    model = GPT(cfg)
    out: dict = {"loss": [], "norm": []}
    with ff.simulated_mesh(axes) as mesh:
        if tp:
            plan = ff.tensor_parallel(model, mesh, gpt_plan(cfg))
            sm = ff.fsdp(model, mesh, specs=plan.specs, wrappers=plan.wrappers)

            def loss(p, b):
                return ff.vocab_parallel_cross_entropy(sm.apply(p, b[:, :-1]), b[:, 1:], mesh)
        else:
            sm = ff.fsdp(model, mesh)

            def loss(p, b):
                from functional_fsdp.models import lm_loss

                return lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:])

        opt = ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(T.LR, **T.OPT))
        step = ff.train_step(loss, opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
        for b in T.batches(1):
            state, metrics = step(state, b)
            out["loss"].append([t.clone() for t in ff.rank_values(metrics["loss"])])
            out["norm"].append([t.clone() for t in ff.rank_values(metrics["grad_norm"])])
        out["shards"] = {
            k: [t.clone() for t in ff.rank_values(v.local)] for k, v in state.params.items()
        }
    return out


@pytest.mark.parametrize(("axes", "tp"), [({"dp": 2}, False), ({"dp": 2, "tp": 2}, True)])
def test_the_fast_mode_is_bitwise_torchs_local_tensor_mode(monkeypatch, axes, tp):
    fast = _trajectories(axes, tp)
    monkeypatch.setattr(_local_mode, "SimulationMode", lt.LocalTensorMode)  # torch's own
    plain = _trajectories(axes, tp)
    for key in ("loss", "norm"):
        assert all(torch.equal(a, b) for x, y in zip(fast[key], plain[key]) for a, b in zip(x, y))
    for k, shards in plain["shards"].items():
        assert all(torch.equal(a, b) for a, b in zip(fast["shards"][k], shards)), k


# --------------------------------------------------------------------------- scaling


def test_the_mesh_grid_is_read_once_per_mesh(monkeypatch):
    reads = []
    mesh_property = DeviceMesh.mesh

    def counted(self):
        reads.append(self)
        return mesh_property.fget(self)

    torch.manual_seed(0)
    params = {k: p.detach() for k, p in GPT(GPTConfig(n_layer=1)).named_parameters()}
    with ff.simulated_mesh({"dp": 4, "tp": 4}) as mesh:
        monkeypatch.setattr(DeviceMesh, "mesh", property(counted))
        sharded = ff.shard(params, mesh, ff.P(("tp", "dp")))
        full = ff.gather(sharded)
        grid = mesh_grid(mesh)
        assert mesh_grid(mesh) is grid
        assert len(reads) == 1  # was: per parameter and per rank, each read once per rank
        monkeypatch.setattr(DeviceMesh, "mesh", mesh_property)
        expected = mesh.mesh
        for r in range(16):
            coord = coordinate_of(mesh, r)
            assert int(expected[coord["dp"], coord["tp"]]) == r and rank_at(mesh, coord) == r
        assert all(torch.equal(ff.rank_values(full[k])[-1], v) for k, v in params.items())


def test_the_mesh_grid_outlives_an_equal_mesh(monkeypatch):
    # Two tests in one worker make equal meshes; when the first dies, the second's grid must
    # stay cached (it was dropped with the first, then read again inside ff.jit's trace).
    with ff.simulated_mesh({"dp": 2}) as first:
        mesh_grid(first)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        assert mesh == first and mesh is not first
        grid = mesh_grid(mesh)
        del first
        gc.collect()

        def unread(self):
            raise AssertionError("the mesh was read again")

        monkeypatch.setattr(DeviceMesh, "mesh", property(unread))
        assert mesh_grid(mesh) is grid


def _count_dispatches(monkeypatch, fn) -> int:
    calls = [0]
    dispatch = _local_mode.SimulationMode.__torch_dispatch__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return dispatch(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(_local_mode.SimulationMode, "__torch_dispatch__", counted)
        fn()
    return calls[0]


def test_sharding_costs_linear_in_ranks(monkeypatch):
    torch.manual_seed(0)
    params = {k: p.detach() for k, p in GPT(GPTConfig(n_layer=1)).named_parameters()}
    ops = {}
    for n in (32, 128):
        with ff.simulated_mesh({"dp": n}) as mesh:
            ops[n] = _count_dispatches(
                monkeypatch, lambda mesh=mesh: ff.shard(params, mesh, ff.P("dp"))
            )
    # shard() cuts each rank's block with a few ops: four times the ranks, four times the ops.
    assert 3.5 * ops[32] < ops[128] < 4.5 * ops[32], ops


def _ops_per_step(monkeypatch, n: int) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16))
    with ff.simulated_mesh({"dp": n}) as mesh:
        sm = ff.fsdp(model, mesh)
        opt = ff.adamw(1e-2, weight_decay=0.01)
        step = ff.train_step(lambda p, b: sm.apply(p, b).float().mean(), opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
        batch = torch.zeros(8, 13, dtype=torch.long)
        state, _ = step(state, batch)
        return _count_dispatches(monkeypatch, lambda: step(state, batch))


def test_a_simulated_step_issues_the_same_ops_at_any_rank_count(monkeypatch):
    # Each op runs once per rank inside the mode; the ops themselves do not multiply (sizes
    # that divide both: padding adds ops of its own; a batch of one row a few views). The only
    # per-rank ops are the metrics' check that every rank holds the same scalar (a few each).
    two, eight = _ops_per_step(monkeypatch, 2), _ops_per_step(monkeypatch, 8)
    assert two <= eight <= two + 16 * (8 - 2), (two, eight)


# --------------------------------------------------------------------------- shapes only


@pytest.mark.parametrize(
    ("kind", "axes"),
    [
        ("gpt", {"dp": 4}),
        ("gpt", {"replicate": 2, "shard": 2}),
        ("llama", {"dp": 2}),
    ],
)
def test_shapes_only_counts_what_a_simulated_run_counts(kind, axes):
    with ff.simulated_mesh(axes, shapes_only=True) as mesh:
        assert not ff.is_simulated()  # one rank, rank 0, on meta
        counted, loss = W.step_comms(mesh, kind, shapes_only=True)
        assert loss.is_meta and loss.shape == ()
    with ff.simulated_mesh(axes) as mesh:
        expected, _ = W.step_comms(mesh, kind)
    assert counted == expected


def test_shapes_only_tensor_parallel_counts_what_a_simulated_run_counts():
    cfg = GPTConfig(n_layer=2, vocab_size=62, n_embd=36, n_head=2, block_size=16)

    def run(shapes_only: bool) -> W.Comms:
        torch.manual_seed(0)
        with torch.device("meta") if shapes_only else torch.device("cpu"):
            model = GPT(cfg)
        with ff.simulated_mesh({"dp": 2, "tp": 2}, shapes_only=shapes_only) as mesh:
            plan = ff.tensor_parallel(model, mesh, gpt_plan(cfg))
            sm = ff.fsdp(model, mesh, specs=plan.specs, wrappers=plan.wrappers)
            params = sm.shard(dict(model.named_parameters())) if shapes_only else sm.shard()
            batch = torch.zeros(4, 13, dtype=torch.long, device="meta" if shapes_only else "cpu")
            with ff.count_comms() as comms:
                torch.func.grad(
                    lambda p: ff.vocab_parallel_cross_entropy(
                        sm.apply(p, batch[:, :-1]), batch[:, 1:], mesh
                    )
                )(params)
        return comms.by_kind_and_axis()

    assert run(True) == run(False)


def test_a_shapes_only_step_at_1024_ranks_takes_seconds():
    start = time.perf_counter()
    with ff.simulated_mesh({"dp": 1024}, shapes_only=True) as mesh:
        comms, loss = W.step_comms(mesh, "gpt", shapes_only=True)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert loss.is_meta
    assert {k: c for k, (c, _) in comms.items()} == {
        ("all_gather", "dp"): 6,  # three units, gathered in forward and again in backward
        ("reduce_scatter", "dp"): 3,
        ("all_reduce", "dp"): 2,  # the loss; the gradient norm (metrics and clipping share it)
    }


@pytest.mark.multiprocess
def test_shapes_only_counts_what_real_gloo_processes_count(pools):
    real = pools.run(2, W.real_step_comms, "gpt")
    assert real[0] == real[1]
    with ff.simulated_mesh({"dp": 2}, shapes_only=True) as mesh:
        counted, _ = W.step_comms(mesh, "gpt", shapes_only=True)
    assert counted == real[0]


@pytest.mark.multiprocess
def test_the_mesh_grid_on_real_gloo_processes(pools):
    for r in pools.run(2, W.real_grid):
        assert r == {
            "cached": True,
            "ranks": [0, 1],
            "mesh": [0, 1],
            "own": True,
            "round_trip": True,
        }


def test_a_shapes_only_mesh_shards_a_meta_model_with_fsdp_shard():
    # A 1024-rank shapes-only run of a model built on meta: FSDP.shard() gives meta blocks of
    # the right local shape instead of trying to initialise values.
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16))
    with ff.simulated_mesh({"dp": 1024}, shapes_only=True) as mesh:
        sm = ff.fsdp(model, mesh)
        params = sm.shard()
        out = sm.apply(params, torch.zeros(4, 8, dtype=torch.long, device="meta"))
    wte = params["tok_emb.weight"]
    assert wte.local.is_meta and wte.global_shape == (64, 32)
    assert tuple(wte.local.shape) == (1, 32)  # ceil(64 / 1024) rows per rank
    assert out.is_meta and tuple(out.shape) == (4, 8, 64)
