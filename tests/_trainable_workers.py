"""Worker functions for the trainable/frozen tests (real gloo processes)."""

from __future__ import annotations

import copy
import os
import warnings

import torch
from torch import nn

import functional_fsdp as ff

LR = 1e-2
STEPS = 3


def _equal_trees(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(ff.tree_leaves(a), ff.tree_leaves(b)))


def _rs_bytes(comms: ff.CommCounter) -> int:
    return sum(r.bytes for r in comms.records if r.kind == "reduce_scatter")


def _share_bytes(params: dict, names: frozenset[str], world: int) -> int:
    """Ring reduce-scatter bytes of the trainable shards: (n-1)/n of the gathered buffer."""
    return sum(
        v.local.numel() * v.local.element_size() * (world - 1)
        for k, v in params.items()
        if k in names
    )


# --------------------------------------------------------------------------- LoRA on Llama


def lora_llama() -> tuple[nn.Module, nn.Module]:
    """A tiny Llama (from a config) with LoRA on q_proj and v_proj, and a copy of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,  # B != 0, so the first steps move the output
    )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        model = get_peft_model(LlamaForCausalLM(cfg), lora)
    return model, copy.deepcopy(model)


def lora_batches(steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 9), generator=g) for _ in range(steps)]


def run_lora_llama() -> dict:
    """3 AdamW steps with ff.train_step vs torch.optim.AdamW on the single-process model."""
    model, ref = lora_llama()
    mesh = ff.make_mesh({"dp": 2})
    world = torch.distributed.get_world_size()
    sm = ff.fsdp(model, mesh)
    opt = ff.adamw(LR, weight_decay=0.1, eps=1e-6)

    def loss_fn(p, b):
        return sm.apply(p, input_ids=b, labels=b).loss

    step = ff.train_step(loss_fn, opt, model=sm)
    params = sm.shard()
    out: dict = {}
    try:  # the README recipe, without trainable=: refused, not silently training
        step(ff.TrainState.create(params, opt), lora_batches(1)[0])
    except ValueError as e:
        out["default_error"] = str(e)
    state = ff.TrainState.create(params, opt, trainable=sm)
    names = state.trainable
    frozen_before = {k: v.local.clone() for k, v in params.items() if k not in names}
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1, eps=1e-6
    )
    out["loss_diff"], out["rs_bytes"] = 0.0, []
    for b in lora_batches():
        with ff.count_comms() as comms:
            state, metrics = step(state, b)
        out["rs_bytes"].append(_rs_bytes(comms))
        ref_loss = ref(input_ids=b, labels=b).loss
        ref_loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        out["loss_diff"] = max(out["loss_diff"], abs(float(metrics["loss"]) - ref_loss.item()))
    full = ff.gather(state.params)
    theirs = dict(ref.named_parameters())
    out["param_diff"] = max((full[k] - theirs[k].detach()).abs().max().item() for k in names)
    out["frozen_bitwise"] = all(
        torch.equal(state.params[k].local, frozen_before[k]) for k in frozen_before
    )
    out["frozen_same_objects"] = all(state.params[k] is params[k] for k in frozen_before)
    out["expected_rs_bytes"] = _share_bytes(params, names, world)
    out["trainable"] = sorted(names)
    out["frozen"] = sorted(frozen_before)
    out["module_trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    mu = state.opt_state[0].mu
    out["mu_keys"] = sorted(mu)
    out["opt_state_leaves"] = len(ff.tree_leaves(state.opt_state, none_is_leaf=False))
    out["module_untouched"] = all(
        p.requires_grad == ("lora_" in n) for n, p in model.named_parameters()
    )
    return out


# --------------------------------------------------------------------------- a plain model


def frozen_mlp(seed: int = 0) -> nn.Module:
    """Uneven shapes (13 and 5 rows over 2 ranks: padded shards); the middle layer frozen."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 13), nn.Tanh(), nn.Linear(13, 5)
    )
    model[2].requires_grad_(False)
    return model


