"""The shape-only planner (``ff.plan``): its figures against real gloo runs, its speed, its
errors and its renderings.

Every figure is compared with what a real ``ff.train_step`` measures: collective counts and
bytes (``count_comms``) exactly, shard/gradient/optimizer-state bytes exactly (the real
tensors), gathered-parameter peak exactly (``track_memory``), and activations within 10% of
the storages a plain-autograd forward keeps for backward.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan
from functional_fsdp.planner import PlanReport, compare_strategies, plan

from . import _planner_workers as W

BF16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

CASES_2 = {
    "zero3": dict(model="gpt", mesh={"dp": 2}),
    "shard_grad_op": dict(
        model="gpt", mesh={"dp": 2}, fsdp=dict(policy=ff.Policy(reshard_after_forward=False))
    ),
    "ddp": dict(model="gpt", mesh={"dp": 2}, fsdp=dict(specs=ff.P())),
    "zero1": dict(  # the ZeRO paper's; ZeRO-2 and the bf16 layouts: tests/test_zero.py
        model="gpt",
        mesh={"dp": 2},
        fsdp=dict(specs=ff.P()),
        step=dict(opt_specs=ff.P("dp"), accumulate_mode="local"),
    ),
    "zero3_bf16": dict(
        model="gpt", mesh={"dp": 2}, fsdp=dict(policy=ff.Policy(mixed_precision=BF16))
    ),
    "zero3_ckpt_prefetch2": dict(
        model="gpt",
        mesh={"dp": 2},
        fsdp=dict(policy=ff.Policy(activation_checkpointing=True, prefetch=2)),
    ),
    "llama_zero3": dict(model="llama", mesh={"dp": 2}),
    "llama_zero2_ckpt": dict(
        model="llama",
        mesh={"dp": 2},
        fsdp=dict(policy=ff.Policy(reshard_after_forward=False, activation_checkpointing=True)),
    ),
}
CASES_4 = {
    "hsdp": dict(model="gpt", mesh={"replicate": 2, "shard": 2}),
    "fsdp_tp": dict(model="gpt_tp", mesh={"dp": 2, "tp": 2}, tp=True),
}
# Context parallelism: a Llama whose attention is ff.cp.attention, each sequence split over
# "cp" (two chunks per rank); its keys and values (and positions, and a padding mask) are
# all-gathered per layer, again in a checkpointed layer's recompute, and their gradients
# reduce-scattered: the planner books those under the source "cp".
CASES_CP_2 = {
    "llama_cp2": dict(model="llama_cp", mesh={"cp": 2}),
    # With a padding mask in the batch (whether transformers hands it to a registered
    # attention is its version's choice; the plan counts what the step issues either way).
    "llama_cp2_padded_ckpt": dict(
        model="llama_cp_padded",
        mesh={"cp": 2},
        fsdp=dict(policy=ff.Policy(activation_checkpointing=True)),
    ),
}
CASES_CP_4 = {
    "llama_dp2_cp2": dict(model="llama_cp", mesh={"dp": 2, "cp": 2}),
    "llama_cp2_tp2": dict(model="llama_cp", mesh={"cp": 2, "tp": 2}, tp=True),
}


def planned(case: dict) -> ff.planner.PlanReport:
    with torch.device("meta"):
        model = W.build(case["model"], case.get("n_layer"))
    kwargs = dict(case.get("fsdp", {}))
    if case.get("tp"):
        kwargs["tp_plan"] = W.tp_plan(case["model"])
    step = case.get("step", {})
    return plan(
        model,
        case["mesh"],
        batch=W.planner_batch(case["model"]),
        optimizer=W.optimizer(),
        opt_specs=step.get("opt_specs"),
        accumulate=step.get("accumulate", 1),
        accumulate_mode=step.get("accumulate_mode", "reduce_each"),
        **kwargs,
    )


def measure_all(cases: dict) -> dict:
    return {name: W.measure(case) for name, case in cases.items()}


def by_source(report: PlanReport, source: str) -> dict:
    """``{(kind, axis): (count, bytes)}`` of a report's collectives from one source."""
    return {(c.kind, c.axis): (c.count, c.bytes) for c in report.comms if c.source == source}


