"""Workers for tests/test_engine_autograd.py: ``train_step(engine="autograd")`` against the
``torch.func`` engine and against one process, on real gloo ranks.

Each worker returns plain numbers: the largest differences it saw, and how many
:class:`~functional_fsdp.AutogradFallbackWarning` notices ``engine="auto"`` gave.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import functional_fsdp as ff
from functional_fsdp.grad_engine import autograd_grad_and_value
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss
from functional_fsdp.train import local_batch

from ._tp_hf_workers import logits_of, with_lora
from ._zoo import ZOO
from ._zoo_workers import train_vs_adamw

CFG = GPTConfig(n_layer=2, vocab_size=61, n_embd=32, n_head=4, block_size=16, dropout=0.1)
STEPS, LR = 2, 1e-2
OPT: dict[str, Any] = dict(weight_decay=0.1, eps=1e-6)

# name: (mesh axes, how to shard, train_step kwargs; "opt_specs"/"trainable" go to the state)
ZERO = dict(opt_specs=ff.P("dp"))
CASES: dict[str, tuple[dict[str, int], str, dict[str, Any]]] = {
    "zero3_accumulate_donate": ({"dp": 2}, "fsdp", dict(accumulate=2, donate=True)),
    "zero3_accumulate_local": ({"dp": 2}, "fsdp", dict(accumulate=2, accumulate_mode="local")),
    "zero3_frozen": ({"dp": 2}, "fsdp", dict(trainable=lambda path, p: "blocks.1" in path)),
    "ddp": ({"dp": 2}, "replicated", {}),
    "zero1": ({"dp": 2}, "replicated", dict(ZERO, accumulate=2, accumulate_mode="local")),
    "zero2_donate": ({"dp": 2}, "replicated", dict(ZERO, accumulate=2, donate=True)),
    "tp": ({"dp": 1, "tp": 2}, "tp", {}),
}


def _sharding(model: nn.Module, mesh: Any, how: str) -> ff.FSDP:
    if how == "tp":
        tp = ff.tensor_parallel(model, mesh, gpt_plan(CFG, loss_parallel=False))
        return ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    if how == "replicated":
        return ff.fsdp(model, mesh, specs=ff.P())
    return ff.fsdp(model, mesh)


def gpt_run(
    axes: dict[str, int], how: str, step_kwargs: dict[str, Any], engine: str
) -> tuple[list[float], list[float], dict[str, torch.Tensor], float, Any]:
    """``STEPS`` steps of GPT with dropout (the state's key), clipping and apply_if_finite:
    losses, gradient norms, the gathered parameters, how far they moved, and the steps'
    collectives (count and bytes per kind and axis)."""
    kwargs = dict(step_kwargs)
    state_kwargs = {k: kwargs.pop(k) for k in ("opt_specs", "trainable") if k in kwargs}
    torch.manual_seed(0)
    model = GPT(CFG).train()
    mesh = ff.make_mesh(axes)
    f = _sharding(model, mesh, how)
    opt = ff.apply_if_finite(
        ff.chain(ff.clip_by_global_norm(0.5, eps=1e-6), ff.adamw(LR, **OPT)), 3
    )
    step = ff.train_step(
        lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]),
        opt,
        model=f,
        engine=engine,
        **kwargs,
    )
    state = ff.TrainState.create(f.shard(), opt, rng=3, **state_kwargs)
    first = {k: v.clone() for k, v in ff.gather(state.params).items()}  # donate= writes
    g = torch.Generator().manual_seed(0)
    losses, norms = [], []
    with ff.count_comms() as comms:
        for _ in range(STEPS):
            state, metrics = step(state, torch.randint(0, CFG.vocab_size, (8, 13), generator=g))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    last = ff.gather(state.params)
    return losses, norms, last, _diff(last, first), comms.by_kind_and_axis()


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def engines_agree(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per case (default: all): the autograd engine's losses, norms, parameters and
    collectives against torch.func's."""
    out = {}
    for name in names or list(CASES):
        axes, how, kwargs = CASES[name]
        f_losses, f_norms, f_params, moved, f_comms = gpt_run(axes, how, kwargs, "func")
        a_losses, a_norms, a_params, _, a_comms = gpt_run(axes, how, kwargs, "autograd")
        out[name] = {
            "losses_equal": f_losses == a_losses,
            "norms_equal": f_norms == a_norms,
            "params_equal": all(torch.equal(f_params[k], a_params[k]) for k in f_params),
            "param_diff": _diff(f_params, a_params),
            "moved": moved,
            "comms_equal": f_comms == a_comms,  # ZeRO-2 too: computes with the replicas
            "comms": {f"{k}/{a}": v for (k, a), v in a_comms.items()},
        }
    return out


def _grads_both_ways(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, Any]:
    """One gradient of ``model`` on 2 ranks, with torch.func and with autograd."""
    mesh = ff.make_mesh({"dp": 2})
    f = ff.fsdp(model, mesh)
    params = f.shard()
    x, y = local_batch((idx, tgt), mesh, f.data_axes)

    def loss(p: Any, b: Any) -> torch.Tensor:
        return lm_loss(logits_of(f.apply(p, b[0])), b[1])

    g_func, l_func = torch.func.grad_and_value(loss)(params, (x, y))
    g_auto, l_auto = autograd_grad_and_value(loss, params, (x, y))
    g_func, g_auto = ff.gather(g_func), ff.gather(g_auto)
    return {
        "loss_diff": abs(l_func.item() - l_auto.item()),
        "grad_diff": _diff(g_func, g_auto),
        "bitwise": all(torch.equal(g_func[k], g_auto[k]) for k in g_func),
        "grad_max": max(g.abs().max().item() for g in g_func.values()),
        "unchanged": all(
            v.local.grad is None and not v.local.requires_grad for v in params.values()
        ),
    }


def grads_gpt_and_llama() -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 61, (4, 12), generator=g)
    torch.manual_seed(0)
    gpt = GPT(dataclasses.replace(CFG, dropout=0.0))
    llama = ZOO["llama"].build()
    return {
        "gpt": _grads_both_ways(gpt, idx[:, :-1], idx[:, 1:]),
        "llama": _grads_both_ways(llama, idx[:, :-1], idx[:, 1:]),
    }


