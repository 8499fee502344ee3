"""Context parallelism (``ff.cp``) on transformers models, against transformers' own ``sdpa``
attention and loss on one process. Each case runs in a simulated mesh or on gloo ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch

import functional_fsdp as ff

from ._hf import tiny_llama_config, tiny_qwen2_config

VOCAB = 96
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def model(arch: str = "llama", impl: str = "sdpa", **overrides: Any) -> torch.nn.Module:
    """A tiny float64 transformers model, the same weights for every ``impl``."""
    import transformers

    options = dict(max_position_embeddings=512, use_cache=False, **overrides)
    if arch == "llama":
        cfg, cls = tiny_llama_config(**options), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tiny_qwen2_config(**options), transformers.Qwen2ForCausalLM
    else:  # mistral, gemma: the same sizes through their own configs
        name = {"mistral": "Mistral", "gemma": "Gemma"}[arch]
        sizes = tiny_llama_config(**options).to_dict()
        keep = {k: sizes[k] for k in (*_SIZES, *options)}
        cfg = getattr(transformers, f"{name}Config")(**keep, head_dim=8)
        cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(0)
    m = cls(cfg).double()
    if impl != "sdpa":
        m = copy.deepcopy(m)
        m.set_attn_implementation(impl)
    return m


def batch(kind: str, rows: int = 4, length: int = 64) -> dict[str, torch.Tensor]:
    """A global batch: ``full`` rows, ``packed`` documents (position_ids restart, labels -100
    at each document's first token), right-``padded`` or ``left_padded`` rows (an
    attention_mask)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = ids.clone()
    out: dict[str, torch.Tensor] = {"input_ids": ids}
    if kind == "packed":
        pos = torch.empty_like(ids)
        for r in range(rows):
            cuts = sorted({0, *torch.randint(1, length, (r + 1,), generator=g).tolist()})
            for a, b in zip(cuts, [*cuts[1:], length]):
                pos[r, a:b] = torch.arange(b - a)
                labels[r, a] = -100
        out["position_ids"] = pos
    elif kind in ("padded", "left_padded"):
        mask = torch.ones_like(ids)
        for r in range(1, rows):
            mask[r, length - 7 * r :] = 0
        if kind == "left_padded":
            mask = mask.flip(1)
            # No token is predicted from padding: the first real token is not a target
            # (what a pad query attends to differs between attention implementations).
            labels[:, 1:][mask[:, 1:].bool() & ~mask[:, :-1].bool()] = -100
        labels[mask == 0] = -100
        out["attention_mask"] = mask
        out["position_ids"] = torch.arange(length).expand(rows, length).clone()
    else:
        out["position_ids"] = torch.arange(length).expand(rows, length).clone()
    out["labels"] = labels
    return out


