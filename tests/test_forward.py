"""Functional FSDP forward/backward: against the single-process reference and torch FSDP2."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._local_tensor import rank_map

import functional_fsdp as ff
from functional_fsdp.fsdp.memory import track_memory
from functional_fsdp.models import GPT, MLPModel, lm_loss

from . import _fsdp_workers as W

POLICIES = {
    "zero3": ff.Policy(),
    "shard_grad_op": ff.Policy(reshard_after_forward=False),  # FSDP's "ZeRO-2"
    "checkpoint": ff.Policy(activation_checkpointing=True),
    "prefetch2": ff.Policy(prefetch=2),
}
MESHES = [{"dp": 2}, {"dp": 4}, {"replicate": 2, "shard": 2}]


def _simulated_step(axes, policy, model, idx, tgt, specs=None):
    n = 1
    for s in axes.values():
        n *= s
    with ff.simulated_mesh(axes) as mesh:
        f = ff.fsdp(model, mesh, policy=policy, specs=specs)
        params = f.shard()
        per = idx.shape[0] // n
        x = rank_map(lambda r: idx[r * per : (r + 1) * per])
        y = rank_map(lambda r: tgt[r * per : (r + 1) * per])
        with ff.count_comms() as comms:
            grads, loss = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(params)
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
        losses = ff.rank_values(loss)
        return sum(losses) / len(losses), full, comms, len(f.units) + 1


@pytest.mark.parametrize("axes", MESHES, ids=str)
@pytest.mark.parametrize("name", list(POLICIES))
def test_gpt_matches_single_process(name, axes):
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    loss, grads, comms, units = _simulated_step(axes, POLICIES[name], model, idx, tgt)
    assert abs(loss - ref_loss) < 1e-5
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-5, msg=k)
    shard_axis = "shard" if "shard" in axes else "dp"
    gathers = 2 if POLICIES[name].reshard_after_forward else 1
    assert comms.count("all_gather", shard_axis) == gathers * units
    assert comms.count("reduce_scatter", shard_axis) == units
    assert comms.count("all_reduce", "replicate") == (units if "replicate" in axes else 0)


def test_full_shard_bytes_are_two_psi_and_one_psi():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    _, _, comms, _ = _simulated_step({"dp": 4}, ff.Policy(), model, idx, tgt)
    psi = sum(p.numel() * 4 for p in model.parameters())
    # Exact up to the padding of uneven dims (at most one row per tensor per rank).
    pad = sum(
        (p.shape[0] % 4 and 4 - p.shape[0] % 4) * p[0].numel() * 4 for p in model.parameters()
    )
    assert 2 * psi * 3 // 4 <= comms.bytes("all_gather") <= 2 * (psi + pad) * 3 // 4
    assert psi * 3 // 4 <= comms.bytes("reduce_scatter") <= (psi + pad) * 3 // 4


def test_ddp_specs_all_reduce_once_per_unit():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    loss, grads, comms, units = _simulated_step(
        {"dp": 2}, ff.Policy(), model, idx, tgt, specs=ff.P()
    )
    assert abs(loss - ref_loss) < 1e-5
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-5)
    assert comms.count("all_gather") == 0 and comms.count("all_reduce", "dp") == units


def test_mlp_uneven_frozen_and_module_untouched():
    torch.manual_seed(0)
    model = MLPModel((7, 13, 5, 3))
    model.layers[0].weight.requires_grad_(False)  # frozen: no gradient, no reduce-scatter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward_before = model.forward
    x = torch.randn(6, 7)
    with ff.simulated_mesh({"dp": 3}) as mesh:
        f = ff.fsdp(model, mesh, units=["layers.*"])
        params = f.shard()
        xs = rank_map(lambda r: x[2 * r : 2 * r + 2])
        train = {k: v for k, v in params.items() if k in f.trainable}
        frozen = {k: v for k, v in params.items() if k not in f.trainable}
        with ff.count_comms() as comms:
            grads = torch.func.grad(lambda t: f.apply({**t, **frozen}, xs).pow(2).mean())(train)
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
    ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean())(
        {k: v.detach() for k, v in model.named_parameters()}
    )
    assert sorted(full) == sorted(k for k in ref if k != "layers.0.weight")
    for k in full:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5)
    assert comms.count("reduce_scatter") == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.forward == forward_before and "forward" not in model.layers[0].__dict__


def test_bf16_param_dtype_halves_gather_bytes():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    _, _, fp32, _ = _simulated_step({"dp": 2}, ff.Policy(), model, idx, tgt)
    mp = ff.Policy(
        mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    loss, grads, bf16, _ = _simulated_step({"dp": 2}, mp, model, idx, tgt)
    assert bf16.bytes("all_gather") * 2 == fp32.bytes("all_gather")
    assert bf16.bytes("reduce_scatter") == fp32.bytes("reduce_scatter")  # fp32 reduction
    ref_loss, _ref_grads = W.reference(model, idx, tgt)
    assert abs(loss - ref_loss) < 5e-2
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_bad_units_and_params_raise():
    model = MLPModel()
    with pytest.raises(
        ValueError, match=r"unit pattern 'blocks\.\*' matches no submodule of MLPModel"
    ):
        ff.find_units(model, ["blocks.*"])
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        params = f.shard()
        params.pop("layers.0.bias")
        with pytest.raises(ValueError, match=r"missing \['layers\.0\.bias'\]"):
            f.apply(params, torch.randn(2, 7))


# --------------------------------------------------------------------------- memory accounting


class _Stack(nn.Module):
    """Root parameters (``inp``, ``out``) around four blocks, like a small transformer."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.out(x)


