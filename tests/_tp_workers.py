"""Tensor-parallel test helpers, shared by simulated tests and real gloo workers.

Every function here runs on a simulated mesh and on real processes alike: per-rank data comes
from ``per_coordinate``, which builds one value per rank on a simulated mesh and this rank's
value on a real one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss
from functional_fsdp.tp.ops import vocab_parallel_cross_entropy
from functional_fsdp.tp.plan import tensor_parallel
from functional_fsdp.train import local_batch

from ._fsdp_workers import reference

CFG = GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16)
BATCH, SEQ = 8, 12


def gpt_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    return idx, torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)


def build(model, mesh, *, sequence_parallel=False, loss_parallel=True, policy=None):
    """ff.fsdp over a GPT with the GPT TP plan, and the loss function that goes with it."""
    tp = tensor_parallel(
        model, mesh, gpt_plan(CFG, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    )
    f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers, policy=policy)

    def loss_fn(params, x, y):
        logits = f.apply(params, x)
        if loss_parallel:
            return vocab_parallel_cross_entropy(logits, y, mesh)
        return lm_loss(logits, y)

    return f, loss_fn


def new_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def ours(model, mesh, options: dict, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, Any]:
    """Loss (mean over data ranks) and gathered grads of FSDP+TP on ``mesh``.

    On a simulated mesh, make ``model`` and the batch outside it: values made inside one are
    per-rank values.
    """
    f, loss_fn = build(model, mesh, **options)
    params = f.shard()
    x, y = local_batch((idx, tgt), mesh, f.data_axes)
    with ff.count_comms() as comms:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
    return {
        "loss": ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean"),
        "grads": ff.gather(grads),
        "specs": {k: v.spec for k, v in params.items()},
        "comms": comms.by_kind_and_axis(),
    }


def gloo_vs_reference(axes: dict, options: dict) -> dict[str, Any]:
    """On real processes: :func:`ours` against the single-process reference, as numbers."""
    model = new_model()
    idx, tgt = gpt_batch()
    ref_loss, ref_grads = reference(model, idx, tgt)
    out = ours(model, ff.make_mesh(axes), options, idx, tgt)
    return {
        "loss_diff": abs(out["loss"].item() - ref_loss.item()),
        "grad_err": max((out["grads"][k] - ref_grads[k]).abs().max().item() for k in ref_grads),
        "specs": out["specs"],
        "comms": out["comms"],
    }


# --------------------------------------------------------------------------- torch FSDP2 + TP


def torch_fsdp2_tp(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """A copy of ``model`` with torch's ``parallelize_module`` (the same plan) and FSDP2 on dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref = copy.deepcopy(model)
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(ref.blocks)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.fc2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    parallelize_module(ref, mesh["tp"], plan)
    ref.head.weight = ref.tok_emb.weight  # parallelize_module unties them; both are Shard(0)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(ref, mesh=mesh["dp"])
    return ref


def torch_loss(ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        logits = ref(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
    return loss


def gloo_vs_torch() -> dict[str, Any]:
    """FSDP+TP vs torch FSDP2 + parallelize_module on a (dp, tp) mesh, same model and batch."""
    model = new_model()
    idx, tgt = gpt_batch()
    mesh = ff.make_mesh({"dp": dist.get_world_size() // 2, "tp": 2})
    ref = torch_fsdp2_tp(model, mesh)
    x, y = local_batch(idx, mesh, ("dp",)), local_batch(tgt, mesh, ("dp",))
    torch_loss_value = torch_loss(ref, x, y).full_tensor()
    theirs = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
    f, loss_fn = build(model, mesh)
    grads, loss = torch.func.grad_and_value(loss_fn)(f.shard(), x, y)
    full = ff.gather(grads)
    # The global norm clipping uses, from the 2D shards: each rank holds a (dp, tp) piece.
    their_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in theirs.values()]))
    return {
        "loss_diff": abs(loss.item() - torch_loss_value.item()),
        "grad_err": max((full[k] - theirs[k]).abs().max().item() for k in theirs),
        "norm_err": abs(ff.global_norm(grads).item() - their_norm.item()) / their_norm.item(),
    }


# --------------------------------------------------------------------------- training


LR, WD, CLIP = 1e-2, 0.1, 0.5


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [gpt_batch(seed=step) for step in range(steps)]


def train_reference(model, data) -> dict[str, Any]:
    """One process, torch.optim.AdamW and ``clip_grad_norm_``, on a copy of ``model``."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, eps=1e-6)
    losses, norms = [], []
    for idx, tgt in data:
        loss = lm_loss(ref(idx), tgt)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach() for n, p in ref.named_parameters()},
    }


def train_ours(model, mesh, data, **options: Any) -> dict[str, Any]:
    """The same steps with FSDP+TP, ``ff.adamw`` and ``ff.clip_by_global_norm``."""
    f, loss_fn = build(model, mesh, **options)
    params = f.shard()
    opt = ff.chain(ff.clip_by_global_norm(CLIP, eps=1e-6), ff.adamw(LR, weight_decay=WD, eps=1e-6))
    state = opt.init(params)
    losses, norms = [], []
    slices = [
        (local_batch(idx, mesh, f.data_axes), local_batch(tgt, mesh, f.data_axes))
        for idx, tgt in data
    ]
    for x, y in slices:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        norms.append(ff.global_norm(grads))
        updates, state = opt.update(grads, state, params)
        params = ff.apply_updates(params, updates)
        losses.append(ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean"))
    return {"losses": losses, "norms": norms, "params": ff.gather(params)}


def param_err(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest parameter difference, leaving out the attention key biases.

    A key bias adds the same amount to every logit of a query's softmax, so its true
    gradient is zero and both sides see rounding noise, which Adam scales up to a full step.
    """
    return max(
        (ours[k] - v).abs().max().item() for k, v in ref.items() if not k.endswith("wk.bias")
    )


def gloo_train(axes: dict, steps: int = 10, **options: Any) -> dict[str, Any]:
    """On real processes: :func:`train_ours` against :func:`train_reference`, as numbers."""
    model, data = new_model(), batches(steps)
    ref = train_reference(model, data)
    out = train_ours(model, ff.make_mesh(axes), data, **options)
    return {
        "loss_err": max(abs(a.item() - b) for a, b in zip(out["losses"], ref["losses"])),
        "norm_err": max(abs(a.item() - b) for a, b in zip(out["norms"], ref["norms"])),
        "param_err": param_err(out["params"], ref["params"]),
        "clipped": sum(n > CLIP for n in ref["norms"]),
        "losses": ref["losses"],
    }
