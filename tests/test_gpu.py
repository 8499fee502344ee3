"""GPU / NCCL tests: the same numerics on CUDA with NCCL. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import functional_fsdp as ff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)"),
]


def _cuda_step() -> dict:
    from functional_fsdp.models import GPT, lm_loss

    from ._fsdp_workers import CFG, gpt_batch

    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    idx, tgt = (t.cuda() for t in gpt_batch())
    params = {n: p.detach() for n, p in model.named_parameters()}
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: lm_loss(torch.func.functional_call(model, p, (idx,)), tgt)
    )(params)
    mesh = ff.make_mesh({"dp": torch.distributed.get_world_size()})
    sharded_model = ff.fsdp(model, mesh)
    grads, loss = torch.func.grad_and_value(lambda p: lm_loss(sharded_model.apply(p, idx), tgt))(
        sharded_model.shard()
    )
    full = ff.gather(grads)
    return {
        "backend": torch.distributed.get_backend(),
        "device": str(mesh.device_type),
        "loss_diff": abs(loss.item() - ref_loss.item()),
        "grad_err": max((full[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
    }


def test_nccl_fsdp_matches_reference_on_cuda():
    world = torch.cuda.device_count()
    out = ff.launch(_cuda_step, world)
    for r in out:
        assert r["backend"] == "nccl" and r["device"] == "cuda", r
        assert r["loss_diff"] < 1e-4 and r["grad_err"] < 1e-4, r