def mlp_batches(steps: int = STEPS, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(size, 12, generator=g), torch.randn(size, 5, generator=g))
        for _ in range(steps)
    ]


VARIANTS = {
    "plain": ({}, {}),
    "clip": ({}, {}),
    "accumulate_each": ({}, dict(accumulate=2)),
    "accumulate_local": ({}, dict(accumulate=2, accumulate_mode="local")),
    "zero2": (dict(specs=ff.P()), dict(opt_specs=ff.P("dp"))),  # the ZeRO paper's
    "donate": ({}, dict(donate=True)),
}
MAX_NORM = 0.05  # small enough that every step clips


def _mlp_opt(variant: str) -> ff.GradientTransformation:
    opt = ff.adamw(LR, weight_decay=0.1)
    return ff.chain(ff.clip_by_global_norm(MAX_NORM, eps=1e-6), opt) if variant == "clip" else opt


def mlp_reference(variant: str, steps: int = STEPS) -> dict:
    """torch.optim.AdamW (and clip_grad_norm_) on the trainable parameters, global batch."""
    model = frozen_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for x, y in mlp_batches(steps):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainable]))
        if variant == "clip":
            torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


def run_mlp(variant: str) -> dict:
    fsdp_kwargs, step_kwargs = VARIANTS[variant]
    step_kwargs = dict(step_kwargs)
    opt_specs = step_kwargs.pop("opt_specs", None)  # the state's, given once
    model = frozen_mlp()
    mesh = ff.make_mesh({"dp": 2})
    world = torch.distributed.get_world_size()
    sm = ff.fsdp(model, mesh, **fsdp_kwargs)
    opt = _mlp_opt(variant)
    step = ff.train_step(
        lambda p, b: (sm.apply(p, b[0]) - b[1]).pow(2).mean(), opt, model=sm, **step_kwargs
    )
    params = sm.shard()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}  # = sm.trainable
    state = ff.TrainState.create(params, opt, trainable=trainable, opt_specs=opt_specs)
    frozen = {k: v for k, v in params.items() if k not in trainable}
    frozen_before = {k: v.local.clone() for k, v in frozen.items()}
    ref = mlp_reference(variant)
    out: dict = {"loss_diff": 0.0, "norm_diff": 0.0, "rs_bytes": [], "ar_bytes": []}
    for i, b in enumerate(mlp_batches()):
        with ff.count_comms() as comms:
            state, metrics = step(state, b)
        out["rs_bytes"].append(_rs_bytes(comms))
        out["ar_bytes"].append(
            sum(r.bytes for r in comms.records if r.kind == "all_reduce" and r.bytes > 16)
        )
        out["loss_diff"] = max(out["loss_diff"], abs(float(metrics["loss"]) - ref["losses"][i]))
        out["norm_diff"] = max(out["norm_diff"], abs(float(metrics["grad_norm"]) - ref["norms"][i]))
    full = ff.gather(state.params)
    out["param_diff"] = max((full[k] - ref["params"][k].detach()).abs().max().item() for k in full)
    out["frozen_bitwise"] = all(
        torch.equal(state.params[k].local, frozen_before[k]) for k in frozen
    )
    out["frozen_same_objects"] = all(state.params[k] is frozen[k] for k in frozen)
    out["expected_rs_bytes"] = _share_bytes(params, frozenset(trainable), world)
    out["trainable_bytes"] = sum(full[k].numel() * full[k].element_size() for k in trainable)
    adam = state.opt_state[1][0] if variant == "clip" else state.opt_state[0]
    out["mu_keys"] = sorted(adam.mu)
    out["mu_specs"] = sorted({str(v.spec.trimmed()) for v in adam.mu.values()})
    # Onto the optimizer's shards (ZeRO-2: not the replicated params' layout).
    out["opt_rs_bytes"] = sum(
        v.local.numel() * v.local.element_size() * (world - 1) for v in adam.mu.values()
    )
    out["trainable"] = sorted(trainable)
    return out