def _stack_memory(axes, policy):
    """Tracked gathered memory of one simulated step of ``_Stack``; also the unit order."""
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(8, 6)
    with ff.simulated_mesh(axes) as mesh:
        f = ff.fsdp(model, mesh, policy=policy)
        params = f.shard()
        per = x.shape[0] // ff.axis_size(mesh, "dp")
        xs = rank_map(lambda r: x[r * per : (r + 1) * per])
        with track_memory() as memory:
            torch.func.grad(lambda p: f.apply(p, xs).pow(2).mean())(params)
    return memory, list(f.units), model


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_forward_holds_at_most_one_plus_prefetch_units(prefetch):
    memory, units, _ = _stack_memory({"dp": 2}, ff.Policy(prefetch=prefetch))
    for i, unit in enumerate(units):
        (alive,) = memory.alive_during(unit, "forward")
        # The root stays gathered through the forward (it runs first and last), as in FSDP2.
        assert set(alive) - {""} == set(units[i : i + 1 + prefetch]), (unit, alive)
        (alive,) = memory.alive_during(unit, "backward")
        assert set(alive) - {""} == set(units[max(0, i - prefetch) : i + 1]), (unit, alive)
    assert memory.peak_units("forward", exclude=("",)) == 1 + prefetch
    assert memory.live_bytes == 0 and memory.live_units == ()
    unit_bytes = {e.unit: e.bytes for e in memory.events if e.kind == "gather"}
    peak_block = max(unit_bytes[u] for u in units)
    assert memory.peak_bytes <= unit_bytes[""] + (1 + prefetch) * peak_block


def test_shard_grad_op_keeps_every_unit_until_its_backward():
    memory, units, _ = _stack_memory({"dp": 2}, ff.Policy(reshard_after_forward=False))
    forward_end = max(i for i, e in enumerate(memory.events) if e.phase == "forward")
    assert set(memory.events[forward_end].live_units) == {"", *units}
    frees = [e for e in memory.events if e.kind == "free"]
    assert {e.unit for e in frees} == {"", *units} and all(e.phase == "backward" for e in frees)
    assert [e.unit for e in memory.events if e.kind == "gather"] == ["", *units]  # no regather
    assert memory.live_bytes == 0


