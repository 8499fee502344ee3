"""Worker functions for the randomness and activation-checkpointing tests (gloo processes).

:func:`recompute_check` is the reusable check: give it a model builder, and it compares the
gradients with ``Policy(activation_checkpointing=True)`` against those without, drawn from the same key.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import functional_fsdp as ff
from functional_fsdp.fsdp.units import _plain
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss
from functional_fsdp.tp.plan import tensor_parallel

from ._hf import tiny_llama_config

VOCAB = 96
Builder = Callable[[float], nn.Module]  # dropout probability -> a model in training mode


# --------------------------------------------------------------------------- tiny models


def hf_gpt2(p: float) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def hf_llama(p: float) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, attention_dropout=p))


def project_gpt(p: float) -> nn.Module:
    return GPT(
        GPTConfig(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, block_size=32, dropout=p)
    )


def peft_lora(p: float) -> nn.Module:
    """LoRA (q_proj, v_proj) on the tiny Llama: lora_dropout=0.05 whenever dropout is on."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.05 if p else 0.0,
        init_lora_weights=False,
    )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return get_peft_model(hf_llama(p), lora)


MODELS: dict[str, Builder] = {
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "gpt": project_gpt,
    "peft_lora": peft_lora,
}


def lm_batch(rank: int, rows: int = 2, length: int = 12) -> torch.Tensor:
    """This rank's token ids (different on every rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (rows, length), generator=g)


def lm_loss_of(model: ff.FSDP, params: Any, ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss, for Hugging Face models (labels=) and the project's GPT alike."""
    if isinstance(model.module, GPT):
        return lm_loss(model.apply(params, ids[:, :-1]), ids[:, 1:])
    return model.apply(params, input_ids=ids, labels=ids).loss


# --------------------------------------------------------------------------- the check


Shard = Callable[[nn.Module, Any, ff.Policy], ff.FSDP]  # (model, mesh, policy) -> FSDP


def _fsdp(model: nn.Module, mesh: Any, policy: ff.Policy) -> ff.FSDP:
    return ff.fsdp(model, mesh, policy=policy)