# --------------------------------------------------------------------------- checkpoints


def _mlp_setup(axes: dict, seed: int):
    model = frozen_mlp(seed)
    mesh = ff.make_mesh(axes)
    sm = ff.fsdp(model, mesh)
    opt = ff.adamw(LR, weight_decay=0.1)
    step = ff.train_step(lambda p, b: (sm.apply(p, b[0]) - b[1]).pow(2).mean(), opt, model=sm)
    return sm, opt, step


def _adam_full(state: ff.TrainState) -> dict:
    adam = state.opt_state[0]
    return {"mu": ff.gather(adam.mu), "nu": ff.gather(adam.nu), "count": adam.count}


def save_partitioned(path: str, steps: int = 2) -> dict:
    sm, opt, step = _mlp_setup({"dp": 2}, seed=0)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    data = mlp_batches(steps + 1)
    for b in data[:steps]:
        state, _ = step(state, b)
    ff.checkpoint.save(path, state)
    out = {"params": ff.gather(state.params), "opt": _adam_full(state), "step": state.step}
    _, metrics = step(state, data[steps])
    out["next_loss"] = float(metrics["loss"])
    if torch.distributed.get_rank() == 0:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(os.fspath(path))
        out["keys"] = sorted(reader.read_metadata().state_dict_metadata)
    return out


def load_partitioned(axes: dict, path: str, steps: int = 2) -> dict:
    """Into a template built from another seed on another mesh, then one more step."""
    sm, opt, step = _mlp_setup(axes, seed=123)
    template = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    state = ff.checkpoint.load(path, template)
    out = {"params": ff.gather(state.params), "opt": _adam_full(state), "step": state.step}
    out["trainable"] = sorted(state.trainable)
    _, metrics = step(state, mlp_batches(steps + 1)[steps])
    out["next_loss"] = float(metrics["loss"])
    return out


# --------------------------------------------------------------------------- padding


def padded_global_norm() -> dict:
    """global_norm of uneven Sharded values whose padding tree_map made non-zero."""
    torch.manual_seed(0)
    full = {"w": torch.randn(5, 3), "b": torch.randn(7), "even": torch.randn(4, 2)}
    mesh = ff.make_mesh({"dp": 2})
    tree = ff.shard(full, mesh, ff.P("dp"))
    shifted = ff.tree_map(lambda t: t + 1.0, tree)  # padding rows become 1.0
    pad = shifted["w"].local[-1] if torch.distributed.get_rank() == 1 else None
    expected = torch.sqrt(sum(((t + 1.0) ** 2).sum() for t in full.values()))
    return {
        "norm": ff.global_norm(shifted).item(),
        "expected": expected.item(),
        "padding_nonzero": pad is None or bool((pad != 0).all()),
    }


def mlp_vs_fsdp2() -> dict:
    """The frozen-layer model: ff.train_step vs FSDP2 fully_shard with torch.optim.AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = frozen_mlp()
    mesh = ff.make_mesh({"dp": 2})
    ref = copy.deepcopy(model)
    for i in (0, 2, 4):
        fully_shard(ref[i], mesh=mesh)
    fully_shard(ref, mesh=mesh)
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1
    )
    sm = ff.fsdp(model, mesh)
    opt = ff.adamw(LR, weight_decay=0.1)
    step = ff.train_step(lambda p, b: (sm.apply(p, b[0]) - b[1]).pow(2).mean(), opt, model=sm)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    rank = torch.distributed.get_rank()
    for x, y in mlp_batches():
        state, _ = step(state, (x, y))
        local = slice(rank * 4, rank * 4 + 4)
        (ref(x[local]) - y[local]).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    ours = ff.gather(state.params)
    theirs = {n: p.full_tensor() for n, p in ref.named_parameters()}
    return {
        "param_diff": max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
        "frozen_equal": all(torch.equal(ours[k], theirs[k]) for k in ("2.weight", "2.bias")),
    }
