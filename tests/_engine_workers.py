"""Worker functions for the engine tests on real gloo processes (see tests/test_engine.py)."""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed as dist
from torch import nn

import functional_fsdp as ff
from functional_fsdp.fsdp.memory import track_memory
from functional_fsdp.train import local_batch

from ._hf import tiny_llama_config


def _mlp(frozen_first: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    if frozen_first:
        m[2].requires_grad_(False)  # a frozen unit between two trainable ones
    return m


def _split(params: dict, trainable: frozenset[str]) -> tuple[dict, dict]:
    return (
        {k: v for k, v in params.items() if k in trainable},
        {k: v for k, v in params.items() if k not in trainable},
    )


def frozen_units() -> dict:
    """Units whose parameters are all frozen: no crash, no gradient, no reduce-scatter for them,
    their gathered storage freed after their backward; trainable gradients match a reference."""
    model = _mlp()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh, units=["0", "2", "4"])
    train, frozen = _split(sm.shard(), sm.trainable)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g)
    (xl,) = local_batch((x,), mesh, sm.data_axes)
    with ff.count_comms() as comms, track_memory() as memory:
        grads = torch.func.grad(lambda t: sm.apply({**t, **frozen}, xl).pow(2).mean())(train)
    ref = torch.func.grad(
        lambda t: (
            torch.func.functional_call(model, {**t, **_plain(frozen, model)}, (x,)).pow(2).mean()
        )
    )({k: p.detach() for k, p in model.named_parameters() if k in sm.trainable})
    full = ff.gather(grads)
    frees = [e.unit for e in memory.events if e.kind == "free" and e.phase == "backward"]
    n = dist.get_world_size()
    # Reduce-scatter inputs are the padded full gradients (n local blocks each).
    trainable_bytes = sum(v.local.numel() * n * 4 for v in train.values())
    return {
        "grad_keys": sorted(grads),
        "err": max((full[k] - ref[k]).abs().max().item() for k in ref),
        "rs_bytes": comms.bytes("reduce_scatter"),
        "expected_rs_bytes": trainable_bytes * (n - 1) // n,
        "backward_frees": sorted(set(frees)),
        "live_after": memory.live_bytes,
    }


def _plain(frozen: dict, model: nn.Module) -> dict:
    return {k: model.get_parameter(k).detach() for k in frozen}


def requires_grad_changes_and_replace() -> dict:
    """A layer unfrozen after ff.fsdp gets its gradient from the same object;
    dataclasses.replace(policy=bf16) builds its own plan."""
    model = _mlp()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh, units=["0", "2", "4"])
    params = sm.shard()
    x = torch.ones(2, 4)
    before = sorted(sm.trainable)
    model[2].requires_grad_(True)
    after = sorted(sm.trainable)
    train, frozen = _split(params, sm.trainable)
    grads = torch.func.grad(lambda t: sm.apply({**t, **frozen}, x).sum())(train)
    fresh = ff.fsdp(model, mesh, units=["0", "2", "4"])
    fresh_grads = torch.func.grad(lambda t: fresh.apply({**t, **frozen}, x).sum())(train)
    model[2].requires_grad_(False)
    same = all(torch.equal(grads[k].local, fresh_grads[k].local) for k in grads)
    bf16 = ff.MixedPrecision(param_dtype=torch.bfloat16)
    _ = sm.apply(params, x)  # a call before the replace must not leak into the copy
    sm16 = dataclasses.replace(sm, policy=ff.Policy(mixed_precision=bf16))
    y16 = sm16.apply(params, x)
    ref16 = ff.fsdp(model, mesh, units=["0", "2", "4"], policy=ff.Policy(mixed_precision=bf16))
    return {
        "before": before,
        "after": after,
        "w0_grad_norm": grads["2.weight"].local.norm().item(),
        "same_as_fresh": same,
        "y16_dtype": str(y16.dtype),
        "y16_equal": torch.equal(y16, ref16.apply(params, x)),
        "plans_differ": sm16.layout is not sm.layout,
    }