def check(name: str, case: dict, measured: dict) -> None:
    report = planned(case)
    assert report.by_kind_and_axis() == measured["comms"], name
    # The attention's collectives (labelled by it in the step) are those booked as "cp".
    assert by_source(report, "cp") == measured["cp_comms"], name
    assert report.param_bytes == measured["param_bytes"], name
    assert report.grad_bytes == measured["grad_bytes"], name
    assert report.opt_state_bytes == measured["opt_state_bytes"], name
    assert report.gathered_peak_bytes == measured["gathered_peak"], name
    act = report.activation_bytes
    assert abs(act - measured["activation_bytes"]) <= 0.10 * measured["activation_bytes"], (
        name,
        act,
        measured["activation_bytes"],
    )


@pytest.mark.multiprocess
def test_gloo_plan_matches_measured_steps_on_2_ranks(pools):
    results = pools.run(2, measure_all, CASES_2)
    for name, case in CASES_2.items():
        check(name, case, results[0][name])


@pytest.mark.multiprocess
def test_gloo_plan_matches_measured_steps_on_2x2(pools):
    results = pools.run(4, measure_all, CASES_4)
    for name, case in CASES_4.items():
        check(name, case, results[0][name])


@pytest.mark.multiprocess
def test_gloo_plan_matches_measured_context_parallel_steps_on_2_ranks(pools):
    results = pools.run(2, measure_all, CASES_CP_2)
    for name, case in CASES_CP_2.items():
        assert results[0][name]["cp_comms"], name  # the attention did gather over cp
        check(name, case, results[0][name])


@pytest.mark.multiprocess
def test_gloo_plan_matches_measured_context_parallel_steps_on_2x2(pools):
    results = pools.run(4, measure_all, CASES_CP_4)
    for name, case in CASES_CP_4.items():
        assert results[0][name]["cp_comms"], name
        check(name, case, results[0][name])


# Simulated meshes (real numerics, one process) for the rest: ZeRO-2 on dp=4 with
# accumulation, and models of 4 identical blocks, which the planner runs as 2 and 3 blocks and
# extrapolates (ZeRO-1's one reduce-scatter and all-gather of the whole model included).
ZERO = dict(fsdp=dict(specs=ff.P()))
CASES_SIM = {
    "zero2_dp4_accumulate2": {
        **ZERO,
        "model": "gpt",
        "mesh": {"dp": 4},
        "step": dict(opt_specs=ff.P("dp"), accumulate=2),
    },
    "ddp_4_blocks": {**CASES_2["ddp"], "n_layer": 4},
    "zero1_4_blocks": {**CASES_2["zero1"], "n_layer": 4},
    "zero3_ckpt_first_block_4_blocks": dict(
        model="gpt",
        mesh={"dp": 2},
        n_layer=4,
        fsdp=dict(
            policy=ff.Policy(activation_checkpointing=lambda unit: unit == "blocks.0", prefetch=2)
        ),
    ),
    "hsdp_4_blocks": {**CASES_4["hsdp"], "n_layer": 4},
    "fsdp_tp_4_blocks": {**CASES_4["fsdp_tp"], "n_layer": 4},
    "llama_dp2_cp2_ckpt_4_blocks": {
        **CASES_CP_4["llama_dp2_cp2"],
        "n_layer": 4,
        "fsdp": dict(policy=ff.Policy(activation_checkpointing=True)),
    },
}


def test_plan_comms_equal_the_real_step_on_simulated_meshes():
    """The planner's collectives and bytes are ``count_comms`` of the real ``train_step``
    (clipped AdamW: one gradient-norm all-reduce, which the step computes and the clip
    reuses), case by case; for 4 blocks the
    planner's 2- and 3-block runs, extrapolated, equal the 4-block step."""
    for name, case in CASES_SIM.items():
        with ff.simulated_mesh(case["mesh"]) as mesh:
            measured = W.step_comms(case, mesh)
        assert planned(case).by_kind_and_axis() == measured, name


def test_only_blocks_a_step_treats_alike_are_extrapolated():
    from functional_fsdp.fsdp.policy import find_units
    from functional_fsdp.planner import _run

    with torch.device("meta"):
        model = W.build("gpt", 4)
    units = find_units(model, None)
    alike = _run.repeated_blocks(model, units, lambda name: None, lambda unit: False)
    assert alike == ("blocks", 4)
    first_checkpointed = _run.repeated_blocks(
        model, units, lambda name: None, lambda unit: unit == "blocks.0"
    )
    assert first_checkpointed is None  # blocks.0 differs: the whole model runs
    assert _run.repeated_blocks(model, units, lambda n: n.startswith("blocks.1"), bool) is None
    short = _run.shortened(model, "blocks", 2)
    assert len(short.blocks) == 2 and len(model.blocks) == 4  # a copy; the model untouched
    assert (
        short.blocks[1] is not model.blocks[1] and short.blocks[1].attn is not model.blocks[1].attn
    )


