"""Worker functions for the master-weights tests: bf16 parameters with fp32 masters against
fp32 parameters computing in the same bf16 policy, on real gloo ranks.

The reference is what FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` does: fp32 shards,
cast to bf16 for the all-gather, gradients reduced in ``reduce_dtype`` and arriving in fp32,
micro-batches summed in fp32. ``ff.master_weights`` keeps the parameters in bf16 and fp32
masters with the optimizer; its gradients and masters must be those of the reference.
"""

from __future__ import annotations

from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

from ._hf import tiny_llama_config

BATCH, SEQ = 32, 9  # 16 examples per rank: accumulate=16 gives one example per micro-batch
LR = 1e-2

# name: (ff.fsdp kwargs, TrainState.create kwargs, train_step kwargs)
STRATEGIES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "fsdp": ({}, {}, {}),
    "ddp": (dict(specs=ff.P()), {}, {}),
    "fsdp_local": ({}, {}, dict(accumulate_mode="local")),
    "zero2": (dict(specs=ff.P()), dict(opt_specs=ff.P("dp")), {}),
    "zero1": (dict(specs=ff.P()), dict(opt_specs=ff.P("dp")), dict(accumulate_mode="local")),
}


def _module(name: str) -> tuple[torch.nn.Module, Any]:
    """An fp32 module (seeded) and ``apply_logits(f, params, tokens)``."""
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaForCausalLM

        config = tiny_llama_config(vocab_size=64)
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config), lambda f, p, x: f.apply(p, input_ids=x).logits
    return GPT(GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16)), (
        lambda f, p, x: f.apply(p, x)
    )


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (BATCH, SEQ), generator=g) for _ in range(steps)]


def run(
    model: str,
    strategy: str,
    accumulate: int,
    reduce_dtype: torch.dtype,
    masters: bool,
    steps: int = 2,
    jit: bool = False,
) -> dict[str, Any]:
    """``steps`` AdamW steps: the gradients the optimizer got each step (gathered, as given),
    the full fp32 values at the end (the masters, or the fp32 parameters) and the full
    parameters."""
    fsdp_kwargs, create_kwargs, step_kwargs = STRATEGIES[strategy]
    module, logits = _module(model)
    bf16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    f = ff.fsdp(
        module, ff.make_mesh({"dp": 2}), policy=ff.Policy(mixed_precision=bf16), **fsdp_kwargs
    )
    inner = ff.adamw(LR, weight_decay=0.1, eps=1e-6)
    opt = ff.master_weights(inner, param_dtype=torch.bfloat16) if masters else inner
    state = ff.TrainState.create(f.shard(), opt, **create_kwargs)
    grads: list[dict[str, torch.Tensor]] = []

    def spied(update: Any) -> Any:
        def spy(g: Any, s: Any, p: Any = None, **kw: Any) -> Any:
            if not jit:  # a traced step has no values to keep
                grads.append({k: v.clone() for k, v in ff.gather(dict(g)).items()})
            return update(g, s, p, **kw)

        return spy

    spy_opt = ff.GradientTransformationExtraArgs(opt.init, spied(opt.update))

    def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits(f, p, b[:, :-1]), b[:, 1:])

    step = ff.train_step(loss_fn, spy_opt, model=f, accumulate=accumulate, **step_kwargs)
    if jit:
        step = ff.jit(step, backend="eager")
    for b in batches(steps):
        state, _ = step(state, b)
    has_masters = isinstance(state.opt_state, ff.MasterWeightsState)
    values = ff.gather(dict(state.opt_state.master if has_masters else state.params))
    return {
        "grads": grads,
        "values": {k: v.float() for k, v in values.items()},
        "params": ff.gather(dict(state.params)),
    }


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, max abs difference / max abs of the reference)."""
    a, b = a.double(), b.double()
    d = (a - b).abs().max().item()
    scale = b.abs().max().item()
    return d, d / scale if scale else d


def compare(
    model: str,
    strategy: str,
    accumulate: int,
    reduce_dtype: torch.dtype,
    steps: int = 2,
    jit: bool = False,
) -> dict[str, Any]:
    """master_weights against fp32 parameters computing in bf16: the largest gradient and
    master differences (absolute, relative to the largest reference value), whether each
    is bitwise equal, the dtypes the optimizer got, and whether the bf16 parameters are
    the masters rounded."""
    got = run(model, strategy, accumulate, reduce_dtype, True, steps, jit)
    ref = run(model, strategy, accumulate, reduce_dtype, False, steps, jit)
    out: dict[str, Any] = {
        "grad_dtypes": sorted({str(v.dtype) for g in got["grads"] for v in g.values()})
    }
    if not jit:
        pairs = [(g[k], r[k]) for g, r in zip(got["grads"], ref["grads"]) for k in r]
        out["grad_abs"] = max(_diff(a, b)[0] for a, b in pairs)
        out["grad_rel"] = max(_diff(a, b)[1] for a, b in pairs)
        out["grads_equal"] = all(torch.equal(a.float(), b) for a, b in pairs)
    keys = ref["values"]
    out["value_abs"] = max(_diff(got["values"][k], ref["values"][k])[0] for k in keys)
    out["value_rel"] = max(_diff(got["values"][k], ref["values"][k])[1] for k in keys)
    out["values_equal"] = all(torch.equal(got["values"][k], ref["values"][k]) for k in keys)
    out["rounded"] = all(
        torch.equal(got["params"][k], got["values"][k].to(torch.bfloat16)) for k in keys
    )
    return out


def compare_many(cases: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {case: compare(*case) for case in cases}