class _Recorder(nn.Module):
    """Records what it sees of the user's module while it runs inside FSDP.apply."""

    def __init__(self, original: list[nn.Module]):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._original = original
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        user = self._original[0]
        self.seen.append(
            ("forward" in user.lin.__dict__, isinstance(user.lin.weight, nn.Parameter))
        )
        self.note = "set during the call"  # lands on the call's copy, never on the user's module
        return self.lin(x)


def module_never_patched() -> dict:
    """During apply the user's modules keep their own forward and Parameters; an exception
    mid-forward leaves nothing behind; threads and a nested apply get their own copies."""
    holder: list[nn.Module] = []
    torch.manual_seed(0)
    model = nn.Sequential(_Recorder(holder), nn.Linear(4, 4))
    holder.append(model[0])
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh, units=["0", "1"])
    params = sm.shard()
    x = torch.randn(3, 4)
    y = sm.apply(params, x)
    seen_inside = model[0].seen  # the copy's list is the same object (shared attributes)

    try:
        sm.apply(params, torch.randn(3, 5))  # wrong width: raises inside unit "0"
        raised = False
    except RuntimeError:
        raised = True
    untouched = (
        all("forward" not in m.__dict__ for m in model.modules())
        and all(isinstance(p, nn.Parameter) for p in model.parameters())
        and not hasattr(model[0], "note")
    )

    results: dict[int, torch.Tensor] = {}

    def worker(i: int) -> None:
        results[i] = sm.apply(params, x * i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threads_ok = all(torch.allclose(results[i], sm.apply(params, x * i)) for i in range(4))

    # Nested: a module whose forward runs another FSDP.apply over one of its children.
    inner = ff.fsdp(model[1], mesh, units=[])
    inner_params = inner.shard()

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) + inner.apply(inner_params, x)

    outer_model = Outer()
    outer = ff.fsdp(outer_model, mesh, units=["body.0", "body.1"])
    nested = outer.apply(outer.shard(), x)
    with torch.no_grad():
        expected = model(x) + model[1](x)
    return {
        "y_ok": torch.allclose(y, model(x).detach(), atol=1e-6),
        "seen_inside": seen_inside[:1],
        "raised": raised,
        "untouched": untouched,
        "threads_ok": threads_ok,
        "nested_ok": torch.allclose(nested, expected, atol=1e-6),
    }


class _Branchy(nn.Module):
    """Runs its blocks in an order chosen by the input (a flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        for b in reversed(self.blocks) if reverse else self.blocks:
            x = torch.tanh(b(x))
        return x


def prefetch_independent_of_previous_call() -> dict:
    """The collectives and memory events of a call do not depend on the previous call."""
    torch.manual_seed(0)
    model = _Branchy()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    x = torch.randn(2, 4)

    def events(sm: ff.FSDP, params: dict, reverse: bool) -> list:
        with track_memory() as memory, ff.count_comms() as comms:
            torch.func.grad(lambda p: sm.apply(p, x, reverse=reverse).sum())(params)
        return [(e.kind, e.unit, e.phase) for e in memory.events] + [comms.summary()]

    sm = ff.fsdp(model, mesh)
    params = sm.shard()
    events(sm, params, reverse=True)
    after_reverse = events(sm, params, reverse=False)
    fresh = ff.fsdp(model, mesh)
    return {"same": after_reverse == events(fresh, fresh.shard(), reverse=False)}


def autograd_grad_subset_and_counters() -> dict:
    """torch.autograd.grad over a subset of the shards leaves nothing in flight and matches a
    full backward; a backward run after the count_comms block closed is still counted."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(3)))
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh)
    params = sm.shard()
    x = torch.randn(4, 6)

    def leaves() -> tuple[dict, dict]:
        ls = {k: v.local.detach().clone().requires_grad_() for k, v in params.items()}
        return ls, {k: v.replace(ls[k]) for k, v in params.items()}

    ls, ps = leaves()
    sm.apply(ps, x).pow(2).sum().backward()
    full = {k: t.grad for k, t in ls.items()}
    ls2, ps2 = leaves()
    subset = ["2.weight", "1.bias"]
    got = torch.autograd.grad(sm.apply(ps2, x).pow(2).sum(), [ls2[k] for k in subset])
    subset_ok = all(torch.equal(g, full[k]) for k, g in zip(subset, got))
    # Anything left in flight would make this collective fail or hang.
    after = ff.all_reduce(torch.ones(1), mesh, "dp").item()

    _, ps3 = leaves()
    with ff.count_comms() as comms:
        loss = sm.apply(ps3, x).pow(2).sum()
    forward_only = comms.count("reduce_scatter")
    loss.backward()
    return {
        "subset_ok": subset_ok,
        "after": after,
        "forward_rs": forward_only,
        "backward_rs": comms.count("reduce_scatter"),
    }


