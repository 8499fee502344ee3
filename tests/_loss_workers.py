"""Worker functions for the token-mean tests: ``(sum, count)`` losses and ``has_aux`` on a
transformers Llama (built from a config) with variable-length data, against one process on
the global batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_fsdp as ff
from functional_fsdp.models import llama_plan
from functional_fsdp.tp.plan import tensor_parallel

from ._tp_hf_workers import VOCAB, new_llama

SEQ = 12
# Counted (labelled) tokens per row: every data rank's share and micro-batch counts a
# different number, one row counts none.
COUNTED = [9, 1, 0, 2, 7, 3, 1, 8]
PROMPT = [2, 5, 3, 4, 1, 6, 2, 3]


def sft_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of prompt, response and right padding; labels -100 but on the response."""
    g = torch.Generator().manual_seed(0)
    rows = len(COUNTED)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    labels = torch.full((rows, SEQ), -100)
    for r, (p, n) in enumerate(zip(PROMPT, COUNTED)):
        labels[r, p : p + n] = torch.randint(1, VOCAB, (n,), generator=g)
        ids[r, p + n + 1 :] = 0  # padding
    return ids, labels


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
    flat = logits.flatten(0, -2).float()
    total = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def aux_of(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    counted = labels != -100
    right = (logits.argmax(-1) == labels) & counted
    return {
        "accuracy": ff.SumCount(right.sum().float(), counted.sum()),  # token-weighted
        "counted_share": counted.float().mean(),  # averaged over ranks and micro-batches
    }


def reference() -> dict[str, Any]:
    """One process, the global batch: the token mean, its gradients and the aux values."""
    model = new_llama()
    params = {n: p.detach() for n, p in model.named_parameters()}
    ids, labels = sft_batch()

    def loss_fn(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        logits = torch.func.functional_call(model, p, (ids,)).logits
        total, count = token_loss(logits, labels)
        return total / count, aux_of(logits, labels)

    grads, (loss, aux) = torch.func.grad_and_value(loss_fn, has_aux=True)(params)
    return {
        "loss": loss,
        "grads": grads,
        "count": (labels != -100).sum(),
        "accuracy": aux["accuracy"].sum / aux["accuracy"].count,
        "counted_share": aux["counted_share"],
    }


# name: (mesh, ff.fsdp kwargs, train_step kwargs; "opt_specs" goes to TrainState.create,
# "jit" wraps the step in ff.jit)
ZERO = dict(specs=ff.P())
CASES: dict[str, tuple[dict[str, int], dict[str, Any], dict[str, Any]]] = {
    "ddp": ({"dp": 2}, ZERO, {}),
    "fsdp": ({"dp": 2}, {}, {}),
    "shard_grad_op": ({"dp": 2}, dict(policy=ff.Policy(reshard_after_forward=False)), {}),
    "zero1_accumulate": (
        {"dp": 2},
        ZERO,
        dict(opt_specs=ff.P("dp"), accumulate=2, accumulate_mode="local"),
    ),
    "zero2_accumulate": ({"dp": 2}, ZERO, dict(opt_specs=ff.P("dp"), accumulate=2)),
    "fsdp_accumulate_each": ({"dp": 2}, {}, dict(accumulate=2)),
    "fsdp_accumulate_local": ({"dp": 2}, {}, dict(accumulate=2, accumulate_mode="local")),
    "autograd_accumulate": ({"dp": 2}, {}, dict(accumulate=2, engine="autograd")),
    "local_batches": ({"dp": 2}, {}, dict(batch="local")),
    "jit": ({"dp": 2}, {}, dict(jit=True)),
    "hsdp": ({"replicate": 2, "shard": 2}, {}, {}),
    "fsdp_dp4_accumulate": ({"dp": 4}, {}, dict(accumulate=2)),
    "zero2_dp4": ({"dp": 4}, ZERO, dict(opt_specs=ff.P("dp"))),
    "tp": ({"dp": 2, "tp": 2}, dict(tp=True), {}),
}


def run_case(name: str, *, mean_of_means: bool = False) -> dict[str, Any]:
    """One SGD step (learning rate 1) of the case's strategy: loss, count, aux and the
    gradients (the old parameters minus the new), gathered."""
    axes, fsdp_kwargs, step_kwargs = CASES[name]
    fsdp_kwargs, step_kwargs = dict(fsdp_kwargs), dict(step_kwargs)
    mesh = ff.make_mesh(axes)
    model = new_llama()
    tp = fsdp_kwargs.pop("tp", False)
    if tp:
        plan = tensor_parallel(model, mesh, llama_plan(model.config))
        fsdp_kwargs = dict(specs=plan.specs, wrappers=plan.wrappers)
    sharded = ff.fsdp(model, mesh, **fsdp_kwargs)
    opt = ff.sgd(1.0)
    opt_specs = step_kwargs.pop("opt_specs", None)
    jit = step_kwargs.pop("jit", False)

    def loss_fn(params: Any, b: tuple[torch.Tensor, torch.Tensor]) -> Any:
        ids, labels = b
        logits = sharded.apply(params, ids).logits
        if tp:  # logits split over the vocabulary: vocabulary-parallel cross entropy
            total = ff.vocab_parallel_cross_entropy(
                logits, labels, mesh, ignore_index=-100, reduction="sum"
            )
            loss = (total, (labels != -100).sum())
            return loss, {"counted_share": (labels != -100).float().mean()}
        total, count = token_loss(logits, labels)
        if mean_of_means:  # each share's token mean, averaged: what DDP/FSDP2 give
            return total / count, aux_of(logits, labels)
        return (total, count), aux_of(logits, labels)

    step = ff.train_step(loss_fn, opt, model=sharded, has_aux=True, **step_kwargs)
    if jit:
        step = ff.jit(step, backend="eager")
    params = sharded.shard()
    state = ff.TrainState.create(params, opt, opt_specs=opt_specs)
    data = sft_batch()
    if step_kwargs.get("batch") == "local":
        data = ff.local_batch(data, sharded)
    new, metrics = step(state, data)
    before, after = ff.gather(params), ff.gather(new.params)
    out = {k: v for k, v in metrics.items() if k in ("loss", "count")}
    out.update({k: v.detach().clone() for k, v in metrics["aux"].items()})
    out["grads"] = {n: (before[n] - after[n]).detach() for n in before}
    return out


def errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Largest absolute differences from the reference (relative for the gradients)."""
    out = {k: (got[k].float() - ref[k].float()).abs().max().item() for k in got if k != "grads"}
    out["grads"] = max(
        ((got["grads"][n] - g).norm() / g.norm().clamp(min=1e-12)).item()
        for n, g in ref["grads"].items()
    )
    return out


def gloo_token_mean(names: list[str]) -> dict[str, dict[str, float]]:
    """Each case's differences from one process on the global batch; and those of the
    mean of per-share means (the scalar loss), which the test expects to be large."""
    ref = reference()
    out = {}
    for name in names:
        mesh_size = 1
        for n in CASES[name][0].values():
            mesh_size *= n
        if mesh_size == dist.get_world_size():
            out[name] = errors(run_case(name), ref)
    if dist.get_world_size() == 2:
        out["mean_of_means"] = errors(run_case("fsdp_accumulate_each", mean_of_means=True), ref)
    return out
