"""Tensor parallelism and 2D FSDP+TP: against the single-process reference and torch FSDP2+TP."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._local_tensor import rank_map

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan
from functional_fsdp.tp.ops import (
    copy_to,
    gather_from,
    reduce_from,
    scatter_to,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from functional_fsdp.tp.plan import tensor_parallel
from functional_fsdp.tp.styles import (
    ColwiseParallel,
    PrepareInput,
    RowwiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
)
from functional_fsdp.train import local_batch

from . import _tp_workers as W

P = ff.P


def ranks(t: torch.Tensor) -> list[torch.Tensor]:
    return ff.rank_values(t)


# --------------------------------------------------------------------------- conjugate ops


def test_conjugate_ops_forward_and_backward():
    # 2x2 mesh, rank = 2 * dp + tp: the ops must act within each tp pair only.
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        x = rank_map(lambda r: torch.arange(4.0) + 10 * r)
        ct = rank_map(lambda r: torch.full((4,), r + 1.0))
        out, vjp = torch.func.vjp(lambda x: copy_to(x, mesh), x)
        assert [t.tolist() for t in ranks(out)] == [t.tolist() for t in ranks(x)]
        assert [t.tolist() for t in ranks(vjp(ct)[0])] == [[3.0] * 4] * 2 + [[7.0] * 4] * 2

        out, vjp = torch.func.vjp(lambda x: reduce_from(x, mesh), x)
        pair = [torch.arange(4.0) * 2 + 10, torch.arange(4.0) * 2 + 50]
        assert [t.tolist() for t in ranks(out)] == [pair[0].tolist()] * 2 + [pair[1].tolist()] * 2
        assert [t.tolist() for t in ranks(vjp(ct)[0])] == [t.tolist() for t in ranks(ct)]

        out, vjp = torch.func.vjp(lambda x: scatter_to(x, mesh, dim=0), x)
        assert [t.tolist() for t in ranks(out)] == [[0, 1], [12, 13], [20, 21], [32, 33]]
        ct2 = rank_map(lambda r: torch.tensor([r, -r], dtype=torch.float32))
        with ff.count_comms() as comms:
            grad = vjp(ct2)[0]
        assert comms.count("all_gather", "tp") == 1
        assert [t.tolist() for t in ranks(grad)] == [[0, 0, 1, -1]] * 2 + [[2, -2, 3, -3]] * 2

        local = rank_map(lambda r: torch.tensor([2.0 * r, 2.0 * r + 1]))
        out, vjp = torch.func.vjp(lambda x: gather_from(x, mesh), local)
        assert [t.tolist() for t in ranks(out)] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
        with ff.count_comms() as comms:
            grad = vjp(ct * torch.arange(4.0))[0]
        assert comms.count() == 0  # the gradient of a replicated value is sliced, not reduced
        assert [t.tolist() for t in ranks(grad)] == [[0, 1], [4, 6], [0, 3], [8, 12]]


def test_vocab_parallel_cross_entropy_matches_dense():
    full = torch.randn(2, 3, 8)
    tgt = torch.tensor([[1, 7, -100], [4, 0, 3]])
    ref_grad, ref_loss = torch.func.grad_and_value(
        lambda z: F.cross_entropy(z.reshape(-1, 8), tgt.reshape(-1))
    )(full)
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        local = ff.shard(full, mesh, P(None, None, "tp")).local
        with ff.count_comms() as comms:
            grad, loss = torch.func.grad_and_value(
                lambda z: vocab_parallel_cross_entropy(z, tgt, mesh)
            )(local)
        want = ranks(ff.shard(ref_grad, mesh, P(None, None, "tp")).local)
        for got, expected in zip(ranks(grad), want):
            torch.testing.assert_close(got, expected)
        for value in ranks(loss):
            torch.testing.assert_close(value, ref_loss)
        # max (one all-gather), sum-exp and target logit (two all-reduces), all over tp:
        # nothing of vocabulary size moves.
        assert comms.by_kind_and_axis() == {
            ("all_gather", "tp"): (1, 24),
            ("all_reduce", "tp"): (2, 48),
        }
        all_ignored = vocab_parallel_cross_entropy(local, torch.full((2, 3), -100), mesh)
        assert all(v.item() == 0.0 for v in ranks(all_ignored))


@pytest.mark.parametrize("sequence_dim", [None, 1])
def test_vocab_parallel_embedding_matches_dense(sequence_dim):
    table, ids = torch.randn(8, 3), torch.tensor([[7, 0, 3, 4], [1, 1, 6, 2]])
    ct = torch.randn(2, 4, 3)
    ref = F.embedding(ids, table)
    ref_grad = torch.func.grad(lambda w: (F.embedding(ids, w) * ct).sum())(table)
    with ff.simulated_mesh({"tp": 2}) as mesh:
        w = ff.shard(table, mesh, P("tp")).local
        if sequence_dim is None:
            out = vocab_parallel_embedding(ids, w, mesh)
            assert all(torch.equal(o, ref) for o in ranks(out))
            grad = torch.func.grad(lambda w: (vocab_parallel_embedding(ids, w, mesh) * ct).sum())(w)
        else:
            out = vocab_parallel_embedding(ids, w, mesh, sequence_dim=1)
            assert [o.tolist() for o in ranks(out)] == [ref[:, :2].tolist(), ref[:, 2:].tolist()]
            cts = rank_map(lambda r: ct[:, 2 * r : 2 * r + 2])
            grad = torch.func.grad(
                lambda w: (vocab_parallel_embedding(ids, w, mesh, sequence_dim=1) * cts).sum()
            )(w)
        assert [g.tolist() for g in ranks(grad)] == [ref_grad[:4].tolist(), ref_grad[4:].tolist()]


# --------------------------------------------------------------------------- GPT, simulated

CASES = [
    ({"dp": 2, "tp": 2}, {}),
    ({"dp": 2, "tp": 2}, {"loss_parallel": False}),
    ({"dp": 2, "tp": 2}, {"sequence_parallel": True}),
    ({"dp": 1, "tp": 4}, {}),
    ({"dp": 1, "tp": 4}, {"sequence_parallel": True}),
    ({"tp": 2}, {}),
    ({"replicate": 2, "shard": 1, "tp": 2}, {}),
    ({"replicate": 2, "shard": 2, "tp": 2}, {"sequence_parallel": True}),
]


def _simulated(axes, options):
    model = W.new_model()
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    with ff.simulated_mesh(axes) as mesh:
        out = W.ours(model, mesh, options, idx, tgt)
        out["loss"] = ranks(out["loss"])
        out["grads"] = {k: ranks(v) for k, v in out["grads"].items()}
    return model, ref_loss, ref_grads, out


@pytest.mark.parametrize(
    ("axes", "options"),
    CASES,
    ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) or "default",
)
def test_gpt_matches_single_process(axes, options):
    model, ref_loss, ref_grads, out = _simulated(axes, options)
    assert len(out["loss"]) == math.prod(axes.values())
    for loss in out["loss"]:
        assert abs(loss.item() - ref_loss.item()) < 1e-5
    for k, ref in ref_grads.items():
        for grad in out["grads"][k]:  # every rank gathers the same full gradient
            torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5, msg=k)
    fsdp = tuple(a for a in axes if a not in ("tp", "replicate"))
    assert out["specs"]["blocks.0.attn.wq.weight"] == P(("tp", *fsdp), None)
    assert out["specs"]["blocks.0.attn.wq.bias"] == P(("tp", *fsdp))
    assert out["specs"]["blocks.0.attn.wo.weight"] == P(fsdp, "tp")
    assert out["specs"]["blocks.0.attn.wo.bias"] == P(fsdp)
    assert out["specs"]["tok_emb.weight"] == P(("tp", *fsdp), None)  # also the tied head's
    assert out["specs"]["ln_f.weight"] == P(fsdp)
    # No module was changed by the wrappers.
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model.head.weight is model.tok_emb.weight


def test_2d_communication_per_axis():
    _, _, _, out = _simulated({"dp": 2, "tp": 2}, {})
    model = W.new_model()
    layers = W.CFG.n_layer
    tp_local = sum(
        p.numel() * 4 // (2 if "tp" in out["specs"][n].axes else 1)
        for n, p in model.named_parameters()
    )
    # FSDP over dp moves the TP-local parameters: 2Ψ/tp all-gather, Ψ/tp reduce-scatter,
    # times (N-1)/N (every dim 0 divides here, so there is no padding).
    comms = out["comms"]
    assert comms[("all_gather", "dp")] == (2 * (layers + 1), 2 * tp_local // 2)
    assert comms[("reduce_scatter", "dp")] == (layers + 1, tp_local // 2)
    assert ("all_reduce", "dp") not in comms and ("reduce_scatter", "tp") not in comms
    # tp: forward embedding + 2 per block + 2 in the loss; backward 2 per block + the head.
    assert comms[("all_reduce", "tp")][0] == 4 * layers + 4
    assert comms[("all_gather", "tp")][0] == 1  # the loss's row max


@pytest.mark.parametrize(
    "policy",
    [ff.Policy(reshard_after_forward=False), ff.Policy(activation_checkpointing=True, prefetch=2)],
    ids=["shard_grad_op", "checkpoint"],
)
def test_policies_compose_with_tp(policy):
    model = W.new_model()
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        f, loss_fn = W.build(model, mesh, sequence_parallel=True, policy=policy)
        x, y = local_batch((idx, tgt), mesh, ("dp",))
        grads, loss = torch.func.grad_and_value(loss_fn)(f.shard(), x, y)
        full = {k: ranks(v)[0] for k, v in ff.gather(grads).items()}
        losses = ranks(loss)  # rank = 2 * dp + tp; each dp rank has its half of the batch
    assert abs((losses[0] + losses[2]).item() / 2 - ref_loss.item()) < 1e-5
    assert torch.equal(losses[0], losses[1]) and torch.equal(losses[2], losses[3])
    for k, ref in ref_grads.items():
        torch.testing.assert_close(full[k], ref, atol=1e-5, rtol=1e-5, msg=k)


def test_hsdp_tp_training_matches_single_process():
    model, data = W.new_model(), W.batches(3)
    ref = W.train_reference(model, data)
    with ff.simulated_mesh({"replicate": 2, "shard": 1, "tp": 2}) as mesh:
        out = W.train_ours(model, mesh, data, sequence_parallel=True)
        losses = [ranks(v) for v in out["losses"]]
        norms = [ranks(v) for v in out["norms"]]
        params = {k: ranks(v)[3] for k, v in out["params"].items()}
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert all(abs(v.item() - want) < 1e-5 for v in got), step
    for got, want in zip(norms, ref["norms"]):
        assert want > W.CLIP and all(abs(v.item() - want) < 1e-5 for v in got)
    assert W.param_err(params, ref["params"]) < 5e-5


def test_train_step_with_tp_and_local_accumulation():
    model = W.new_model()
    idx, tgt = W.gpt_batch()
    ref_loss, ref_grads = W.reference(model, idx, tgt)
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        f, loss_fn = W.build(model, mesh)
        step = ff.train_step(
            lambda p, b: loss_fn(p, *b),
            ff.sgd(0.1),
            model=f,
            accumulate=2,
            accumulate_mode="local",  # gathers over dp only: the TP-local blocks
        )
        state, metrics = step(ff.TrainState.create(f.shard(), ff.sgd(0.1)), (idx, tgt))
        full = {k: ranks(v)[0] for k, v in ff.gather(state.params).items()}
        loss, norm = ranks(metrics["loss"]), ranks(metrics["grad_norm"])
    assert all(abs(v.item() - ref_loss.item()) < 1e-5 for v in loss)
    assert all(abs(v.item() - ref_norm.item()) < 1e-5 for v in norm)
    for name, p in model.named_parameters():
        torch.testing.assert_close(full[name], p - 0.1 * ref_grads[name], atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- errors


def _mesh_error(model, plan, axes=None, match="", **kwargs):
    with (
        ff.simulated_mesh(axes or {"dp": 1, "tp": 2}) as mesh,
        pytest.raises(ValueError, match=match),
    ):
        tensor_parallel(model, mesh, plan, **kwargs)


def test_pattern_matching_no_module_raises():
    _mesh_error(
        GPT(W.CFG),
        {**gpt_plan(W.CFG), "blocks.*.attn.wqkv": ColwiseParallel()},
        match=r"plan pattern 'blocks\.\*\.attn\.wqkv' matches no module of GPT on "
        r"Mesh\(dp=1, tp=2\)\. .*did you mean \[",
    )


def test_tp_that_does_not_divide_raises():
    _mesh_error(
        nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4)),
        {"0": ColwiseParallel(), "1": RowwiseParallel()},
        {"tp": 4},
        match=r"plan entry '0' gives module '0' \(Linear, weight \(6, 4\)\) ColwiseParallel\(.*\) on "
        r"Mesh\(tp=4\), but tp=4 does not divide its 6 output features\. Use a tp that divides 6",
    )
    _mesh_error(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(6, 4)),
        {"1": RowwiseParallel()},
        {"tp": 4},
        match=r"module '1' .* tp=4 does not divide its 6 input features",
    )


def test_a_vocabulary_tp_does_not_divide_is_padded():
    # 10 rows on tp=4: blocks of 3, the last holding 1 row and 2 padded ones never looked up.
    model = nn.Sequential(nn.Embedding(10, 4))
    ids = torch.arange(10).reshape(2, 5)
    want, want_grad = torch.func.grad_and_value(
        lambda p: torch.func.functional_call(model, p, (ids,)).square().sum()
    )(dict(model.named_parameters()))[::-1]
    with ff.simulated_mesh({"tp": 4}) as mesh:
        tp = ff.tensor_parallel(model, mesh, {"0": VocabParallelEmbedding()})
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        grads, got = torch.func.grad_and_value(lambda p: f.apply(p, ids).square().sum())(f.shard())
        grads = ff.gather(grads)
    for value in ff.rank_values(got):
        torch.testing.assert_close(value, want)
    for value in ff.rank_values(grads["0.weight"]):
        torch.testing.assert_close(value, want_grad["0.weight"])


def test_head_count_that_tp_does_not_divide_raises():
    cfg = GPTConfig(n_layer=1, vocab_size=64, n_embd=36, n_head=3, block_size=16)
    _mesh_error(
        GPT(cfg),
        gpt_plan(cfg),
        match=r"plan entry 'blocks\.\*\.attn\.w\[qkv\]' gives module 'blocks\.0\.attn\.wq' "
        r"\(Linear, weight \(36, 36\)\) .* tp=2 does not divide its 3 attention heads \(36 output "
        r"features, head_dim 12\)\. Use a tp that divides the head count \(one of \[1, 3\]\)",
    )


def test_conflicting_specs_for_a_tied_parameter_raise():
    plan = gpt_plan(W.CFG)
    untied_head = {k: v for k, v in plan.items() if k != "head"}
    _mesh_error(
        GPT(W.CFG),
        untied_head,
        match=r"the parameter 'tok_emb\.weight' is shared with 'head\.weight' \(shape \(64, 32\)\), "
        r"but gets P\('tp', None\) from plan entry 'tok_emb' \(VocabParallelEmbedding on "
        r"'tok_emb'\) and P\(None, None\) from no plan entry for 'head' \(replicated\) on Mesh\(dp=1, tp=2\).*"
        r"or untie the weights",
    )
    _mesh_error(
        GPT(W.CFG),
        {**plan, "head": RowwiseParallel()},
        match=r"gets P\('tp', None\) from .* and P\(None, 'tp'\) from plan entry 'head' \(RowwiseParallel",
    )


def test_other_plan_mistakes_raise():
    model = GPT(W.CFG)
    _mesh_error(
        model,
        {"blocks.0.attn.wq": ColwiseParallel(), "blocks.*.attn.wq": RowwiseParallel()},
        match=r"module 'blocks\.0\.attn\.wq' is matched by plan patterns 'blocks\.0\.attn\.wq' "
        r"\(ColwiseParallel.*\) and 'blocks\.\*\.attn\.wq' \(RowwiseParallel",
    )
    _mesh_error(
        model,
        {"blocks.*.mlp.fc1": ColwiseParallel(input="prepared")},
        match=r"input='prepared' needs a PrepareInput\(\) style on an enclosing module",
    )
    _mesh_error(
        model,
        {"blocks.*.ln1": ColwiseParallel()},
        match=r"ColwiseParallel needs an nn\.Linear, not a LayerNorm",
    )
    _mesh_error(
        model,
        {"ln_f": SequenceParallel()},
        {"dp": 2},
        match=r"the mesh Mesh\(dp=2\) has no tensor-parallel axis 'tp'",
    )
    _mesh_error(model, {}, match=r"fsdp_axes \('tp',\) names 'tp'", fsdp_axes=("tp",))
    with ff.simulated_mesh({"tp": 2}) as mesh, pytest.raises(TypeError, match=r"not a Style"):
        tensor_parallel(model, mesh, {"head": "colwise"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"ColwiseParallel\(input='rows'\): input must be one of"):
        ColwiseParallel(input="rows")  # type: ignore[arg-type]
    with ff.simulated_mesh({"tp": 2}) as mesh, pytest.raises(ValueError, match=r"multiple of 2"):
        scatter_to(torch.ones(3), mesh)


class _Pair(nn.Module):
    """Two colwise linears reading one input, like q and k in attention."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q(x) * self.k(x)).sum(-1)  # partial over tp: the features are split


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pair(x)


