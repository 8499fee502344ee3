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


def _mobilenet_v2() -> torch.nn.Module:
    """A tiny MobileNetV2 (BatchNorm eps 1e-3 and momentum 0.997, as transformers builds it;
    its last layers see 1×1 maps, so a few values per channel per rank)."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    cfg = MobileNetV2Config(
        image_size=32, depth_multiplier=0.25, min_depth=4, num_labels=4, classifier_dropout_prob=0.0
    )
    torch.manual_seed(0)
    return MobileNetV2ForImageClassification(cfg)


MODELS = {"resnet": _resnet, "mobilenet_v2": _mobilenet_v2}


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


def _step_setup(
    mode: str,
    accumulate: int,
    name: str = "resnet",
    dtype: torch.dtype = torch.float32,
    lr: float = LR,
) -> tuple[Any, ...]:
    model = MODELS[name]().to(dtype)
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    opt = ff.sgd(lr)

    def loss_fn(params: Any, x: torch.Tensor, bufs: Any) -> Any:
        out, new = sm.apply(params, pixel_values=x, buffers=bufs, mutable=mode)
        return out.logits.square().mean(), new

    step = ff.train_step(loss_fn, opt, model=sm, accumulate=accumulate)
    state = ff.TrainState.create(sm.shard(), opt, buffers=dict(model.named_buffers()))
    return model, sm, step, state


def _global(step: int, name: str = "resnet") -> torch.Tensor:
    size = 32 if name == "mobilenet_v2" else 16
    return torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(20 + step))


def train_step_sync_matches_one_process(
    accumulate: int, name: str = "resnet", dtype: torch.dtype = torch.float32, lr: float = LR
) -> dict[str, Any]:
    """train_step with the buffers in the state, mutable='sync', ``accumulate`` micro-batches
    threaded in order: parameters and buffers after STEPS steps against one process that runs
    each global micro-batch (micro-batch i of every rank's share) in turn, in ``dtype``."""
    model, _, step, state = _step_setup("sync", accumulate, name, dtype, lr)
    ref = copy.deepcopy(model)
    before = {k: b.clone() for k, b in model.named_buffers()}
    world = dist.get_world_size()
    for i in range(STEPS):
        x = _global(i, name).to(dtype)
        state, _ = step(state, x)
        ref.zero_grad()
        shares = x.chunk(world)
        for m in range(accumulate):  # the global micro-batch m: every share's m-th part
            mb = torch.cat([s.chunk(accumulate)[m] for s in shares])
            (ref(pixel_values=mb).logits.square().mean() / accumulate).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= lr * p.grad
    params = ff.gather(state.params)
    tracked = [v for k, v in state.buffers.items() if k.endswith("num_batches_tracked")]
    return {
        "params": _err(params, {k: p.detach() for k, p in ref.named_parameters()}),
        "buffers": _err(state.buffers, dict(ref.named_buffers())),
        "tracked": {int(t) for t in tracked},
        "unchanged": _err(dict(model.named_buffers()), before),
    }


def first_gradients_against_float64(name: str) -> dict[str, float]:
    """One sync step's gradients in float32, this library's and one process's, each as far
    from one process's float64 gradients (relative, over all parameters): how much of a
    float32 difference is the network's own conditioning rather than the algorithm."""
    model = MODELS[name]()
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    bufs = dict(model.named_buffers())
    x = _global(0, name)

    def loss_fn(params: Any, share: torch.Tensor) -> torch.Tensor:
        out, _ = sm.apply(params, pixel_values=share, buffers=bufs, mutable="sync")
        return out.logits.square().mean()

    ours = ff.gather(torch.func.grad(loss_fn)(sm.shard(), ff.local_batch(x, sm)))
    grads = {}
    for dtype in (torch.float32, torch.float64):
        ref = copy.deepcopy(model).to(dtype)
        ref(pixel_values=x.to(dtype)).logits.square().mean().backward()
        grads[dtype] = {k: p.grad.double() for k, p in ref.named_parameters()}
    exact = grads[torch.float64]

    def rel(g: dict[str, torch.Tensor]) -> float:
        diff = sum((g[k].double() - exact[k]).square().sum() for k in exact)
        return float((diff / sum(v.square().sum() for v in exact.values())).sqrt())

    return {"ours": rel(ours), "one_process": rel(grads[torch.float32])}


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


SHIFTS = (0.0, 1e2, 1e3, 1e4)


def _bn_net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.BatchNorm1d(6), torch.nn.Flatten(), torch.nn.Linear(18, 3)
    )  # BatchNorm over dims 0 and 2 of (N, C, L) inputs
    return net.to(dtype)


def sync_statistics_at_shifts(axes: dict[str, int]) -> dict[str, dict[str, tuple[float, ...]]]:
    """mutable='sync' on inputs whose mean is far from zero (std 1, mean at each of SHIFTS),
    in float32 and bfloat16, under torch.func and plain autograd: this rank's outputs, the
    gradients and the running statistics, each as far from one float64 process on the
    global batch as one process in the same dtype is. Returns, for each case, ``(ours,
    one process, scale)`` per quantity: the two distances and the largest exact value."""
    mesh = ff.make_mesh(axes)
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for shift in SHIFTS:
            gen = torch.Generator().manual_seed(int(shift) + 1)
            x = (shift + torch.randn(32, 6, 3, generator=gen)).to(dtype)  # the global batch
            refs = {}
            for ref_dtype in (dtype, torch.float64):  # one process: same dtype, and exact
                ref = _bn_net(dtype).to(ref_dtype)
                y = ref(x.to(ref_dtype))
                y.square().mean().backward()
                refs[ref_dtype] = (
                    ff.local_batch(y.detach(), mesh).double(),
                    {k: p.grad.double() for k, p in ref.named_parameters()},
                    {k: b.double() for k, b in ref.named_buffers() if "running" in k},
                )
            for engine in ("func", "autograd"):
                model = _bn_net(dtype)
                sm = ff.fsdp(model, mesh)
                bufs = dict(model.named_buffers())

                def loss_fn(params: Any, share: torch.Tensor) -> Any:
                    y, new = sm.apply(params, share, buffers=bufs, mutable="sync")
                    return y.square().mean(), (y, new)

                args = (sm.shard(), ff.local_batch(x, sm))
                if engine == "func":
                    grads, (_, (y, new)) = torch.func.grad_and_value(loss_fn, has_aux=True)(*args)
                else:
                    grads, (_, (y, new)) = autograd_grad_and_value(loss_fn, *args, has_aux=True)
                ours = (
                    y.detach().double(),
                    {k: v.double() for k, v in ff.gather(grads).items()},
                    {k: new[k].double() for k in refs[dtype][2]},
                )
                case: dict[str, tuple[float, ...]] = {}
                for i, what in enumerate(("outputs", "grads", "statistics")):
                    exact = refs[torch.float64][i]
                    if isinstance(exact, torch.Tensor):
                        a, b, e = {"": ours[i]}, {"": refs[dtype][i]}, {"": exact}
                    else:
                        a, b, e = ours[i], refs[dtype][i], exact
                    case[what] = (
                        max((a[k] - e[k]).abs().max().item() for k in e),
                        max((b[k] - e[k]).abs().max().item() for k in e),
                        max(e[k].abs().max().item() for k in e),
                    )
                out[f"{str(dtype).removeprefix('torch.')} {shift:g} {engine}"] = case
    return out