# --------------------------------------------------------------------------- pure tests


def llama_70b():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def llama_tp_plan(head_dim: int) -> dict:
    return {
        "model.embed_tokens": ff.VocabParallelEmbedding(),
        "model.layers.*.self_attn.[qkv]_proj": ff.ColwiseParallel(head_dim=head_dim),
        "model.layers.*.self_attn.o_proj": ff.RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ff.ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ff.ColwiseParallel(),
        "model.layers.*.mlp.down_proj": ff.RowwiseParallel(),
        "lm_head": ff.ColwiseParallel(output="replicated"),
    }


def test_70b_llama_plans_in_under_5_seconds_without_allocating():
    model = llama_70b()
    policy = ff.Policy(mixed_precision=BF16, activation_checkpointing=True)
    start = time.process_time()  # CPU time: the machine may be shared
    dp = plan(model, {"dp": 1024}, batch=(1024, 4096), policy=policy)
    dp_s = time.process_time() - start
    start = time.process_time()
    tp = plan(
        model,
        {"dp": 128, "tp": 8},
        batch=(128, 4096),
        policy=policy,
        tp_plan=llama_tp_plan(128),
    )
    tp_s = time.process_time() - start
    assert dp_s < 5 and tp_s < 5, (dp_s, tp_s)
    assert all(p.is_meta for p in model.parameters())
    psi = sum(p.numel() for p in model.parameters())
    assert 70e9 < psi < 71e9
    # fp32 shards over 1024 ranks (plus padding); AdamW keeps two more copies.
    assert psi * 4 / 1024 <= dp.param_bytes < psi * 4 / 1024 * 1.001
    assert dp.opt_state_bytes == 2 * dp.param_bytes
    # ZeRO-3 traffic: 2 bf16 all-gathers and one fp32 reduce-scatter of the model per step.
    assert dp.comm_bytes("all_gather") == pytest.approx(2 * psi * 2, rel=1e-3)
    assert dp.comm_bytes("reduce_scatter") == pytest.approx(psi * 4, rel=1e-3)
    # TP: shards 8x bigger per dp rank but each rank holds 1/8 of each layer; TP all-reduces.
    assert tp.param_bytes == pytest.approx(dp.param_bytes, rel=0.01)
    assert tp.comm_bytes(axis="tp") > 0 and tp.comm_bytes("all_gather", "dp") < dp.comm_bytes(
        "all_gather"
    )
    assert tp.largest_unit_bytes < dp.largest_unit_bytes
    # Checkpointing keeps one residual per block: 80 x [1, 4096, 8192] in bf16 and more.
    assert dp.activation_bytes < dp.activation_bytes_no_checkpoint / 10
    assert dp.activation_bytes > 80 * 4096 * 8192 * 2


def test_plan_never_touches_the_module_and_runs_on_a_real_module():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    before = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in before.items()}
    report = plan(model, {"dp": 2}, batch=(4, 8))
    assert {n: p for n, p in model.named_parameters()} == before
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert report.activation_bytes > 0 and report.param_bytes > 0


def test_frozen_parameters_have_no_gradient_state_or_reduce_scatter():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    full = plan(model, {"dp": 2}, batch=(4, 8))
    frozen = plan(model, {"dp": 2}, batch=(4, 8), trainable=lambda n: n.startswith("blocks.1"))
    assert frozen.grad_bytes < full.grad_bytes and frozen.opt_state_bytes < full.opt_state_bytes
    assert frozen.by_kind_and_axis()[("reduce_scatter", "dp")][0] == 1  # blocks.1 only
    assert frozen.activation_bytes < full.activation_bytes
    assert frozen.trainable < full.trainable == full.params


