"""Worker functions for the real multi-process FSDP tests (imported by the gloo workers)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=2, vocab_size=61, n_embd=36, n_head=3, block_size=16)
BATCH = 8


def gpt_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, 12), generator=g)
    return idx, torch.randint(0, CFG.vocab_size, (BATCH, 12), generator=g)


def reference(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor):
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads, loss = torch.func.grad_and_value(
        lambda p: lm_loss(torch.func.functional_call(model, p, (idx,)), tgt)
    )(params)
    return loss, grads


def local_slice(t: torch.Tensor, mesh, data_axes) -> torch.Tensor:
    """This rank's share of the global batch over the data axes (row-major rank order)."""
    n, index = 1, 0
    for a in data_axes:
        size = ff.axis_size(mesh, a)
        index = index * size + mesh.get_local_rank(a)
        n *= size
    per = t.shape[0] // n
    return t[index * per : (index + 1) * per]


def fsdp_vs_reference(axes: dict, policy_kwargs: dict, use_func: bool = True):
    """Loss and gathered grads of ff.fsdp vs the single-process reference; also the live memory."""
    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch()
    ref_loss, ref_grads = reference(model, idx, tgt)
    mesh = ff.make_mesh(axes)
    f = ff.fsdp(model, mesh, policy=ff.Policy(**policy_kwargs))
    params = f.shard()
    x, y = local_slice(idx, mesh, f.data_axes), local_slice(tgt, mesh, f.data_axes)
    with ff.count_comms() as comms:
        if use_func:
            grads, loss = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(params)
        else:
            leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
            ps = {k: v.replace(leaves[k]) for k, v in params.items()}
            loss = lm_loss(f.apply(ps, x), y)
            loss.backward()
            grads = {k: v.replace(leaves[k].grad) for k, v in params.items()}
    full = ff.gather(grads)
    loss_mean = ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean")
    err = max((full[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    return {
        "loss": loss_mean.item(),
        "ref_loss": ref_loss.item(),
        "grad_err": err,
        "comms": comms.by_kind_and_axis(),
        "psi": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def fsdp2_reference(n_layers_units: bool = True):
    """Loss and full grads from torch FSDP2 fully_shard on the same model and batch."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    x, y = local_slice(idx, mesh, ("dp",)), local_slice(tgt, mesh, ("dp",))
    loss = lm_loss(ref(x), y)
    loss.backward()
    fsdp2 = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
    f = ff.fsdp(model, mesh)
    grads, ours = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(f.shard())
    full = ff.gather(grads)
    return {
        "loss_diff": abs(loss.item() - ours.item()),
        "grad_err": max((full[k] - fsdp2[k]).abs().max().item() for k in fsdp2),
    }