def cp_batch(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch as a context-parallel step takes it: labels shifted over the whole sequence
    before the split (a rank's last token predicts the next rank's first)."""
    out = {k: v for k, v in b.items() if k != "labels"}
    out["shift_labels"] = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]
    return out


def reference(arch: str, kind: str, **kw: Any) -> dict[str, Any]:
    """transformers' own sdpa attention and ``labels=`` loss on the global batch."""
    m = model(arch, "sdpa", **kw.pop("config", {}))
    b = batch(kind, **kw)
    inputs = {k: v for k, v in b.items() if not (kind == "packed" and k == "attention_mask")}
    out = m(**inputs)
    out.loss.backward()
    return {
        "loss": float(out.loss.detach()),
        "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
    }


LAYOUTS: dict[str, dict[str, int]] = {
    "cp2": {"cp": 2},
    "cp4": {"cp": 4},
    "dp2_cp2": {"dp": 2, "cp": 2},
    "cp2_tp2": {"cp": 2, "tp": 2},
    "dp2_cp2_tp2": {"dp": 2, "cp": 2, "tp": 2},
    "hsdp_cp2": {"replicate": 2, "shard": 2, "cp": 2},
}


def inputs(arch: str, kind: str, **kw: Any) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The context-parallel model and global batch of a case (made outside any simulated
    mesh: the same values on every rank)."""
    m = model(arch, ff.cp.register_attention(), **kw.pop("config", {}))
    return m, cp_batch(batch(kind, **kw))


def step(
    mesh: Any,
    m: torch.nn.Module,
    global_batch: dict[str, torch.Tensor],
    *,
    accumulate: int = 1,
    checkpointing: bool = False,
    jit: bool = False,
    zero2: bool = False,
    hf_checkpointing: bool = False,
) -> dict[str, Any]:
    """One SGD(1) step of the token-mean loss on ``mesh``: its loss and gradients (the
    parameters' change), gathered. ``zero2``: the ZeRO paper's (parameters replicated, the
    optimizer state sharded over the last data axis)."""
    policy = ff.Policy(activation_checkpointing=checkpointing)
    engine = "auto"
    if hf_checkpointing:  # transformers' own (torch.utils.checkpoint): plain autograd
        m = copy.deepcopy(m)
        m.activation_checkpointing_enable()
        m.train()
        engine = "autograd"
    vocab_mesh = None
    if "tp" in ff.axis_sizes(mesh):
        tp = ff.tensor_parallel(m, mesh, ff.hf_tp_plan(m))
        sharded = ff.fsdp(m, mesh, specs=tp.specs, wrappers=tp.wrappers, policy=policy)
        vocab_mesh = mesh  # the head's logits are this rank's block of the vocabulary
    else:
        sharded = ff.fsdp(m, mesh, policy=policy, specs=ff.P() if zero2 else None)

    def loss_fn(params: Any, b: dict[str, torch.Tensor]) -> Any:
        inputs = {k: v for k, v in b.items() if k != "shift_labels"}
        logits = sharded.apply(params, **inputs).logits
        return ff.causal_lm_loss(logits, shift_labels=b["shift_labels"], mesh=vocab_mesh)

    opt = ff.sgd(1.0)
    train = ff.train_step(loss_fn, opt, model=sharded, accumulate=accumulate, engine=engine)
    if jit:  # traced into one graph; the eager backend spares inductor's compile time
        train = ff.jit(train, backend="eager")
    params = sharded.shard()
    opt_specs = ff.P(sharded.data_axes[-1]) if zero2 else None
    state = ff.TrainState.create(params, opt, trainable=sharded, opt_specs=opt_specs)
    new, metrics = train(state, global_batch)
    before, after = ff.gather(params), ff.gather(new.params)
    return {
        "loss": float(ff.rank_values(metrics["loss"])[0]),
        "grads": {n: ff.rank_values(before[n] - after[n])[0] for n in before},
    }


GLOO_LENGTH = 256  # tokens per sequence on real ranks


def on_ranks(cases: list[tuple[str, str, str, dict[str, Any]]]) -> dict[str, Any]:
    """Each (layout, arch, kind, options) case on this process group, on sequences of
    ``GLOO_LENGTH`` tokens."""
    out: dict[str, Any] = {}
    meshes: dict[str, Any] = {}
    for layout, arch, kind, options in cases:
        if layout not in meshes:
            meshes[layout] = ff.make_mesh(LAYOUTS[layout])
        m, b = inputs(arch, kind, length=GLOO_LENGTH)
        out[f"{layout}/{arch}/{kind}/{sorted(options.items())}"] = step(
            meshes[layout], m, b, **options
        )
    return out


def _train_state(mesh: Any) -> tuple[Any, Any, Any]:
    m, b = inputs("llama", "packed")
    sharded = ff.fsdp(m, mesh)

    def loss_fn(params: Any, x: dict[str, torch.Tensor]) -> Any:
        args = {k: v for k, v in x.items() if k != "shift_labels"}
        return ff.causal_lm_loss(
            sharded.apply(params, **args).logits, shift_labels=x["shift_labels"]
        )

    opt = ff.adamw(1e-2)
    state = ff.TrainState.create(sharded.shard(), opt, trainable=sharded)
    return ff.train_step(loss_fn, opt, model=sharded), state, b


def checkpoint_save(path: str) -> dict[str, Any]:
    """Two steps on dp x cp, saved after the first; the second step's loss and the state."""
    step, state, b = _train_state(ff.make_mesh({"dp": 2, "cp": 2}))
    state, _ = step(state, b)
    ff.checkpoint.save(path, state)
    state, metrics = step(state, b)
    return {"loss": float(metrics["loss"]), "params": ff.gather(state.params)}


def checkpoint_resume(path: str, axes: dict[str, int]) -> dict[str, Any]:
    """The saved state loaded on another mesh, one more step."""
    step, like, b = _train_state(ff.make_mesh(axes))
    state = ff.checkpoint.load(path, like)
    state, metrics = step(state, b)
    return {"loss": float(metrics["loss"]), "params": ff.gather(state.params)}