def _grads(
    model: nn.Module,
    mesh: Any,
    policy: ff.Policy,
    key: torch.Tensor,
    loss_of: Callable,
    batch: Any,
    shard: Shard = _fsdp,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    sm = shard(model, mesh, policy)
    train, frozen = ff.partition(sm.shard(), sm)  # the module's requires_grad=True ones

    def loss(t: Any) -> torch.Tensor:
        return loss_of(sm, ff.combine(t, frozen), batch)

    with ff.seeded(key, mesh=mesh, axes=sm.data_axes):
        g, value = torch.func.grad_and_value(loss)(train)
    return {k: v.local for k, v in g.items()}, value.detach()


def recompute_check(
    build: Callable[[], nn.Module],
    mesh: Any,
    batch: Any,
    loss_of: Callable[[ff.FSDP, Any, Any], torch.Tensor] = lm_loss_of,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    check_key: bool = True,
    shard: Shard = _fsdp,
) -> dict[str, Any]:
    """Gradients with ``Policy(activation_checkpointing=True)`` against ``activation_checkpointing=False`` (same key).

    ``build()`` makes the model (in training mode for dropout); ``loss_of(sharded_model,
    params, batch)`` its mean loss on this rank's ``batch``; ``shard(model, mesh, policy)``
    describes the sharded model (default ``ff.fsdp``; pass one with a TP plan for 2D). Each
    rank compares its own
    gradient shards. Returns ``equal`` (bitwise, every shard), ``max_diff``, ``worst`` (the
    parameter of the largest difference), ``loss_equal``, and ``key_matters`` (a second key
    changes the gradients: dropout is live, so ``equal`` really tested the replay; ``None``
    with ``check_key=False``, which saves one gradient computation).

    Example (one rank of a test)::

        out = recompute_check(lambda: hf_gpt2(0.1), ff.make_mesh({"dp": 2}), lm_batch(rank))
        assert out["equal"], out
    """
    torch.manual_seed(seed)
    model = build()
    mp = ff.MixedPrecision(param_dtype=dtype) if dtype != torch.float32 else ff.MixedPrecision()
    key = ff.rng_key(seed)
    runs = {
        ck: _grads(
            model,
            mesh,
            ff.Policy(activation_checkpointing=ck, mixed_precision=mp),
            key,
            loss_of,
            batch,
            shard,
        )
        for ck in (False, True)
    }
    (plain, loss0), (ckpt, loss1) = runs[False], runs[True]
    other = None
    if check_key:
        policy = ff.Policy(mixed_precision=mp)
        other, _ = _grads(model, mesh, policy, ff.fold_in(key, 1), loss_of, batch, shard)
    diffs = {k: (plain[k].float() - ckpt[k].float()).abs().max().item() for k in plain}
    worst = max(diffs, key=diffs.get)
    return {
        "equal": all(torch.equal(plain[k], ckpt[k]) for k in plain),
        "max_diff": diffs[worst],
        "worst": worst,
        "loss_equal": torch.equal(loss0, loss1),
        "key_matters": None
        if other is None
        else any(not torch.equal(plain[k], other[k]) for k in plain),
        "grads": len(plain),
    }


def recompute_matrix(dtypes: list[str], dropouts: tuple[float, ...] = (0.0, 0.1)) -> dict:
    """:func:`recompute_check` for every model, each dropout and dtype (a dp mesh of all ranks)."""
    world = dist.get_world_size()
    mesh = ff.make_mesh({"dp": world})
    batch = lm_batch(dist.get_rank())
    out = {}
    for name, build in MODELS.items():
        for p in dropouts:
            for dtype in dtypes:
                res = recompute_check(
                    lambda b=build, q=p: b(q),
                    mesh,
                    batch,
                    dtype=getattr(torch, dtype),
                    check_key=p > 0,
                )
                out[f"{name}-p{p}-{dtype}"] = res
    return out


# --------------------------------------------------------------------------- masks


class MaskProbe:
    """Records which elements each call of a dropout module zeroed (forward calls only)."""

    def __init__(self, module: nn.Module) -> None:
        self.masks: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        with torch._C._DisableFuncTorch():  # plain tensors, outside the step's transform
            x, y = _plain(args[0]), _plain(out)
            self.masks.append((y == 0) & (x != 0))

    def close(self) -> list[torch.Tensor]:
        self.handle.remove()
        return self.masks


def _gpt_step(mesh: Any, model: GPT, plan: Any = None, accumulate: int = 1):
    if plan is None:
        sm = ff.fsdp(model, mesh)
    else:
        tp = tensor_parallel(model, mesh, plan)
        sm = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
    opt = ff.sgd(0.1)

    def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
        return lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:])

    step = ff.train_step(loss_fn, opt, model=sm, accumulate=accumulate)
    return step, ff.TrainState.create(sm.shard(), opt, rng=7)


def dp_masks(steps: int = 2, accumulate: int = 2) -> dict[str, Any]:
    """Dropout masks drawn under train_step on a dp mesh: per step and micro-batch."""
    torch.manual_seed(0)
    model = project_gpt(0.5)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    step, state = _gpt_step(mesh, model, accumulate=accumulate)
    probe = MaskProbe(model.blocks[0].drop)
    caller = torch.get_rng_state()
    batch = torch.randint(0, VOCAB, (4 * dist.get_world_size(), 9), generator=torch.Generator())
    for _ in range(steps):
        state, _ = step(state, batch)
    masks = probe.close()
    return {
        "masks": masks,  # [step0 mb0 attn, step0 mb0 mlp, step0 mb1 ...]
        "caller_restored": torch.equal(caller, torch.get_rng_state()),
        "rng_kept": torch.equal(state.rng, ff.rng_key(7)),
    }


