"""``ff.master_weights`` keeps mixed precision's promise: bf16 parameters with fp32 masters
step exactly as fp32 parameters computing in the same bf16 policy (FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)``), on 2 gloo ranks.

Gradients reduced in fp32 reach the masters in fp32, and micro-batches are summed in fp32,
as Megatron's main gradients are: the gradients the optimizer gets and the masters after
one or two AdamW steps are bitwise the reference's, at accumulate 1, 2 and 16, reduced in fp32 and
in bf16, for FSDP (a transformers Llama), ZeRO-1/2, local accumulation and ``ff.jit``.
"""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff

from . import _masters_workers as W

FP32, BF16 = torch.float32, torch.bfloat16


def check(results: dict) -> None:
    for case, r in results.items():
        assert r["values_equal"] and r["rounded"], (case, r)
        if "grads_equal" in r:
            assert r["grads_equal"], (case, r)


@pytest.mark.multiprocess
def test_llama_fsdp_with_masters_is_bitwise_fp32_params_computing_in_bf16(pools):
    # Two steps (the second from the updated masters), one at accumulate=16 (CI's time).
    cases = [
        ("llama", "fsdp", k, rd, 1 if k == 16 else 2) for rd in (FP32, BF16) for k in (1, 2, 16)
    ]
    results = pools.run(2, W.compare_many, cases)[0]
    check(results)
    # Reduced in fp32, the gradients reach the masters in fp32; reduced in bf16, rounding to
    # bf16 loses nothing, so one micro-batch's stay bf16 (half the bytes) and a sum of
    # several is fp32.
    for (_, _, k, rd, _), r in results.items():
        wide = rd == FP32 or k > 1
        assert r["grad_dtypes"] == [str(FP32 if wide else BF16)], (k, rd, r)


@pytest.mark.multiprocess
def test_ddp_zero_local_accumulation_and_jit_with_masters_are_bitwise_the_reference(pools):
    cases = [
        ("gpt", "ddp", 2, FP32),
        ("gpt", "zero2", 16, FP32, 1),
        ("gpt", "zero1", 1, FP32),
        ("gpt", "zero1", 16, BF16, 1),
        ("gpt", "fsdp_local", 2, FP32),
        ("gpt", "fsdp", 2, FP32, 2, True),  # ff.jit
    ]
    results = pools.run(2, W.compare_many, cases)[0]
    check(results)
    # ZeRO-1 holds one micro-batch's full gradients in bf16 and reduces them onto the fp32
    # masters: the optimizer gets fp32 shards.
    assert results[("gpt", "zero1", 1, FP32)]["grad_dtypes"] == ["torch.float32"]


def test_masters_that_the_policy_cannot_gather_as_the_parameters_raise():
    """bf16 module, no param_dtype: FSDP would gather fp32 masters in fp32, so the step
    cannot differentiate them, and fp32 reductions would be rounded to bf16: refused."""
    module = torch.nn.Linear(4, 2).to(BF16)
    opt = ff.master_weights(ff.sgd(0.1), param_dtype=BF16)
    with ff.simulated_mesh({"dp": 2}) as mesh:
        policy = ff.Policy(mixed_precision=ff.MixedPrecision(reduce_dtype=FP32))
        f = ff.fsdp(module, mesh, policy=policy)
        state = ff.TrainState.create(f.shard(), opt)
        step = ff.train_step(lambda p, b: f.apply(p, b).float().pow(2).mean(), opt, model=f)
        with pytest.raises(ValueError, match=r"reach the masters\s+rounded to torch.bfloat16"):
            step(state, torch.ones(4, 4, dtype=BF16))
        # Reduced in bf16, nothing is lost by rounding: the same setup trains.
        policy = ff.Policy(mixed_precision=ff.MixedPrecision(reduce_dtype=BF16))
        f = ff.fsdp(module, mesh, policy=policy)
        step = ff.train_step(lambda p, b: f.apply(p, b).float().pow(2).mean(), opt, model=f)
        state, _ = step(ff.TrainState.create(f.shard(), opt), torch.ones(4, 4, dtype=BF16))
        assert state.step == 1


def test_without_a_model_micro_batches_are_summed_in_the_masters_dtype():
    """No mesh: the loss function computes in bf16; its micro-batch gradients are summed in
    fp32, as one fp32 parameter cast to bf16 inside the loss sums them."""
    x = torch.linspace(-1, 1, 64).reshape(16, 4) * 3.3
    w = torch.tensor([0.3, -1.7, 2.1, 0.9])

    def loss_fn(p: dict, b: torch.Tensor) -> torch.Tensor:
        return (b.to(BF16) @ p["w"].to(BF16)).float().sum()

    def grads(opt: ff.GradientTransformation) -> torch.Tensor:
        seen = []

        def update(g, s, p=None, **kw):
            seen.append(g["w"])
            return opt.update(g, s, p, **kw)

        spied = ff.GradientTransformationExtraArgs(opt.init, update)
        step = ff.train_step(loss_fn, spied, batch="local", accumulate=16)
        step(ff.TrainState.create({"w": w}, opt), x)
        return seen[0]

    got = grads(ff.master_weights(ff.sgd(0.1), param_dtype=BF16))
    ref = grads(ff.sgd(0.1))
    assert got.dtype == FP32 and torch.equal(got, ref)
