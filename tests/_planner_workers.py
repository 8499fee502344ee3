"""Worker functions for the planner tests: what a real step measures on gloo processes.

Each case is a model, a mesh and ``ff.fsdp``/``train_step`` arguments; :func:`measure` runs
one ``ff.train_step`` inside ``count_comms`` and ``track_memory`` and reports what it saw,
the bytes of the real shards, gradients and optimizer state, and the activation storages a
plain-autograd forward keeps for backward (parameters left out), which is what
``ff.plan`` prices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import functional_fsdp as ff
from functional_fsdp.cp.attention import COMM_LABEL
from functional_fsdp.fsdp.memory import track_memory
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss
from functional_fsdp.train import local_batch

GPT_CFG = GPTConfig(n_layer=2, vocab_size=61, n_embd=36, n_head=3, block_size=16)  # uneven
TP_CFG = GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16)
BATCH, SEQ = 8, 12


CP_KINDS = ("llama_cp", "llama_cp_padded")  # context parallel: a dict batch with position_ids


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    sizes = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    return LlamaConfig(**{**sizes, **overrides})


def build(kind: str, n_layer: int | None = None) -> nn.Module:
    """The model of a case (on the current default device: ``meta`` for the planner), with
    ``n_layer`` blocks instead of the config's if given."""
    if kind == "gpt":
        return GPT(dataclasses.replace(GPT_CFG, n_layer=n_layer or GPT_CFG.n_layer))
    if kind == "gpt_tp":
        return GPT(dataclasses.replace(TP_CFG, n_layer=n_layer or TP_CFG.n_layer))
    if kind == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(llama_config())
    if kind in CP_KINDS:
        from transformers import LlamaForCausalLM

        layers = dict(num_hidden_layers=n_layer) if n_layer else {}
        cfg = llama_config(attn_implementation=ff.cp.register_attention(), **layers)
        return LlamaForCausalLM(cfg)
    raise ValueError(kind)


def tp_plan(kind: str) -> dict:
    """The tensor-parallel plan of a case's model (logits all-gathered: a plain loss)."""
    if kind in CP_KINDS:
        return ff.llama_plan(llama_config(), loss_parallel=False)
    return gpt_plan(TP_CFG, loss_parallel=False)


def vocab(kind: str) -> int:
    return {"gpt": GPT_CFG.vocab_size, "gpt_tp": TP_CFG.vocab_size}.get(kind, 96)


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def call(kind: str, f: Any, params: Any, x: Any) -> Any:
    if kind in CP_KINDS:
        return f.apply(params, **x)
    return f.apply(params, input_ids=x) if kind == "llama" else f.apply(params, x)


def cp_inputs(kind: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model inputs of a context-parallel case: token ids, their global positions and,
    for ``llama_cp_padded``, a padding mask (rows after the first end in padding)."""
    out = {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone()}
    if kind == "llama_cp_padded":
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for r in range(1, BATCH):
            mask[r, SEQ - r % 4 :] = 0
        out["attention_mask"] = mask.to(ids.device)
    return {k: v.to(ids.device) for k, v in out.items()}


def planner_batch(kind: str) -> Any:
    """The global batch as ``ff.plan`` takes it (on meta)."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    if kind in CP_KINDS:
        return cp_inputs(kind, ids)
    return {"input_ids": ids} if kind == "llama" else (ids,)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def optimizer() -> ff.GradientTransformation:
    """The cases' optimizer: clipped AdamW (its clip reuses the norm the step computes)."""
    return ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(1e-3, weight_decay=0.01))


