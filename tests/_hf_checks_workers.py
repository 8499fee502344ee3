"""Workers for ``tests/test_hf_checks.py``: the checks that refuse silent wrong numbers, on
``transformers`` models built from a config (one gloo process per rank)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff

from ._hf import tiny_llama_config


def resnet_batchnorm() -> dict[str, Any]:
    """A transformers ResNet (BatchNorm layers): refused in training mode, the module left as
    it was; in eval mode, loss and gradients against the module itself on the global batch."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4
    )
    torch.manual_seed(0)
    model = ResNetForImageClassification(cfg)  # training mode
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    before = {k: b.clone() for k, b in model.named_buffers()}

    def loss_of(sm: ff.FSDP) -> Any:
        return lambda p, b: sm.apply(p, pixel_values=b).logits.square().mean()

    sm = ff.fsdp(model, mesh)
    opt = ff.sgd(0.1)
    step = ff.train_step(loss_of(sm), opt, model=sm)
    try:
        step(ff.TrainState.create(sm.shard(), opt), x)
        message = "no error"
    except ValueError as e:
        message = str(e)
    unchanged = all(torch.equal(b, before[k]) for k, b in model.named_buffers())

    model.eval()
    sm = ff.fsdp(model, mesh)
    params = sm.shard()
    local = ff.local_batch(x, sm)
    grads, loss = torch.func.grad_and_value(lambda p: loss_of(sm)(p, local))(params)
    grads = ff.gather(grads)
    ref_loss = model(pixel_values=x).logits.square().mean()
    ref_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the mean of the ranks' equal shares: the global batch's mean
    return {
        "message": message,
        "unchanged": unchanged,
        "loss_error": abs(total.item() / dist.get_world_size() - ref_loss.item()),
        "grad_error": max(
            (grads[k] - p.grad).abs().max().item() for k, p in model.named_parameters()
        ),
    }


def llama_per_rank_batch(same: bool) -> dict[str, Any]:
    """train_step(batch='global') on a transformers Llama with a dict batch, the same on every
    rank or each rank's own; with the same batch, the loss against one process."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    gen = torch.Generator().manual_seed(0 if same else dist.get_rank())
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.sgd(0.1)
    step = ff.train_step(lambda p, b: sm.apply(p, **b).loss, opt, model=sm)
    try:
        _, metrics = step(ff.TrainState.create(sm.shard(), opt), batch)
    except ValueError as e:
        return {"message": str(e)}
    with torch.no_grad():
        ref = model(**batch).loss.item()
    return {"message": "no error", "loss_error": abs(float(metrics["loss"]) - ref)}