def _noticed(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fn()
    result["notices"] = [
        str(w.message) for w in seen if issubclass(w.category, ff.AutogradFallbackWarning)
    ]
    return result


def cannot_transform() -> dict[str, dict[str, Any]]:
    """Bloom and Mixtral + LoRA on every linear (experts too), ``engine="auto"``: peft LoRA on
    2 ranks against peft + torch.optim.AdamW in one process on the global batch.

    As one unit (``units=[]``), so that the code ``torch.func`` cannot transform runs under
    it; ``"bloom_in_units"``: Bloom's default units (its decoder layers), where that code runs
    inside units, with plain autograd (an isolated unit), and ``torch.func`` needs no fallback.
    """
    mesh = ff.make_mesh({"dp": 2})
    mixtral = dataclasses.replace(ZOO["mixtral"], lora_targets="all-linear")
    bloom = ZOO["bloom"]
    return {
        "bloom": _noticed(lambda: train_vs_adamw(bloom.build(), bloom, mesh, units=[])),
        "mixtral": _noticed(lambda: train_vs_adamw(mixtral.build(), mixtral, mesh, units=[])),
        "bloom_in_units": _noticed(lambda: train_vs_adamw(bloom.build(), bloom, mesh)),
    }


def _recipe_llama(checkpointing: str) -> nn.Module:
    """The seed recipe's model on the tiny Llama, in training mode: gradient checkpointing
    (``"reentrant"``, as peft's ``prepare_model_for_kbit_training`` turns it on, or
    ``"non_reentrant"``, transformers' default; ``"none"``), peft's input hook, LoRA."""
    model = ZOO["llama"].build().train()
    if checkpointing != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation of the name
            kwargs = {} if checkpointing == "reentrant" else {"use_reentrant": False}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

        def make_inputs_require_grad(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            output.requires_grad_(True)  # peft's prepare_model_for_kbit_training hook

        model.get_input_embeddings().register_forward_hook(make_inputs_require_grad)
    return with_lora(model)


def lora_run(
    model: nn.Module, engine: str, policy: ff.Policy | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    mesh = ff.make_mesh({"dp": 2})
    f = ff.fsdp(model, mesh, policy=policy or ff.Policy())
    opt = ff.adamw(LR, **OPT)
    step = ff.train_step(
        lambda p, b: lm_loss(logits_of(f.apply(p, b[:, :-1])), b[:, 1:]),
        opt,
        model=f,
        engine=engine,
    )
    state = ff.TrainState.create(f.shard(), opt, trainable=f)
    g = torch.Generator().manual_seed(2)
    losses = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_reentrant.*")  # torch's, reentrant
        for _ in range(2):
            state, metrics = step(state, torch.randint(0, 64, (4, 9), generator=g))
            losses.append(float(metrics["loss"]))
    return losses, ff.gather({k: state.params[k] for k in state.trainable})


def gradient_checkpointing() -> dict[str, dict[str, Any]]:
    """The seed recipe with and without Hugging Face checkpointing: losses and LoRA parameters
    after 2 steps against the run without (autograd), and against torch.func without."""
    plain = _recipe_llama("none")
    losses, params = lora_run(copy.deepcopy(plain), "autograd")
    f_losses, f_params = lora_run(plain, "func")
    out = {}
    for kind in ("reentrant", "non_reentrant", "reentrant_in_checkpointed_units"):
        model = _recipe_llama(kind.removesuffix("_in_checkpointed_units"))
        before = _module_state(model)
        # Also inside units that the policy checkpoints (Hugging Face's checkpoint runs as
        # a plain call there: the unit's recompute already recomputes it).
        policy = ff.Policy(activation_checkpointing=kind.endswith("units"))

        def run(model: nn.Module = model, policy: ff.Policy = policy) -> dict[str, Any]:
            got_losses, got = lora_run(model, "auto", policy)
            return {
                "bitwise": got_losses == losses
                and all(torch.equal(got[k], params[k]) for k in got),
                "loss_diff": max(abs(a - b) for a, b in zip(got_losses, losses)),
                "param_diff": _diff(got, params),
                "func_diff": _diff(got, f_params),
                "func_loss_diff": max(abs(a - b) for a, b in zip(got_losses, f_losses)),
                "moved": _diff(got, dict(with_lora(ZOO["llama"].build()).named_parameters())),
            }

        out[kind] = _noticed(run)
        out[kind]["module_kept"] = _module_state(model) == before
    return out


def _module_state(model: nn.Module) -> list[Any]:
    """What train_step must leave as it is: each module's hooks and checkpoint function."""
    return [
        (dict(m._forward_hooks), vars(m).get("_gradient_checkpointing_func"), m.training)
        for m in model.modules()
    ]
