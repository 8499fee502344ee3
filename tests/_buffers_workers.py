"""Workers for ``tests/test_buffers.py``: BatchNorm's running statistics carried as state by
``FSDP.apply(buffers=..., mutable=...)`` on a transformers ResNet built from a config (one gloo
process per rank), against one process on the global batch and against torch DDP."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.grad_engine import autograd_grad_and_value

STEPS, LR = 3, 0.1


def _resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4
    )
    torch.manual_seed(0)
    return ResNetForImageClassification(cfg)  # training mode


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(10 + step))


def _grad_fn(sm: ff.FSDP, mode: str, engine: str) -> Any:
    def loss_fn(params: Any, inputs: Any) -> Any:
        x, bufs = inputs
        out, new = sm.apply(params, pixel_values=x, buffers=bufs, mutable=mode)
        return out.logits.square().mean(), (out.logits, new)

    if engine == "func":
        return lambda p, i: torch.func.grad_and_value(loss_fn, has_aux=True)(p, i)
    return lambda p, i: autograd_grad_and_value(loss_fn, p, i, has_aux=True)


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def sync_matches_one_process(engine: str, checkpointed: bool = False) -> dict[str, Any]:
    """mutable='sync': logits, gradients and running statistics over STEPS SGD steps equal
    one process's on the global batch; the module and the given buffers are never written.
    ``checkpointed``: every unit recomputes its forward in backward (its collectives too)."""
    model = _resnet()
    ref = copy.deepcopy(model)
    before = {k: b.clone() for k, b in model.named_buffers()}
    policy = ff.Policy(activation_checkpointing=checkpointed)
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}), policy=policy)
    units = len(sm.layout.units)
    params, bufs = sm.shard(), {k: b.clone() for k, b in model.named_buffers()}
    given = {k: b.clone() for k, b in bufs.items()}
    grad_fn = _grad_fn(sm, "sync", engine)
    errors: dict[str, float] = {"logits": 0.0, "grads": 0.0, "buffers": 0.0}
    for step in range(STEPS):
        x = _batch(step)
        grads, (_, (logits, new)) = grad_fn(params, (ff.local_batch(x, sm), bufs))
        if step == 0:
            errors["given_written"] = _err(bufs, given)
        ref.zero_grad()
        ref_logits = ref(pixel_values=x).logits
        ref_logits.square().mean().backward()
        full = ff.gather(grads)
        local = ff.local_batch(ref_logits.detach(), sm)
        errors["logits"] = max(errors["logits"], (logits - local).abs().max().item())
        ref_grads = {k: p.grad for k, p in ref.named_parameters()}
        errors["grads"] = max(errors["grads"], _err(full, ref_grads))
        errors["buffers"] = max(errors["buffers"], _err(new, dict(ref.named_buffers())))
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
        values = ff.gather(params)
        params = sm.shard({k: values[k] - LR * full[k] for k in values})
        bufs = new
    stats = [k for k in bufs if not k.endswith("num_batches_tracked")]
    moved = _err({k: bufs[k] for k in stats}, {k: before[k] for k in stats})
    return {
        **errors,
        "moved": moved,
        "tracked": int(bufs["resnet.embedder.embedder.normalization.num_batches_tracked"]),
        "unchanged": _err(dict(model.named_buffers()), before),
        "units": units,
    }


def per_rank_matches_ddp() -> dict[str, Any]:
    """mutable='per_rank': each rank's logits, the averaged gradients and the buffers over
    STEPS SGD steps equal torch DDP's (broadcast_buffers=True, its default), on each rank's
    own share of the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _resnet()
    ddp = DDP(copy.deepcopy(model))
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    params, bufs = sm.shard(), {k: b.clone() for k, b in model.named_buffers()}
    grad_fn = _grad_fn(sm, "per_rank", "func")
    errors = {"logits": 0.0, "grads": 0.0, "buffers": 0.0, "buffers_rank0": 0.0}
    spread = 0.0
    for step in range(STEPS):
        local = ff.local_batch(_batch(step), sm)
        grads, (_, (logits, new)) = grad_fn(params, (local, bufs))
        ddp.zero_grad()
        ddp_logits = ddp(pixel_values=local).logits
        ddp_logits.square().mean().backward()  # DDP averages the gradients over the ranks
        full = ff.gather(grads)
        errors["logits"] = max(errors["logits"], (logits - ddp_logits).abs().max().item())
        ddp_grads = {k: p.grad for k, p in ddp.module.named_parameters()}
        errors["grads"] = max(errors["grads"], _err(full, ddp_grads))
        ddp_bufs = {k: b.clone() for k, b in ddp.module.named_buffers()}
        if dist.get_rank() == 0:  # the buffers DDP's next forward broadcasts: rank 0's
            errors["buffers_rank0"] = max(errors["buffers_rank0"], _err(new, ddp_bufs))
        for b in ddp_bufs.values():
            dist.broadcast(b, 0)
        errors["buffers"] = max(errors["buffers"], _err(new, ddp_bufs))
        # each rank's own statistics differ before the broadcast
        own = dict(ddp.module.named_buffers())[
            "resnet.embedder.embedder.normalization.running_mean"
        ]
        other = own.clone()
        dist.broadcast(other, 0)
        spread = max(spread, (own - other).abs().max().item())
        with torch.no_grad():
            for p in ddp.module.parameters():
                p -= LR * p.grad
        values = ff.gather(params)
        params = sm.shard({k: values[k] - LR * full[k] for k in values})
        bufs = new
    # evaluation with the carried statistics equals DDP's evaluation (rank 0's broadcast)
    sm.module.eval()
    ddp.eval()
    x = _batch(99)
    out = ff.fsdp(sm.module, sm.mesh).apply(params, pixel_values=x, buffers=bufs).logits
    errors["eval"] = (out - ddp(pixel_values=x).logits).abs().max().item()
    sm.module.train()
    return {**errors, "spread": spread}


