"""Workers and models for the tensor-parallel plan checks (tests/test_tp_verify.py)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import functional_fsdp as ff

VOCAB, DIM, HEADS = 64, 32, 4


class TinyAttention(nn.Module):
    """q/k/v in an ``nn.ModuleDict``; reshapes with the global head count, as written for one
    process (``-1`` for the head size, or ``self.d_head``)."""

    def __init__(self, explicit_head_dim: bool) -> None:
        super().__init__()
        self.n_heads, self.d_head = HEADS, DIM // HEADS
        self.explicit = explicit_head_dim
        self.qkv = nn.ModuleDict({n: nn.Linear(DIM, DIM, bias=False) for n in "qkv"})
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        size = self.d_head if self.explicit else -1
        q, k, v = (self.qkv[n](x).view(b, t, self.n_heads, size).transpose(1, 2) for n in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TinyBlock(nn.Module):
    def __init__(self, explicit_head_dim: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = TinyAttention(explicit_head_dim), TinyMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, explicit_head_dim: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TinyBlock(explicit_head_dim) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_lm(explicit_head_dim: bool = False, layers: int = 2) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(explicit_head_dim, layers)


def tiny_plan(per_rank: bool = False, **overrides: Any) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "layers.*.attn.qkv.*": ff.ColwiseParallel(),
        "layers.*.attn.o": ff.RowwiseParallel(),
        "layers.*.mlp.up": ff.ColwiseParallel(),
        "layers.*.mlp.down": ff.RowwiseParallel(),
        "head": ff.ColwiseParallel(padded=True),
    }
    if per_rank:
        plan["layers.*.attn"] = ff.LocalAttributes(per_rank=("n_heads",))
    plan.update(overrides)
    return plan


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (4, 8), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def loss_of(
    model: nn.Module, mesh: Any, plan: dict[str, Any], data: Any, **options: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """The first step's gradients and loss under ``plan`` on ``mesh``; ``data``: the global
    batch (made outside a simulated mesh, where random numbers differ per rank)."""
    tp = ff.tensor_parallel(model, mesh, plan, **options)
    f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    idx, tgt = data
    local = ff.local_batch((idx, tgt), mesh, f.data_axes)

    def loss_fn(p: dict[str, Any]) -> torch.Tensor:
        return ff.vocab_parallel_cross_entropy(f.apply(p, local[0]), local[1], mesh)

    grads, loss = torch.func.grad_and_value(loss_fn)(f.shard())
    return grads, ff.all_reduce(loss, mesh, f.data_axes, op="mean")  # the global batch's


def reference_loss(model: nn.Module, data: Any) -> float:
    idx, tgt = data
    with torch.no_grad():
        return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).item()


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def gloo_plan_checks(tp_size: int = 2) -> dict[str, Any]:
    """On real processes: the global head count (``-1`` and ``d_head`` forms) and a wrong
    style raise at the first call; the per-rank fix trains the one-process loss."""
    mesh = ff.make_mesh({"dp": dist.get_world_size() // tp_size, "tp": tp_size})
    data = batch()
    out: dict[str, Any] = {}
    for explicit in (False, True):
        model = tiny_lm(explicit)
        out[f"heads_{explicit}"] = _error(lambda: loss_of(model, mesh, tiny_plan(), data))
    model = tiny_lm()
    swapped = tiny_plan(
        per_rank=True,
        **{"layers.*.mlp.up": ff.RowwiseParallel(), "layers.*.mlp.down": ff.ColwiseParallel()},
    )
    out["style"] = _error(lambda: loss_of(model, mesh, swapped, data))
    tp_seconds = time.perf_counter()
    _, loss = loss_of(model, mesh, tiny_plan(per_rank=True), data)
    out["seconds"] = time.perf_counter() - tp_seconds  # the first call, checked
    out["loss"] = loss.item()
    out["reference"] = reference_loss(model, data)
    unchecked = loss_of(tiny_lm(), mesh, tiny_plan(), data, verify=False)[1]
    out["unchecked_loss"] = unchecked.item()  # what a wrong plan trains on without the check
    return out