def test_compare_strategies_side_by_side_and_fits():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=32))
    cmp = compare_strategies(
        model,
        8,
        batch=(16, 32),
        tp_plan=gpt_plan(
            GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=32),
            loss_parallel=False,
        ),
        tp=2,
        hsdp_shard=4,
    )
    names = [r.name for r in cmp.reports]
    assert names == ["ddp", "zero1", "zero2", "shard_grad_op", "zero3", "hsdp", "fsdp+tp"]
    ddp, zero1, zero2, sgo, zero3 = (cmp[n] for n in names[:5])
    assert ddp.param_bytes == zero1.param_bytes == zero2.param_bytes > zero3.param_bytes
    assert sgo.param_bytes == zero3.param_bytes
    assert ddp.grad_bytes == zero1.grad_bytes > zero2.grad_bytes == zero3.grad_bytes
    assert zero1.opt_state_bytes == zero2.opt_state_bytes < ddp.opt_state_bytes
    assert sgo.gathered_peak_bytes > zero3.gathered_peak_bytes
    assert zero3.comm_bytes("all_gather") == 2 * sgo.comm_bytes("all_gather")
    # The paper's ZeRO-1/2 move DDP's bytes (the scalars of the loss and norm aside: the norm
    # of sharded gradients is all-reduced with its count of non-finite tensors, 2 fp32 values
    # in a ring over 8 ranks, 2 * 8 * 7 / 8 = 14 bytes).
    assert abs(zero1.comm_bytes() - ddp.comm_bytes()) <= 14
    assert abs(zero2.comm_bytes() - ddp.comm_bytes()) <= 14
    assert cmp["hsdp"].comm_bytes("all_reduce", "replicate") > 0
    gib = (zero3.peak_bytes + ddp.peak_bytes) / 2 / 1024**3
    assert "zero3" in cmp.fits(gib) and "ddp" not in cmp.fits(gib)
    text = cmp.summary(gib)
    assert "fsdp+tp" in text and "fits" in text
    chart = cmp.text_chart(gib)
    assert chart.count("\n") >= len(names) and "GiB" in chart
    assert "<table" in cmp._repr_html_() or "<pre" in cmp._repr_html_()
    assert [d["name"] for d in cmp.to_dict()] == names