def _step_setup(mode: str, accumulate: int) -> tuple[Any, ...]:
    model = _resnet()
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.sgd(LR)

    def loss_fn(params: Any, x: torch.Tensor, bufs: Any) -> Any:
        out, new = sm.apply(params, pixel_values=x, buffers=bufs, mutable=mode)
        return out.logits.square().mean(), new

    step = ff.train_step(loss_fn, opt, model=sm, accumulate=accumulate)
    state = ff.TrainState.create(sm.shard(), opt, buffers=dict(model.named_buffers()))
    return model, sm, step, state


def _global(step: int) -> torch.Tensor:
    return torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(20 + step))


def train_step_sync_matches_one_process(accumulate: int) -> dict[str, Any]:
    """train_step with the buffers in the state, mutable='sync', ``accumulate`` micro-batches
    threaded in order: parameters and buffers after STEPS steps against one process that runs
    each global micro-batch (micro-batch i of every rank's share) in turn."""
    model, _, step, state = _step_setup("sync", accumulate)
    ref = copy.deepcopy(model)
    before = {k: b.clone() for k, b in model.named_buffers()}
    world = dist.get_world_size()
    for i in range(STEPS):
        x = _global(i)
        state, _ = step(state, x)
        ref.zero_grad()
        shares = x.chunk(world)
        for m in range(accumulate):  # the global micro-batch m: every share's m-th part
            mb = torch.cat([s.chunk(accumulate)[m] for s in shares])
            (ref(pixel_values=mb).logits.square().mean() / accumulate).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
    params = ff.gather(state.params)
    return {
        "params": _err(params, {k: p.detach() for k, p in ref.named_parameters()}),
        "buffers": _err(state.buffers, dict(ref.named_buffers())),
        "tracked": int(state.buffers["resnet.embedder.embedder.normalization.num_batches_tracked"]),
        "unchanged": _err(dict(model.named_buffers()), before),
    }


def checkpoint_resume(path: str) -> dict[str, Any]:
    """Save after 2 steps, load into a fresh state, take step 3: bitwise the uninterrupted run,
    buffers included; the checkpoint holds them under ``buffers.<name>``."""
    _, _, step, state = _step_setup("per_rank", 1)
    for i in range(2):
        state, _ = step(state, _global(i))
    ff.checkpoint.save(path, state)
    straight, _ = step(state, _global(2))
    _, _, _, template = _step_setup("per_rank", 1)
    loaded = ff.checkpoint.load(path, template)
    resumed, _ = step(loaded, _global(2))
    keys = sorted(dcp_keys(path))
    return {
        "params": _err(ff.gather(straight.params), ff.gather(resumed.params)),
        "buffers": _err(straight.buffers, resumed.buffers),
        "loaded_buffers": _err(loaded.buffers, state.buffers),
        "step": int(resumed.step),
        "buffer_keys": [k for k in keys if k.startswith("buffers.")],
    }


def dcp_keys(path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