def dp_masks_simulated(world: int, steps: int = 2, accumulate: int = 2) -> list[list[torch.Tensor]]:
    """:func:`dp_masks` on a simulated mesh: each simulated rank's masks (in this process)."""
    torch.manual_seed(0)
    model = project_gpt(0.5)
    with ff.simulated_mesh({"dp": world}) as mesh:
        step, state = _gpt_step(mesh, model, accumulate=accumulate)
        probe = MaskProbe(model.blocks[0].drop)
        batch = torch.randint(0, VOCAB, (4 * world, 9), generator=torch.Generator())
        for _ in range(steps):
            state, _ = step(state, batch)
        masks = probe.close()
        return [[ff.rank_values(m)[r] for m in masks] for r in range(world)]


class DrawProbe:
    """Draws ``torch.rand(6)`` after each forward call of a module (what dropout there would
    draw from), and records the numbers."""

    def __init__(self, module: nn.Module) -> None:
        self.draws: list[list[float]] = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        with torch._C._DisableFuncTorch():
            self.draws.append(torch.rand(6).tolist())

    def close(self) -> list[list[float]]:
        self.handle.remove()
        return self.draws


def tp_masks(sequence_parallel: bool) -> dict[str, Any]:
    """Masks on a dp=1, tp=N mesh: the residual stream's (replicated, or sequence-sharded),
    and numbers drawn after each block's first colwise linear (which, under sequence
    parallelism, all-gathered its input), gathered from every rank."""
    torch.manual_seed(0)
    model = project_gpt(0.5)
    mesh = ff.make_mesh({"dp": 1, "tp": dist.get_world_size()})
    plan = gpt_plan(model.cfg, sequence_parallel=sequence_parallel, loss_parallel=False)
    step, state = _gpt_step(mesh, model, plan)
    probe = MaskProbe(model.blocks[0].drop)
    draws = [DrawProbe(b.mlp.fc1) for b in model.blocks]
    batch = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator())
    state, _ = step(state, batch)
    masks = probe.close()
    mine = {"masks": [m.tolist() for m in masks], "draws": [d.close() for d in draws]}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"shapes": [tuple(m.shape) for m in masks], "all": gathered}


def global_batch_masks() -> dict[str, Any]:
    """train_step(randomness="global_batch") on the dp mesh vs one process on the global
    batch (the plain module, the same key): each rank's masks are its rows of the latter's."""
    torch.manual_seed(0)
    model = project_gpt(0.5)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm = ff.fsdp(model, mesh)
    opt = ff.sgd(0.0)

    def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
        return lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:])

    step = ff.train_step(loss_fn, opt, model=sm, randomness="global_batch")
    state = ff.TrainState.create(sm.shard(), opt, rng=7)
    batch = torch.randint(0, VOCAB, (4 * dist.get_world_size(), 9), generator=torch.Generator())
    probe = MaskProbe(model.blocks[0].drop)
    _, metrics = step(state, batch)
    mine = probe.close()
    probe = MaskProbe(model.blocks[0].drop)
    with ff.seeded(ff.fold_in(ff.fold_in(ff.rng_key(7), 0), 0)):  # step 0, micro-batch 0
        ref_loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
    whole = probe.close()
    rows = slice(4 * dist.get_rank(), 4 * (dist.get_rank() + 1))
    return {
        "masks_equal": len(mine) == len(whole) == 2
        and all(torch.equal(a, b[rows]) for a, b in zip(mine, whole)),
        "loss_diff": abs(float(metrics["loss"]) - float(ref_loss.detach())),
        "dropped": [float(m.float().mean()) for m in mine],
    }


def tp_recompute(sequence_parallel: bool) -> dict[str, Any]:
    """:func:`recompute_check` on a dp=1, tp=N mesh: the project's GPT, dropout 0.1."""
    mesh = ff.make_mesh({"dp": 1, "tp": dist.get_world_size()})

    def shard(model: nn.Module, mesh: Any, policy: ff.Policy) -> ff.FSDP:
        plan = gpt_plan(model.cfg, sequence_parallel=sequence_parallel, loss_parallel=False)
        tp = tensor_parallel(model, mesh, plan)
        return ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers, policy=policy)

    out = recompute_check(lambda: project_gpt(0.1), mesh, lm_batch(0, rows=2, length=9),
                          shard=shard)  # fmt: skip
    return {**out, "backward_draws": backward_draws(project_gpt(0.1), mesh, shard)}