def test_compare_strategies_reproduces_the_zero_paper_table():
    """Rajbhandari et al. 2020, Table 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from functional_fsdp.planner._compare import paper_bytes

    paper = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    assert {s: round(paper_bytes(s, 7_500_000_000, 64) / 1e9, 1) for s in paper} == paper
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=10880,
        num_hidden_layers=36,
        num_attention_heads=32,
        vocab_size=33024,  # Ψ = 7.4997B; every dim 0 divides by 64: no padding
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    bf16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    cmp = compare_strategies(model, 64, mixed_precision=bf16, strategies=(*paper, "hsdp"))
    psi = cmp["ddp"].params
    assert abs(psi - 7.5e9) < 0.01e9
    for name, figure in paper.items():
        # Our layout at rest equals the paper's formula for this model ...
        assert cmp[name].at_rest_bytes == pytest.approx(cmp.paper[name], rel=1e-9), name
        # ... and rounds to the paper's own figure.
        assert round(cmp[name].at_rest_bytes / 1e9, 1) == figure, name
    assert "hsdp" not in cmp.paper
    text = str(cmp)
    assert "vs the ZeRO paper" in text and "31.4" in text and "16.6" in text
    paper_rows = text.split("vs the ZeRO paper")[1].splitlines()
    row = next(line for line in paper_rows if line.lstrip("│ ").startswith("zero2 "))
    assert row.split("│")[-2].strip() == "16.6"  # the paper's column


def test_str_of_plan_and_comparison_is_an_aligned_table():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    report = plan(model, {"dp": 2}, batch=(4, 8), name="zero3")
    cmp = compare_strategies(model, 4, strategies=("ddp", "zero3"))
    for text in (str(report), str(cmp)):
        assert "PlanReport(" not in text and "Comparison(" not in text
        # Each table's header rule spans it, and its rows are as wide as the rule.
        rules = [i for i, line in enumerate(text.splitlines()) if set(line.strip()) == {"─"}]
        assert rules
    lines = str(cmp).splitlines()
    (header,) = [line for line in lines if line.split()[:2] == ["strategy", "mesh"]]
    for name in ("ddp", "zero3"):
        (row,) = [line for line in lines if line.split()[:1] == [name]]
        assert row.index("dp=4") == header.index("mesh")  # columns line up with the header
    assert "gathered peak" in str(report) and "zero3" in str(cmp)


def test_report_renders_as_table_html_and_data():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    report = plan(model, {"dp": 2}, batch=(4, 8), name="zero3")
    text = report.summary()
    for word in ("parameters", "optimizer state", "gathered peak", "activations", "all_gather"):
        assert word in text
    html = report._repr_html_()
    assert "gathered peak" in html
    data = report.to_dict()
    assert data["param_bytes"] == report.param_bytes and data["mesh"] == {"dp": 2}
    assert data["comms"][0]["kind"] in ("all_gather", "all_reduce", "reduce_scatter")


def test_checkpointing_trades_activations_for_recompute():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    plain = plan(model, {"dp": 2}, batch=(4, 16))
    ckpt = plan(model, {"dp": 2}, batch=(4, 16), policy=ff.Policy(activation_checkpointing=True))
    assert ckpt.activation_bytes == plain.activation_bytes_checkpoint < plain.activation_bytes
    assert ckpt.recompute_bytes == max(u.activation_bytes for u in plain.units[1:5])
    assert plain.recompute_bytes == 0


def test_errors_name_the_problem_and_the_fix():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    with pytest.raises(
        ValueError,
        match=r"global batch of shape \(6, 8\) does not split over "
        r"the 4 data-parallel ranks of Mesh\(dp=4\).*multiple of 4",
    ):
        plan(model, {"dp": 4}, batch=(6, 8))
    with pytest.raises(ValueError, match=r"has no tensor-parallel axis 'tp'"):
        plan(model, {"dp": 4}, tp_plan={"head": ff.ColwiseParallel()})
    with pytest.raises(ValueError, match=r"mesh axis 'dp' has size 0"):
        plan(model, {"dp": 0})
    with pytest.raises(TypeError, match=r"takes an nn.Module"):
        plan("gpt", {"dp": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown strategy 'zero4'"):
        compare_strategies(model, 8, strategies=("zero4",))
    with pytest.raises(ValueError, match=r"hsdp_shard=3 does not divide world_size=8"):
        compare_strategies(model, 8, strategies=("hsdp",), hsdp_shard=3)
    with pytest.raises(ValueError, match=r"optimizer='lion'"):
        plan(model, {"dp": 2}, optimizer="lion")  # type: ignore[arg-type]
    sp = gpt_plan(
        GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16),
        sequence_parallel=True,
    )
    with pytest.raises(ValueError, match=r"sequence parallelism.*sequence_parallel=False"):
        plan(model, {"dp": 2, "tp": 2}, batch=(4, 8), tp_plan=sp)
    with pytest.raises(ValueError, match=r"the spec for parameter 'tok_emb.weight'"):
        plan(model, {"dp": 2}, specs=ff.P("fsdp"))


def test_plan_inside_a_process_group_says_where_to_plan():
    # The step whose collectives the plan counts runs on its own shapes-only mesh.
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    with (
        ff.simulated_mesh({"dp": 2}),
        pytest.raises(
            RuntimeError,
            match=r"needs its own \(fake\) process group, but one already exists.*"
            r"python -m functional_fsdp\.planner",
        ),
    ):
        plan(model, {"dp": 2}, batch=(4, 8))


def test_strategies_priced_together_equal_each_priced_alone():
    # compare_strategies shares unit plans, optimizer state and forward traces between its
    # strategies; each report must still be the one its strategy gets on its own.
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    with torch.device("meta"):
        model = GPT(cfg)
    kwargs = dict(
        batch=(8, 16),
        hsdp_shard=2,
        tp=2,
        tp_plan=gpt_plan(cfg, loss_parallel=False),
        mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16),
        checkpoint=lambda unit: unit.endswith("0"),
    )
    together = compare_strategies(model, 4, **kwargs)
    assert len(together.reports) == 7
    for name in ("zero1", "zero3", "hsdp"):  # each shares entries with one priced before it
        (alone,) = compare_strategies(model, 4, strategies=(name,), **kwargs).reports
        assert alone == together[name], name


def test_fewer_bytes_strategies_are_priced_beside_the_exact_ones():
    # Named only: ZeRO++'s three options on {"node", "gpu"} and ZeRO-3 with float8 gathers,
    # each the plan of its documented configuration.
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    kwargs = dict(batch=(8, 16), hsdp_shard=2)
    cmp = compare_strategies(model, 4, strategies=("zero3", "zero++", "zero3+float8"), **kwargs)
    zero_pp = ff.Policy(
        reshard_after_forward="gpu",
        gather_quantization=ff.QuantizedGather(),
        grad_quantization=ff.QuantizedReduce(),
    )
    alone = {
        "zero++": plan(model, {"node": 2, "gpu": 2}, name="zero++", policy=zero_pp, batch=(8, 16)),
        "zero3+float8": plan(
            model,
            {"dp": 4},
            name="zero3+float8",
            policy=ff.Policy(gather_quantization=ff.Float8Gather()),
            batch=(8, 16),
        ),
    }
    for name, report in alone.items():
        assert cmp[name] == report, name

    def by(report: PlanReport, **where: str) -> int:
        return sum(
            c.bytes for c in report.comms if all(getattr(c, k) == v for k, v in where.items())
        )

    exact = by(cmp["zero3"])
    # float8 weights: a quarter of fp32's all-gather bytes (and a small all-reduce of amaxes).
    f8 = cmp["zero3+float8"]
    assert by(f8, kind="all_gather") == by(cmp["zero3"], kind="all_gather") // 4
    assert by(f8, kind="reduce_scatter") == by(cmp["zero3"], kind="reduce_scatter")
    # ZeRO++: int8 between nodes (the forward's gathers and the gradients' second hop, half
    # of the first's), the gradients reduced through all-to-alls.
    pp = cmp["zero++"]
    assert by(pp, kind="reduce_scatter") == 0
    assert by(pp, kind="all_to_all", axis="node") < by(pp, kind="all_to_all", axis="gpu")
    assert by(pp, axis="node") < 0.15 * exact
    assert by(pp) < 0.75 * exact


# --------------------------------------------------------------------------- context parallelism


def _cp_llama(n_layer: int | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        return W.build("llama_cp", n_layer)


def _cp_batch(rows: int, length: int) -> dict:
    ids = torch.zeros(rows, length, dtype=torch.long, device="meta")
    return {"input_ids": ids, "position_ids": ids.clone()}


def test_a_cp_rank_keeps_its_tokens_activations_and_the_gathered_keys_and_values():
    model, cfg = _cp_llama(), W.llama_config()
    rows, length = 2, 64
    act = {
        cp: plan(model, {"cp": cp}, batch=_cp_batch(rows, length)).activation_bytes
        for cp in (1, 2, 4)
    }
    assert act[4] < act[2] < act[1]  # the sequence is split: activations shrink with cp
    for cp in (2, 4):
        # The same local tokens without a split (the batch's rows over "cp" instead):
        # the split keeps more, the keys and values of the whole sequence at least (per
        # layer, for each query head: grouped-query attention repeats them for the kernel).
        local = plan(
            model,
            {"cp": cp},
            batch=_cp_batch(rows * cp, length // cp),
            sequence_axis=None,
        ).activation_bytes
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        gathered = length - length // cp
        kv = 2 * rows * cfg.num_attention_heads * gathered * head_dim * 4  # fp32 K and V
        assert act[cp] - local >= cfg.num_hidden_layers * kv, cp
        assert act[cp] > act[1] / cp


def test_cp_traffic_is_booked_as_cp_and_left_out_without_a_batch():
    model, cfg = _cp_llama(), W.llama_config()
    rows, length, cp = 4, 32, 2
    report = plan(model, {"dp": 2, "cp": cp}, batch=_cp_batch(rows, length), optimizer=None)
    assert report.sequence_axis == "cp" and report.to_dict()["sequence_axis"] == "cp"
    attention = by_source(report, "cp")
    # Per layer: keys and values all-gathered (and positions), their gradients reduce-scattered.
    local = (rows // 2) * cfg.num_key_value_heads * (length // cp) * 8 * 4  # one K, fp32
    layers = cfg.num_hidden_layers
    assert attention[("reduce_scatter", "cp")] == (2 * layers, 2 * layers * local * (cp - 1))
    assert attention[("all_gather", "cp")][0] == 3 * layers
    assert all(c.axis == "cp" for c in report.comms if c.source == "cp")
    assert {c.source for c in report.comms if c.axis == "cp"} >= {"fsdp", "cp"}
    text = " ".join(report.summary().split())  # the table wraps its title and caption
    assert "cp splits each sequence" in text and "source cp: context-parallel" in text
    assert any(c["source"] == "cp" for c in report.to_dict()["comms"])
    no_batch = plan(model, {"dp": 2, "cp": cp}, optimizer=None)
    assert not by_source(no_batch, "cp") and no_batch.activation_bytes is None


def test_cp_errors_name_the_sequence_and_the_fix():
    model = _cp_llama()
    with pytest.raises(
        ValueError,
        match=r"batch\['input_ids'\] of shape \(4, 30\) has a sequence of 30 tokens.*"
        r"2·cp = 4 equal chunks over the 'cp' axis of Mesh\(dp=2, cp=2\).*sequences of 32 "
        r"tokens.*ff\.cp\.pad_sequence\(batch, 4\)",
    ):
        plan(model, {"dp": 2, "cp": 2}, batch=_cp_batch(4, 30))
    with pytest.raises(
        ValueError,
        match=r"does not split over the 2 data-parallel ranks of Mesh\(dp=2, cp=2\) "
        r"\(data axes \('dp', 'cp'\); 'cp' splits the sequence\); use a batch size that is a "
        r"multiple of 2",
    ):
        plan(model, {"dp": 2, "cp": 2}, batch=_cp_batch(3, 32))
    with pytest.raises(ValueError, match=r"ff\.plan\(sequence_axis='tp'\).*data axes"):
        plan(model, {"dp": 2, "tp": 2}, sequence_axis="tp")
    with pytest.raises(ValueError, match=r"tp=3 does not divide world_size/cp=8/2=4"):
        compare_strategies(
            model, 8, cp=2, tp=3, tp_plan=W.tp_plan("llama_cp"), strategies=("fsdp+tp",)
        )
    with pytest.raises(ValueError, match=r"hsdp_shard=8 does not divide world_size/cp=8/2=4"):
        compare_strategies(model, 8, cp=2, strategies=("hsdp",))
    with pytest.raises(ValueError, match=r"cp=3 does not divide world_size=8"):
        compare_strategies(model, 8, cp=3)


def test_compare_strategies_on_a_cp_mesh_equals_each_plan():
    model = _cp_llama()
    batch = _cp_batch(4, 32)
    cmp = compare_strategies(
        model,
        8,
        cp=2,
        batch=batch,
        tp=2,
        hsdp_shard=2,
        tp_plan=W.tp_plan("llama_cp"),
        strategies=("zero2", "zero3", "hsdp", "fsdp+tp"),
    )
    meshes = [r.mesh for r in cmp.reports]
    assert meshes == [
        {"dp": 4, "cp": 2},
        {"dp": 4, "cp": 2},
        {"replicate": 2, "shard": 2, "cp": 2},
        {"dp": 2, "cp": 2, "tp": 2},
    ]
    for r in cmp.reports:
        assert by_source(r, "cp"), r.name
    zero3 = plan(model, {"dp": 4, "cp": 2}, batch=batch, name="zero3")
    assert cmp["zero3"] == zero3
    zero2 = plan(model, {"dp": 4, "cp": 2}, batch=batch, specs=ff.P(), opt_specs=ff.P(("dp", "cp")))
    assert cmp["zero2"].opt_state_bytes == zero2.opt_state_bytes < cmp["zero3"].param_bytes * 3
    assert "cp=2" in str(cmp)


def test_plot_comms_shows_the_attentions_collectives_as_their_own_layer():
    pytest.importorskip("matplotlib")
    case = CASES_CP_4["llama_dp2_cp2"]
    with ff.simulated_mesh(case["mesh"]) as mesh:
        _, step, state = W._setup(case, mesh)
        with ff.count_comms() as comms:
            step(state, W._batch(case["model"]))
    report = dataclasses.replace(planned(case), name="dp2_cp2")
    ax = ff.plot_comms(report, measured={"dp2_cp2": comms})
    heights = {c.get_label(): sum(p.get_height() for p in c.patches) for c in ax.containers}
    attention = by_source(report, "cp")
    assert attention and set(attention) == {("all_gather", "cp"), ("reduce_scatter", "cp")}
    for (kind, axis), (_, nbytes) in attention.items():
        label = f"{kind} over {axis} (attention)"
        # The planned layer and the measured one (its records' label) are the same bytes.
        assert heights[label] == pytest.approx(heights[f"_measured {label}"])
        assert heights[label] * 1024 == pytest.approx(nbytes)  # drawn in KiB
    fsdp = sum(c.bytes for c in report.comms if c.axis == "cp" and c.kind == "all_gather")
    assert heights["all_gather over cp"] * 1024 == pytest.approx(
        fsdp - attention[("all_gather", "cp")][1]
    )
