"""Tensor-parallel plans on Hugging Face layers: helpers shared by simulated tests and gloo workers.

Models are built from configs (never downloaded). Every function here runs on a simulated
mesh and on real processes alike; the ``gloo_*`` ones return plain numbers to the test.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import functional_fsdp as ff
from functional_fsdp.grad_engine import autograd_grad_and_value
from functional_fsdp.models import llama_plan, lm_loss
from functional_fsdp.tp.ops import vocab_parallel_cross_entropy
from functional_fsdp.tp.plan import tensor_parallel
from functional_fsdp.tp.styles import ColwiseParallel, PrepareInput, RowwiseParallel, Style
from functional_fsdp.train import local_batch

VOCAB, BATCH, SEQ, PAD = 64, 4, 8, 3


def llama_config(**overrides: Any):
    """A tiny Llama with grouped-query attention (2 key/value heads for 4 query heads)."""
    from transformers import LlamaConfig

    options: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    options.update(overrides)
    return LlamaConfig(**options)


def new_llama(**overrides: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(**overrides))


def with_lora(model: nn.Module, **overrides: Any) -> nn.Module:
    """A peft LoRA model around ``model`` (a copy), with non-zero ``lora_B`` so every LoRA
    factor gets a gradient."""
    from peft import LoraConfig, get_peft_model

    options: dict[str, Any] = dict(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    )
    options.update(overrides)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(**options))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return peft_model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    idx[:, 0] = PAD  # every sequence starts with the padding id (its row gets no gradient)
    return idx, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def grad_and_value(fn: Any, wrt: Any, engine: str = "func") -> tuple[Any, torch.Tensor]:
    """``torch.func.grad_and_value(fn)(wrt)``, or (``engine="autograd"``) the same computed
    with plain autograd, for model code ``torch.func`` cannot differentiate (Bloom)."""
    if engine == "autograd":
        return autograd_grad_and_value(lambda t, _: fn(t), wrt, None)
    return torch.func.grad_and_value(fn)(wrt)


def reference(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor, engine: str = "func"):
    """Loss and gradients of the trainable parameters on one process, the whole batch."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = trainable(model)
    frozen = {n: v for n, v in params.items() if n not in names}

    def loss_fn(t: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, {**t, **frozen}, (idx,))
        return lm_loss(logits_of(out), tgt)

    grads, loss = grad_and_value(loss_fn, {n: params[n] for n in names}, engine)
    return loss, grads


def ours(
    model: nn.Module,
    mesh,
    plan: dict[str, Style],
    idx: torch.Tensor,
    tgt: torch.Tensor,
    *,
    loss_parallel: bool = True,
    verify: bool = True,
    engine: str = "func",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FSDP+TP: the loss (mean over data ranks) and the gathered gradients of the trainable
    parameters; frozen shards are not differentiated."""
    tp = tensor_parallel(model, mesh, plan, verify=verify)
    f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    params = f.shard()
    names = trainable(model)
    frozen = {n: v for n, v in params.items() if n not in names}
    x, y = local_batch((idx, tgt), mesh, f.data_axes)

    def loss_fn(t: dict[str, Any]) -> torch.Tensor:
        logits = logits_of(f.apply({**t, **frozen}, x))
        if loss_parallel:
            return vocab_parallel_cross_entropy(logits, y, mesh)
        return lm_loss(logits, y)

    grads, loss = grad_and_value(loss_fn, {n: params[n] for n in names}, engine)
    return ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean"), ff.gather(grads)


def errors(
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> dict[str, Any]:
    """Largest loss and gradient differences over every (simulated) rank.

    A gradient's error is relative to its largest entry where that exceeds 1 (float32
    rounding grows with magnitude: bias gradients here reach ~20), absolute otherwise.
    """
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))

    def err(k: str, v: torch.Tensor) -> float:
        scale = max(1.0, ref_grads[k].abs().max().item())
        return (v - ref_grads[k]).abs().max().item() / scale

    return {
        "loss_diff": max(abs(v.item() - ref_loss.item()) for v in ff.rank_values(loss)),
        "grad_err": max(err(k, v) for k in grads for v in ff.rank_values(grads[k])),
        "grads": len(grads),
        "grad_norm": sum(g.square().sum() for g in ref_grads.values()).sqrt().item(),
    }


# --------------------------------------------------------------------------- a fixed head count


class FixedHeadsAttention(nn.Module):
    """Attention that reshapes with its global head count, like many hand-written models."""

    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.wo(y.reshape(b, t, self.n_heads * self.head_dim))


class FixedHeadsLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.attn = FixedHeadsAttention()
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return self.head(x + self.attn(x))


def fixed_heads_plan(per_rank: bool) -> dict[str, Style]:
    return {
        "attn": PrepareInput(per_rank=("n_heads",) if per_rank else ()),
        "attn.w[qkv]": ColwiseParallel(input="prepared", head_dim=8),
        "attn.wo": RowwiseParallel(),
    }


def new_fixed_heads() -> FixedHeadsLM:
    torch.manual_seed(0)
    return FixedHeadsLM()


# --------------------------------------------------------------------------- torch FSDP2 + TP


def torch_fsdp2_tp(model: nn.Module, mesh) -> nn.Module:
    """A copy of the Llama with torch's ``parallelize_module`` (Colwise/RowwiseParallel, the
    same layout) and FSDP2 over dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref = copy.deepcopy(model)
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(ref.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(ref, mesh["tp"], plan)
    for layer in ref.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(ref, mesh=mesh["dp"])
    return ref


# --------------------------------------------------------------------------- gloo workers


LLAMA_CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {}),  # loss-parallel logits
    ({}, {"loss_parallel": False}),
    ({}, {"sequence_parallel": True}),
    (
        {
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
            "pad_token_id": PAD,
        },
        {},
    ),
]