def test_memory_bytes_are_the_padded_full_parameters():
    memory, units, model = _stack_memory({"dp": 4}, ff.Policy())
    for unit in ["", *units]:  # 6 rows pad to 8 on 4 ranks
        module_params = (
            model.get_submodule(unit).parameters()
            if unit
            else [*model.inp.parameters(), *model.out.parameters()]
        )
        padded = sum(-(-p.shape[0] // 4) * 4 * p[0].numel() * 4 for p in module_params)
        assert {e.bytes for e in memory.events if e.unit == unit and e.kind == "gather"} == {padded}
    assert "forward" in memory.summary() and "blocks.3" in memory.summary()


# --------------------------------------------------------------------------- edge cases (simulated)


def _simulated_grads(
    model, x, axes, *, units=None, policy=None, loss=None, backward="func", buffers=None, **kw
):
    """Gathered grads of ``loss(model(x, **kw))`` on a simulated mesh, and the reference's."""
    loss = loss or (lambda out: out.float().pow(2).mean())
    ref = torch.func.grad(
        lambda p: loss(torch.func.functional_call(model, {**p, **(buffers or {})}, (x,), kw))
    )({k: v.detach() for k, v in model.named_parameters()})
    n = 1
    for s in axes.values():
        n *= s
    per = x.shape[0] // n
    with ff.simulated_mesh(axes) as mesh:
        f = ff.fsdp(model, mesh, units=units, policy=policy)
        params = f.shard()
        xs = rank_map(lambda r: x[r * per : (r + 1) * per])

        def run(p):
            return loss(f.apply(p, xs, buffers=buffers, **kw))

        with ff.count_comms() as comms:
            if backward == "func":
                grads = torch.func.grad(run)(params)
            else:  # plain autograd; a parameter outside the graph gets None: read it as zero
                leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
                run({k: v.replace(leaves[k]) for k, v in params.items()}).backward()
                grads = {
                    k: v.replace(
                        torch.zeros_like(leaves[k]) if leaves[k].grad is None else leaves[k].grad
                    )
                    for k, v in params.items()
                }
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
    return full, ref, comms


class _SharedAcrossUnits(nn.Module):
    """``blocks.1.weight`` is ``blocks.0.weight``: one parameter used by two units."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_parameter_shared_by_two_units_lands_in_the_root_with_one_summed_gradient():
    model = _SharedAcrossUnits()
    x = torch.randn(4, 6)
    full, ref, _ = _simulated_grads(model, x, {"dp": 2})
    assert set(full) == set(ref) and "blocks.1.weight" not in full  # one gradient
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh)
        with track_memory() as memory:
            f.apply(f.shard(), torch.randn(2, 6))
    root = {e.bytes for e in memory.events if e.unit == "" and e.kind == "gather"}
    assert root == {6 * 6 * 4}  # the shared weight is gathered with the root, and only there
    assert {e.bytes for e in memory.events if e.unit == "blocks.0" and e.kind == "gather"} == {24}


def test_tied_head_has_one_gradient_with_both_uses():
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    _, ref = W.reference(model, idx, tgt)
    _, full, _, _ = _simulated_step({"dp": 2}, ff.Policy(), model, idx, tgt)
    assert "head.weight" not in full  # one parameter, one gradient
    torch.testing.assert_close(full["tok_emb.weight"], ref["tok_emb.weight"], atol=1e-5, rtol=1e-5)
    # It is the sum of both uses: the embedding's use alone gives a different gradient.
    params = {n: p.detach() for n, p in model.named_parameters()}

    def embedding_use_only(w):
        tensors = {**params, "tok_emb.weight": w, "head.weight": params["tok_emb.weight"]}
        out = torch.func.functional_call(model, tensors, (idx,), tie_weights=False)
        return lm_loss(out, tgt)

    untied = torch.func.grad(embedding_use_only)(params["tok_emb.weight"])
    assert not torch.allclose(untied, ref["tok_emb.weight"], atol=1e-4)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))
        self.register_buffer("shift", torch.arange(5.0))
        self.layers[1].register_buffer("scale", torch.full((5,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x + self.shift)
        return self.layers[1](x) * self.layers[1].scale


@pytest.mark.parametrize("override", [False, True])
def test_buffers_pass_through_unsharded(override):
    torch.manual_seed(0)
    model = _WithBuffer()
    x = torch.randn(4, 5)
    buffers = (
        {"shift": torch.full((5,), -1.0), "layers.1.scale": torch.ones(5)} if override else None
    )
    full, ref, comms = _simulated_grads(model, x, {"dp": 2}, buffers=buffers)
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    assert set(full) == {k for k, _ in model.named_parameters()}  # buffers are not params
    padded = sum(-(-p.shape[0] // 2) * 2 * p[0].numel() * 4 for p in model.parameters())
    assert comms.bytes("all_gather") == padded  # 2 gathers of half each: no buffer moves
    assert torch.equal(model.shift, torch.arange(5.0))  # the module's buffer is untouched
    if override:  # and the override changed the result
        default = torch.func.grad(
            lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean()
        )({k: v.detach() for k, v in model.named_parameters()})
        assert not torch.allclose(default["layers.0.weight"], full["layers.0.weight"])


class _ScaledLinear(nn.Linear):
    """A float32 linear layer with a float64 gain: two dtypes in one unit."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.gain = nn.Parameter(torch.rand(n, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x).double() * self.gain).float()


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScaledLinear(5), nn.Linear(5, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def test_parameters_of_different_dtypes_in_one_unit():
    torch.manual_seed(0)
    model = _MixedDtypes()
    full, ref, comms = _simulated_grads(model, torch.randn(4, 5), {"dp": 2})
    assert full["blocks.0.gain"].dtype == torch.float64
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    # blocks.0 gathers twice per phase (one bucket per dtype), blocks.1 once: 3 + 3, reduce 3.
    assert comms.count("all_gather") == 6 and comms.count("reduce_scatter") == 3
    assert {r.dtype for r in comms.records} == {torch.float32, torch.float64}


def test_uneven_shapes_where_some_ranks_hold_only_padding():
    torch.manual_seed(0)
    model = MLPModel((13, 7, 5, 3))  # on 4 ranks, [3, 5] and [3] leave rank 3 only padding
    full, ref, comms = _simulated_grads(model, torch.randn(8, 13), {"dp": 4}, units=["layers.*"])
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    assert comms.count("reduce_scatter") == 3


def test_a_module_called_twice_is_gathered_and_reduced_per_call():
    torch.manual_seed(0)
    model = W.Reuse()
    full, ref, comms = _simulated_grads(model, torch.randn(4, 6), {"dp": 2})
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    # Four calls of three units, plus the root (head): 5 gathers per phase, 5 reduce-scatters.
    assert comms.count("all_gather") == 10 and comms.count("reduce_scatter") == 5


@pytest.mark.parametrize("backward", ["func", "autograd"])
def test_unused_parameters_and_skipped_units_get_zero_gradients(backward):
    torch.manual_seed(0)
    model = W.Reuse()
    full, ref, comms = _simulated_grads(
        model, torch.randn(4, 6), {"dp": 2}, backward=backward, skip=True
    )
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    assert not full["blocks.1.unused"].any()  # in a unit that ran: reduced like the others
    assert not full["blocks.2.weight"].any() and not full["blocks.2.bias"].any()  # skipped unit
    assert comms.count("reduce_scatter") == 4  # blocks.0 twice, blocks.1, root; blocks.2 none


@pytest.mark.parametrize("backward", ["autograd", "vjp"])
def test_plain_autograd_and_vjp_match_the_reference(backward):
    torch.manual_seed(0)
    model = GPT(W.CFG)
    idx, tgt = W.gpt_batch()
    ref_loss, ref = W.reference(model, idx, tgt)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        f = ff.fsdp(model, mesh, policy=ff.Policy(activation_checkpointing=True))
        params = f.shard()
        xs, ys = (rank_map(lambda r, t=t: t[r * 4 : r * 4 + 4]) for t in (idx, tgt))
        if backward == "vjp":
            out, vjp_fn = torch.func.vjp(lambda p: lm_loss(f.apply(p, xs), ys), params)
            (grads,) = vjp_fn(torch.ones_like(out))
        else:
            leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
            out = lm_loss(f.apply({k: v.replace(leaves[k]) for k, v in params.items()}, xs), ys)
            out.backward()
            grads = {k: v.replace(leaves[k].grad) for k, v in params.items()}
        full = {k: ff.rank_values(v)[0] for k, v in ff.gather(grads).items()}
        losses = ff.rank_values(out.detach())
    assert abs(sum(losses) / 2 - ref_loss) < 1e-5
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], atol=1e-5, rtol=1e-5, msg=k)


def test_output_dtype():
    torch.manual_seed(0)
    model = MLPModel()
    x = torch.randn(4, 7)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        outs = {}
        for name, mp in {
            "bf16": ff.MixedPrecision(param_dtype=torch.bfloat16),
            "bf16 -> fp32": ff.MixedPrecision(
                param_dtype=torch.bfloat16, output_dtype=torch.float32
            ),
            "fp32 -> fp64": ff.MixedPrecision(output_dtype=torch.float64),
        }.items():
            f = ff.fsdp(model, mesh, policy=ff.Policy(mixed_precision=mp))
            params = f.shard()
            outs[name] = f.apply(params, x)
            grads = torch.func.grad(lambda p: f.apply(p, x).sum())(params)
            assert all(g.dtype == torch.float32 for g in grads.values())  # master dtype
    assert {k: v.dtype for k, v in outs.items()} == {
        "bf16": torch.bfloat16,
        "bf16 -> fp32": torch.float32,
        "fp32 -> fp64": torch.float64,
    }
    ref = model(x)
    torch.testing.assert_close(ff.rank_values(outs["fp32 -> fp64"])[0], ref.double())
    torch.testing.assert_close(ff.rank_values(outs["bf16 -> fp32"])[0], ref, atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------- real gloo
# Grouped by world size (1, 2, 4): one pool of workers is alive at a time.


def _matches_reference_and_fsdp2(pools, world):
    for kwargs in ({}, {"reshard_after_forward": False}):
        for use_func in (True, False):
            out = pools.run(world, W.fsdp_vs_reference, {"dp": world}, kwargs, use_func)[0]
            assert abs(out["loss"] - out["ref_loss"]) < 1e-5, out
            assert out["grad_err"] < 1e-5, out
    for r in pools.run(world, W.fsdp2_reference):
        assert r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-5, r


@pytest.mark.multiprocess
def test_gloo_world_1_matches_reference_and_fsdp2(pools):
    _matches_reference_and_fsdp2(pools, 1)


@pytest.mark.multiprocess
def test_gloo_world_1_single_parameter_units_keep_their_shards(pools):
    # Gathering over an axis of size 1 moves nothing; the shard itself must never be freed.
    r = pools.run(1, W.single_parameter_units)[0]
    assert r == {"units": ("0", "2"), "shards_intact": True, "err": r["err"]} and r["err"] < 1e-6


@pytest.mark.multiprocess
def test_gloo_world_2_matches_reference_and_fsdp2(pools):
    _matches_reference_and_fsdp2(pools, 2)


@pytest.mark.multiprocess
def test_gloo_gathered_storage_is_freed_after_each_unit(pools):
    policies = [{}, {"prefetch": 2}, {"reshard_after_forward": False}]
    results = pools.run(2, W.memory_proofs, policies)[0]
    for policy, r in zip(policies, results):
        prefetch, reshard = policy.get("prefetch", 1), policy.get("reshard_after_forward", True)
        units, size = [f"blocks.{i}" for i in range(4)], r["unit_bytes"]
        assert r["grad_err"] < 1e-5 and r["unwaited"] == 0, (policy, r["grad_err"])
        for i, snap in enumerate(r["snapshots"]):  # inside each block's forward
            unit, real = snap["unit"], snap["real"]
            assert unit == units[i] and real[unit] == size[unit] > 0 and real[""] == size[""]
            for earlier in units[:i]:  # storage of the units before: freed, or kept (ZeRO-2)
                assert real[earlier] == (0 if reshard else size[earlier]), (policy, snap)
            # The tracker agrees: the gathered units plus the prefetched ones, nothing else.
            ahead = units[i + 1 : i + 1 + prefetch]
            held = units[: i + 1] if not reshard else [unit]
            assert sorted(snap["tracked"]) == sorted(["", *held, *ahead]), (policy, snap)
            assert snap["tracked_bytes"] == sum(size[u] for u in ["", *held, *ahead])
        if reshard:
            assert set(r["after_forward"].values()) == {0} and r["tracked_after_forward"] == ()
            assert r["peak_forward"] == r["peak_backward"] == 1 + prefetch
        else:  # ZeRO-2: every unit stays gathered until its backward
            assert r["after_forward"] == size and len(r["tracked_after_forward"]) == 5
        assert set(r["after_backward"].values()) == {0} and r["tracked_after_backward"] == ()


@pytest.mark.multiprocess
def test_gloo_autograd_step_leaves_no_reference_cycle(pools):
    # The step's gathered tensors die with its graph, without Python's cycle collector.
    result = pools.run(2, W.autograd_step_frees_without_gc)[0]
    assert result == {"had_grad": True, "collected": True}


@pytest.mark.multiprocess
def test_gloo_bf16_matches_fsdp2_mixed_precision(pools):
    r = pools.run(2, W.bf16_vs_fsdp2)[0]
    assert r["gather_dtypes"] == ["torch.bfloat16"] and r["grad_dtypes"] == ["torch.float32"]
    assert r["loss_vs_fsdp2"] < 1e-3 and r["grad_err_vs_fsdp2"] < 1e-2, r  # bf16 tolerance
    assert r["loss_vs_fp32"] < 1e-2 and r["grad_err_vs_fp32"] < 5e-2, r  # and near fp32


@pytest.mark.multiprocess
@pytest.mark.parametrize("use_func", [True, False], ids=["torch.func", "autograd"])
def test_gloo_module_called_twice_unused_params_and_skipped_unit(pools, use_func):
    full, skipped = pools.run(2, W.reuse_and_skip, use_func)[0]
    for step in (full, skipped):
        assert step["err"] < 1e-6 and step["unwaited"] == 0, step
        assert "blocks.1.unused" in step["zero"]
    assert full["comms"][("reduce_scatter", "dp")][0] == 5  # blocks.0 once per call
    assert skipped["comms"][("reduce_scatter", "dp")][0] == 4  # nothing for blocks.2
    # The skipped unit's parameters: zeros from torch.func, no gradient under autograd.
    absent = {"blocks.2.bias", "blocks.2.weight"}
    assert absent <= set(skipped["zero"] if use_func else skipped["none"])
    assert absent.isdisjoint(skipped["none"] if use_func else skipped["zero"])


@pytest.mark.multiprocess
def test_gloo_world_4_matches_reference_and_fsdp2(pools):
    _matches_reference_and_fsdp2(pools, 4)


@pytest.mark.multiprocess
def test_gloo_hsdp_2x2(pools):
    out = pools.run(4, W.fsdp_vs_reference, {"replicate": 2, "shard": 2}, {}, True)[0]
    assert abs(out["loss"] - out["ref_loss"]) < 1e-5 and out["grad_err"] < 1e-5, out
    assert ("all_reduce", "replicate") in out["comms"]


@pytest.mark.multiprocess
def test_gloo_uneven_shapes_world_4(pools):
    results = pools.run(4, W.mlp_uneven, (13, 7, 5, 3))
    for r in results:
        assert r["func_err"] < 1e-6 and r["autograd_err"] < 1e-6, r
    # [5, 7] and [3, 5] (and their biases) split 2 and 1 rows a rank: rank 3 holds padding.
    assert sorted(results[3]["padding_only"]) == [
        f"layers.{i}.{n}" for i in (1, 2) for n in ("bias", "weight")
    ]
