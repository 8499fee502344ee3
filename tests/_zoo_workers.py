"""The zoo (:mod:`tests._zoo`) against one process, per mode: FSDP, LoRA training, FSDP + TP.

Each worker builds every model once and runs all its checks in one pool call; results are
plain numbers (and error messages), one dict per architecture.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import functional_fsdp as ff
from functional_fsdp.models import lm_loss
from functional_fsdp.train import local_batch

from ._tp_hf_workers import errors, grad_and_value, logits_of, ours, reference, with_lora
from ._zoo import ZOO, Arch

BATCH, SEQ, STEPS, LR = 4, 8, 2, 1e-2
COMMS = ("llama", "phi")  # "tp_comms" runs on these: attention + MLP blocks, attention only
OPT: dict[str, Any] = dict(weight_decay=0.1, eps=1e-6)


def batch(arch: Arch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, arch.vocab, (BATCH, SEQ), generator=g)
    return idx, torch.randint(0, arch.vocab, (BATCH, SEQ), generator=g)


def fsdp_loss_grads(
    model: nn.Module, mesh: Any, idx: torch.Tensor, tgt: torch.Tensor, engine: str = "func"
):
    """FSDP (one unit per decoder layer, found by ``ff.fsdp``): loss and gathered gradients."""
    f = ff.fsdp(model, mesh)
    params = f.shard()
    x, y = local_batch((idx, tgt), mesh, f.data_axes)
    grads, loss = grad_and_value(lambda p: lm_loss(logits_of(f.apply(p, x)), y), params, engine)
    return ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean"), ff.gather(grads)


def train_vs_adamw(
    model: nn.Module, arch: Arch, mesh: Any, lora: bool = True, units: Any = None
) -> dict[str, Any]:
    """``STEPS`` steps of ff.train_step + ff.adamw against torch.optim.AdamW in one process, on
    the same global batches: on LoRA adapters, or (``lora=False``) on every parameter.
    ``units``: ``ff.fsdp``'s (``None``: its default)."""
    if lora:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's note on GPT-2's Conv1D (fan_in_fan_out)
            peft_model = with_lora(model, target_modules=arch.lora_targets)
    else:
        peft_model = copy.deepcopy(model)
    ref = copy.deepcopy(peft_model)
    f = ff.fsdp(peft_model, mesh, units=units)
    opt = ff.adamw(LR, **OPT)

    def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits_of(f.apply(p, b[:, :-1])), b[:, 1:])

    step = ff.train_step(loss_fn, opt, model=f)
    state = ff.TrainState.create(f.shard(), opt, trainable=f)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    torch_opt = torch.optim.AdamW(trainable, lr=LR, **OPT)
    g = torch.Generator().manual_seed(2)
    loss_diff = 0.0
    for _ in range(STEPS):
        b = torch.randint(0, arch.vocab, (BATCH, SEQ + 1), generator=g)
        state, metrics = step(state, b)
        ref_loss = lm_loss(logits_of(ref(b[:, :-1])), b[:, 1:])
        ref_loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        loss_diff = max(loss_diff, abs(float(metrics["loss"]) - ref_loss.item()))
    full = ff.gather({k: state.params[k] for k in state.trainable})
    theirs = dict(ref.named_parameters())
    return {
        "loss_diff": loss_diff,
        "param_diff": max((v - theirs[k].detach()).abs().max().item() for k, v in full.items()),
        "trainable": len(full),
        "moved": max(
            (v - dict(peft_model.named_parameters())[k].detach()).abs().max().item()
            for k, v in full.items()
        ),
    }