def gloo_llama_vs_reference() -> list[dict[str, Any]]:
    """The Llama plan on a real 2x2 (dp, tp) mesh against one process, for each case."""
    mesh = ff.make_mesh({"dp": dist.get_world_size() // 2, "tp": 2})
    idx, tgt = batch()
    out = []
    for model_options, plan_options in LLAMA_CASES:
        model = new_llama(**model_options)
        plan = llama_plan(model.config, **plan_options)
        lp = plan_options.get("loss_parallel", True)
        got = ours(model, mesh, plan, idx, tgt, loss_parallel=lp)
        out.append(errors(got, reference(model, idx, tgt)))
    return out


def gloo_llama_vs_torch() -> dict[str, Any]:
    """The Llama plan vs torch FSDP2 + parallelize_module, same model, mesh and batch."""
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = ff.make_mesh({"dp": dist.get_world_size() // 2, "tp": 2})
    model = new_llama()
    idx, tgt = batch()
    theirs_model = torch_fsdp2_tp(model, mesh)
    x, y = local_batch((idx, tgt), mesh, ("dp",))
    with loss_parallel():
        logits = theirs_model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        loss.backward()
    theirs_loss = ff.all_reduce(loss.full_tensor().detach(), mesh, ("dp",), op="mean")
    theirs = {n: p.grad.full_tensor() for n, p in theirs_model.named_parameters()}
    got = ours(model, mesh, llama_plan(model.config), idx, tgt)
    return errors(got, (theirs_loss, theirs))


def gloo_lora_vs_reference() -> dict[str, Any]:
    """A peft LoRA Llama (frozen base, LoRA on colwise and rowwise layers) against one process."""
    mesh = ff.make_mesh({"dp": dist.get_world_size() // 2, "tp": 2})
    model = with_lora(new_llama(attention_bias=True, mlp_bias=True))
    idx, tgt = batch()
    plan = llama_plan(model.config, prefix="base_model.model.")
    return errors(ours(model, mesh, plan, idx, tgt), reference(model, idx, tgt))


def gloo_fixed_heads() -> dict[str, Any]:
    """A fixed-head-count model: the hint without per-rank attributes, the right numbers with."""
    mesh = ff.make_mesh({"dp": dist.get_world_size() // 2, "tp": 2})
    model = new_fixed_heads()
    idx, tgt = batch()
    hints = []
    for verify in (True, False):  # the plan check at the first call; the reshape hint
        try:
            plan = fixed_heads_plan(per_rank=False)
            ours(model, mesh, plan, idx, tgt, loss_parallel=False, verify=verify)
            hints.append(None)
        except ValueError as e:
            hints.append(str(e))
    check, hint = hints
    got = ours(model, mesh, fixed_heads_plan(per_rank=True), idx, tgt, loss_parallel=False)
    return {
        "check": check,
        "hint": hint,
        "n_heads_after": model.attn.n_heads,
        **errors(got, reference(model, idx, tgt)),
    }