def _states_equal(a: Any, b: Any) -> bool:
    (gens_a, streams_a), (gens_b, streams_b) = a, b
    if not torch.equal(gens_a[0], gens_b[0]) or (streams_a is None) != (streams_b is None):
        return False
    return streams_a is None or (
        streams_a[1] == streams_b[1] and torch.equal(streams_a[0][0], streams_b[0][0])
    )


def backward_draws(model: nn.Module, mesh: Any, shard: Shard) -> bool:
    """Whether a checkpointed backward moves the generators (either stream, or which one is
    active): the state at the end of the forward against the state after the backward."""
    from functional_fsdp import rng

    sm = shard(model.train(), mesh, ff.Policy(activation_checkpointing=True))
    ids, after_forward = lm_batch(0, rows=2, length=9), []

    def loss(p: Any) -> torch.Tensor:
        out = lm_loss_of(sm, p, ids)
        after_forward.append(rng.get_state())
        return out

    with ff.seeded(ff.rng_key(0), mesh=mesh, axes=sm.data_axes):
        torch.func.grad(loss)(sm.shard())
        return not _states_equal(after_forward[0], rng.get_state())


# --------------------------------------------------------------------------- the zoo


def _dropout_knobs(cfg: Any) -> list[str]:
    """The config's dropout probabilities (``attention_dropout``, ``resid_pdrop``, ...)."""
    return sorted(
        k
        for k, v in vars(cfg).items()
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and not isinstance(v, bool)
    )


def zoo_model(name: str, p: float) -> tuple[nn.Module, list[str]]:
    """The zoo's ``name`` in training mode with every dropout knob of its config set to ``p``
    (fp32, seeded); and the knobs that were set."""
    import transformers

    from ._zoo import ZOO

    arch = ZOO[name]
    cfg = arch.config()
    knobs = _dropout_knobs(cfg)
    for k in knobs:
        setattr(cfg, k, p)
    torch.manual_seed(0)
    return getattr(transformers, arch.cls)(cfg).train(), knobs


def zoo_recompute(
    names: list[str], tp_names: list[str], sp_names: list[str]
) -> dict[str, dict[str, Any]]:
    """:func:`recompute_check` for each zoo model in ``names`` on a dp mesh of all ranks, and
    for each in ``tp_names`` (``sp_names``) on dp=1 x tp=world with ``ff.hf_tp_plan``
    (with ``sequence_parallel=True``; logits gathered): dropout 0.1 wherever the config has a
    knob for it, fp32. Each model is built once."""
    from ._zoo import ZOO

    world = dist.get_world_size()
    dp = ff.make_mesh({"dp": world})
    tp = ff.make_mesh({"dp": 1, "tp": world}) if tp_names or sp_names else None

    def hf_tp(sp: bool) -> Shard:
        def shard(model: nn.Module, mesh: Any, policy: ff.Policy) -> ff.FSDP:
            plan = ff.hf_tp_plan(model, loss_parallel=False, sequence_parallel=sp)
            t = tensor_parallel(model, mesh, plan)
            return ff.fsdp(model, mesh, specs=t.specs, wrappers=t.wrappers, policy=policy)

        return shard

    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys([*names, *tp_names, *sp_names]):
        model, knobs = zoo_model(name, 0.1)
        runs = [("dp", dp, _fsdp, dist.get_rank())] if name in names else []
        runs += [("tp", tp, hf_tp(False), 0)] if name in tp_names else []  # one batch on tp
        runs += [("sp", tp, hf_tp(True), 0)] if name in sp_names else []
        for where, mesh, shard, seed in runs:
            g = torch.Generator().manual_seed(100 + seed)
            batch = torch.randint(0, ZOO[name].vocab, (2, 8), generator=g)
            res = recompute_check(lambda m=model: m, mesh, batch, check_key=bool(knobs),
                                  shard=shard)  # fmt: skip
            out[f"{name}-{where}"] = {**res, "knobs": knobs}
    return out