def _setup(case: dict, mesh: Any) -> tuple[Any, Any, Any]:
    """``(sharded model, step, state)`` of ``case`` on ``mesh``."""
    kind = case["model"]
    torch.manual_seed(0)
    model = build(kind, case.get("n_layer"))
    fsdp_kwargs = dict(case.get("fsdp", {}))
    if case.get("tp"):
        # (verify=False: random batches drawn on a simulated mesh differ per rank, tp too)
        tp = ff.tensor_parallel(model, mesh, tp_plan(kind), verify=False)
        fsdp_kwargs.update(specs=tp.specs, wrappers=tp.wrappers, data_axes=tp.data_axes)
    f = ff.fsdp(model, mesh, **fsdp_kwargs)
    opt = optimizer()
    step_kwargs = dict(case.get("step", {}))

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        return lm_loss(logits_of(call(kind, f, p, b[0])), b[1])

    opt_specs = step_kwargs.pop("opt_specs", None)  # the state's, given once
    step = ff.train_step(loss_fn, opt, model=f, **step_kwargs)
    state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
    return f, step, state


def _batch(kind: str) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab(kind), (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, vocab(kind), (BATCH, SEQ), generator=g)
    return (cp_inputs(kind, ids) if kind in CP_KINDS else ids), tgt


def step_comms(case: dict, mesh: Any) -> dict:
    """``count_comms`` of one ``train_step`` of ``case`` on ``mesh``, by kind and axis."""
    _, step, state = _setup(case, mesh)
    with ff.count_comms() as comms:
        step(state, _batch(case["model"]))
    return comms.by_kind_and_axis()


def by_label(comms: ff.CommCounter, label: str) -> dict:
    """``{(kind, axis): (count, bytes)}`` of the records labelled ``label``."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for r in comms.records:
        if r.label == label:
            n, b = out.get((r.kind, r.axis), (0, 0))
            out[(r.kind, r.axis)] = (n + 1, b + r.bytes)
    return out


def measure(case: dict) -> dict:
    """One train_step of ``case``: comms, gathered peak, bytes at rest and activations."""
    kind = case["model"]
    mesh = ff.make_mesh(case["mesh"])
    f, step, state = _setup(case, mesh)
    ids, tgt = _batch(kind)
    with ff.count_comms() as comms, track_memory() as memory:
        new_state, _ = step(state, (ids, tgt))

    def nbytes(tree: Any) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in ff.tree_leaves(tree)
            if isinstance(t, torch.Tensor)
        )

    x, y = local_batch((ids, tgt), mesh, f.data_axes)
    grads = torch.func.grad(lambda p: lm_loss(logits_of(call(kind, f, p, x)), y))(state.params)
    return {
        "comms": comms.by_kind_and_axis(),
        "cp_comms": by_label(comms, COMM_LABEL),
        "gathered_peak": memory.peak_bytes,
        "param_bytes": nbytes(state.params),
        "grad_bytes": nbytes(grads),
        "opt_state_bytes": nbytes(new_state.opt_state),
        "activation_bytes": _activations(kind, f, state.params, x, y),
    }


def _activations(kind: str, f: Any, params: dict, x: torch.Tensor, y: torch.Tensor) -> int:
    """Storages saved for backward by a plain-autograd forward and loss through ``f.apply``,
    less the gathered parameters (recorded by forward pre-hooks on the module copies, which
    share the user's modules' hook dicts) and the shards."""
    param_keys: set[int] = set()

    def pre_hook(module: nn.Module, args: Any) -> None:
        for p in module._parameters.values():
            if isinstance(p, torch.Tensor):
                param_keys.add(_key(p))

    handles = [m.register_forward_pre_hook(pre_hook) for m in f.module.modules()]
    saved: dict[int, int] = {}
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alive.append(t)
        saved.setdefault(_key(t), t.untyped_storage().nbytes())
        return t

    leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
    param_keys.update(_key(t) for t in leaves.values())
    ps = {k: v.replace(leaves[k]) for k, v in params.items()}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(logits_of(call(kind, f, ps, x)), y)
    finally:
        for h in handles:
            h.remove()
    total = sum(b for k, b in saved.items() if k not in param_keys)
    loss.backward()
    return total


def rank() -> int:
    return dist.get_rank()