def lora_tp(model: nn.Module, arch: Arch, mesh: Any, engine: str = "func") -> dict[str, Any]:
    """A peft LoRA model with ``ff.hf_tp_plan``: loss and adapter gradients vs one process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note on GPT-2's Conv1D (fan_in_fan_out)
        peft_model = with_lora(model, target_modules=arch.lora_targets)
    idx, tgt = batch(arch)
    plan = ff.hf_tp_plan(peft_model, require_layer_plan=arch.tp_plan)
    return errors(
        ours(peft_model, mesh, plan, idx, tgt, engine=engine),
        reference(peft_model, idx, tgt, engine),
    )


def on_autograd(model: nn.Module, arch: Arch, dp: Any, tp: Any) -> dict[str, Any]:
    """For a model ``torch.func`` cannot differentiate: FSDP (dp = world size), FSDP + TP
    (``hf_tp_plan``, logits split) and LoRA + TP, gradients computed with plain autograd on
    both sides (``train_step(engine="autograd")``'s engine), against one process."""
    idx, tgt = batch(arch)
    want = reference(model, idx, tgt, "autograd")
    plan = ff.hf_tp_plan(model, require_layer_plan=arch.tp_plan)
    return {
        "fsdp": _guarded(lambda: errors(fsdp_loss_grads(model, dp, idx, tgt, "autograd"), want)),
        "tp": _guarded(lambda: errors(ours(model, tp, plan, idx, tgt, engine="autograd"), want)),
        "lora_tp": _guarded(lora_tp, model, arch, tp, "autograd"),
    }


def per_linear(plan: dict[str, ff.Style]) -> dict[str, ff.Style]:
    """``plan`` without :class:`PrepareInput`: each colwise linear all-reduces its own input
    gradient (``hf_tp_plan``'s plan before blocks shared one all-reduce)."""
    return {
        k: dataclasses.replace(s, input="replicated")
        if isinstance(s, ff.ColwiseParallel) and s.input == "prepared"
        else s
        for k, s in plan.items()
        if not isinstance(s, ff.PrepareInput)
    }


def backward_all_reduces(
    model: nn.Module, mesh: Any, plan: dict[str, ff.Style], idx: torch.Tensor, tgt: torch.Tensor
) -> int:
    """All-reduces over tp in one backward pass (a step's, less its forward's)."""
    with ff.count_comms() as step:
        ours(model, mesh, plan, idx, tgt)
    tp = ff.tensor_parallel(model, mesh, plan)
    f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    params = f.shard()
    x, y = local_batch((idx, tgt), mesh, f.data_axes)
    with ff.count_comms() as forward, torch.no_grad():
        ff.vocab_parallel_cross_entropy(logits_of(f.apply(params, x)), y, mesh)
    return step.count("all_reduce", "tp") - forward.count("all_reduce", "tp")


def tp_comms(model: nn.Module, arch: Arch, mesh: Any) -> dict[str, Any]:
    """Backward all-reduces over tp with ``hf_tp_plan`` (one per block) and per linear."""
    idx, tgt = batch(arch)
    plan = ff.hf_tp_plan(model)
    return {
        "shared": backward_all_reduces(model, mesh, plan, idx, tgt),
        "per_linear": backward_all_reduces(model, mesh, per_linear(plan), idx, tgt),
        "blocks": sorted(k for k, s in plan.items() if isinstance(s, ff.PrepareInput)),
        "layers": model.config.num_hidden_layers,
    }


def default_experts(arch: Arch, mesh: Any) -> dict[str, Any]:
    """A MoE model built with ``transformers``' default experts implementation (not eager):
    FSDP + TP with ``hf_tp_plan`` (``ExpertParallel``) against one process."""
    model = arch.build(experts=None)
    idx, tgt = batch(arch)
    plan = ff.hf_tp_plan(model)
    result = errors(ours(model, mesh, plan, idx, tgt), reference(model, idx, tgt))
    return {**result, "implementation": model.config._experts_implementation}


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as e:  # reported per architecture, so one failure does not hide others
        return {"error": f"{type(e).__name__}: {e}"}


def zoo_checks(names: list[str], modes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each model built once, then every mode in ``modes`` against one process:

    - ``"fsdp"``: dp = world size, loss and gathered gradients;
    - ``"lora"``: dp = world size, ``STEPS`` LoRA training steps against torch.optim.AdamW;
    - ``"train"``: the same on every parameter, for the MoE models (their expert weights);
    - ``"tp"`` / ``"tp_gathered"``: (dp = world / 2, tp = 2) with ``ff.hf_tp_plan``, logits
      split over the vocabulary (``vocab_parallel_cross_entropy``) or gathered;
    - ``"lora_tp"``: the same mesh and plan on a peft LoRA model (adapter gradients);
    - ``"tp_sp"``: as ``"tp"``, with ``hf_tp_plan(sequence_parallel=True)``;
    - ``"tp_comms"``: (models in ``COMMS``) backward all-reduces over tp, one per block
      (``hf_tp_plan``) and one per colwise linear;
    - ``"tp_default_experts"``: (MoE models) ``"tp"`` on the model built with
      ``transformers``' default experts implementation (:func:`default_experts`);
    - ``"autograd"``: (models ``torch.func`` cannot differentiate) FSDP, FSDP + TP and
      LoRA + TP with gradients from plain autograd (:func:`on_autograd`).

    A mode that raises reports ``{mode: "error"}`` with the message, not a number.
    """
    world = dist.get_world_size()
    dp = ff.make_mesh({"dp": world}) if {"fsdp", "lora", "train", "autograd"} & set(modes) else None
    tp_modes = {"tp", "tp_gathered", "lora_tp", "tp_sp", "tp_comms", "autograd"}
    tp_modes |= {"tp_default_experts"}
    tp = ff.make_mesh({"dp": world // 2, "tp": 2}) if tp_modes & set(modes) else None
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        arch = ZOO[name]
        model = arch.build()
        idx, tgt = batch(arch)
        result: dict[str, Any] = out.setdefault(name, {})
        want = _guarded(reference, model, idx, tgt)
        for mode in modes:
            if mode == "lora":
                result[mode] = _guarded(train_vs_adamw, model, arch, dp)
            elif mode == "train":  # every parameter, MoE models only (expert weights train)
                if arch.moe:
                    result[mode] = _guarded(train_vs_adamw, model, arch, dp, False)
            elif mode == "lora_tp":
                result[mode] = _guarded(lora_tp, model, arch, tp)
            elif mode == "tp_comms":
                if name in COMMS:
                    result[mode] = _guarded(tp_comms, model, arch, tp)
            elif mode == "tp_default_experts":
                if arch.moe:
                    result[mode] = _guarded(default_experts, arch, tp)
            elif mode == "autograd":
                if not arch.torch_func:
                    result[mode] = _guarded(on_autograd, model, arch, dp, tp)
            elif isinstance(want, dict):  # the reference itself failed
                result[mode] = want
            elif mode == "fsdp":
                result[mode] = _guarded(lambda: errors(fsdp_loss_grads(model, dp, idx, tgt), want))
                result[mode]["parameters"] = len(list(model.parameters()))
            else:
                lp, sp = mode != "tp_gathered", mode == "tp_sp"

                def check(lp: bool = lp, sp: bool = sp) -> dict[str, Any]:
                    plan = ff.hf_tp_plan(
                        model,
                        loss_parallel=lp,
                        require_layer_plan=arch.tp_plan,
                        sequence_parallel=sp,
                    )
                    return errors(ours(model, tp, plan, idx, tgt, loss_parallel=lp), want)

                result[mode] = _guarded(check)
    return out