def test_prepare_input_reduces_once_for_several_linears():
    model, x = _Outer(), torch.randn(3, 4)
    want = torch.func.grad(lambda x: model(x).sum())(x)
    plans = [
        ({"pair": PrepareInput(), "pair.[qk]": ColwiseParallel(input="prepared")}, 1),
        ({"pair.[qk]": ColwiseParallel()}, 2),  # one copy_to per linear
    ]
    for plan, backward_reduces in plans:
        with ff.simulated_mesh({"tp": 2}) as mesh:
            tp = tensor_parallel(model, mesh, plan)
            f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
            params = f.shard()
            with ff.count_comms() as comms:
                grad = torch.func.grad(lambda x: reduce_from(f.apply(params, x), mesh).sum())(x)
            assert comms.count("all_reduce", "tp") == 1 + backward_reduces
            for g in ranks(grad):
                torch.testing.assert_close(g, want)


# --------------------------------------------------------------------------- real gloo


@pytest.mark.multiprocess
def test_gloo_2d_matches_reference_and_torch_fsdp2_tp(pools):
    reference = []
    for options in ({}, {"sequence_parallel": True}):
        for r in pools.run(4, W.gloo_vs_reference, {"dp": 2, "tp": 2}, options):
            assert r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-5, (options, r)
            reference.append(r)
    torch_runs = pools.run(4, W.gloo_vs_torch)
    for r in torch_runs:
        assert r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-5, r
        # ff.global_norm (what ff.clip_by_global_norm scales by) over the 2D shards is the
        # norm of FSDP2+TP's full gradients.
        assert r["norm_err"] < 1e-6, r
    # README.md quotes the largest differences (pytest -s).
    for what, runs in (("one process", reference), ("FSDP2 + parallelize_module", torch_runs)):
        loss = max(r["loss_diff"] for r in runs)
        grads = max(r["grad_err"] for r in runs)
        print(f"GPT on 2x2 vs {what}: loss {loss:.2g}, gradients {grads:.2g}")


@pytest.mark.multiprocess
def test_gloo_2d_training_with_adamw_and_clipping(pools):
    for r in pools.run(4, W.gloo_train, {"dp": 2, "tp": 2}, 10):
        assert r["loss_err"] < 1e-5 and r["norm_err"] < 1e-5, r
        assert r["param_err"] < 5e-5, r
        assert r["clipped"] == 10  # clipping was active at every step


@pytest.mark.multiprocess
def test_gloo_tp_alone_1x4(pools):
    for r in pools.run(4, W.gloo_vs_reference, {"dp": 1, "tp": 4}, {"sequence_parallel": True}):
        assert r["loss_diff"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert all(axis == "tp" for _, axis in r["comms"]), r["comms"]