def fp16_reduce_does_not_overflow() -> dict:
    """Gradients whose sum over ranks overflows fp16 are divided before the reduction."""
    n = dist.get_world_size()
    mesh = ff.make_mesh({"dp": n})
    model = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mp = ff.MixedPrecision(reduce_dtype=torch.float16)
    sm = ff.fsdp(model, mesh, policy=ff.Policy(mixed_precision=mp))
    params = sm.shard()
    x = torch.full((1, 4), 60000.0)  # d(sum)/dW = 60000 per rank: the sum over ranks overflows
    grads = torch.func.grad(lambda p: sm.apply(p, x).sum())(params)
    full = ff.gather(grads)["weight"]
    return {
        "finite": bool(torch.isfinite(full).all()),
        "max_err": (full - 60000.0).abs().max().item(),
    }


def hf_outputs(kind: str) -> dict:
    """transformers models through apply with keyword inputs and ModelOutput results:
    loss and gradients equal the single-process reference."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tiny_llama_config()
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(
            vocab_size=96,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (4, 10), generator=g)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh)
    params = sm.shard()
    (local_ids,) = local_batch((ids,), mesh, sm.data_axes)
    grads, loss = torch.func.grad_and_value(
        lambda p: sm.apply(p, input_ids=local_ids, labels=local_ids).loss
    )(params)
    ref_params = {k: p.detach() for k, p in model.named_parameters()}
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: (
            torch.func.functional_call(
                model, p, (), {"input_ids": ids, "labels": ids}, tie_weights=True
            ).loss
        )
    )(ref_params)
    full = ff.gather(grads)
    loss = ff.all_reduce(loss.detach(), mesh, "dp", op="mean")
    out = sm.apply(params, input_ids=local_ids)
    return {
        "loss_diff": abs(loss.item() - ref_loss.item()),
        "grad_err": max((full[k] - ref_grads[k]).abs().max().item() for k in full),
        "output_type": type(out).__name__,
    }


def offload_matches_on_device(policies: list[dict]) -> list[dict]:
    """Three AdamW steps of a GPT with each policy; shards, gradients and optimizer state
    stay where FSDP.shard() placed them."""
    from functional_fsdp.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(n_layer=2, vocab_size=61, n_embd=32, n_head=4, block_size=16)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (8, 13), generator=g) for _ in range(3)]
    out = []
    for kw in policies:
        torch.manual_seed(0)
        model = GPT(cfg)
        sm = ff.fsdp(model, mesh, policy=ff.Policy(**kw))
        opt = ff.adamw(1e-2, weight_decay=0.01)
        step = ff.train_step(lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
        losses = []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"].item())
        leaves = ff.tree_leaves((state.params, state.opt_state))
        devices = {t.device.type for t in leaves if isinstance(t, torch.Tensor)}
        out.append(
            {
                "losses": losses,
                "params": {k: v.local.clone() for k, v in state.params.items()},
                "devices": sorted(devices),
            }
        )
    return [
        {
            "same_losses": out[0]["losses"] == o["losses"],
            "same_params": all(torch.equal(out[0]["params"][k], v) for k, v in o["params"].items()),
            "devices": o["devices"],
        }
        for o in out
    ]
