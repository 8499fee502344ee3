"""Worker functions for the ZeRO tests: what one real step holds and sends, per strategy.

A strategy is ``(mesh, ff.fsdp kwargs, train_step kwargs)``; ``opt_specs`` goes to
``TrainState.create`` only. In bf16 the optimizer is ``ff.master_weights(adamw)``: parameters
in bf16, fp32 masters with the optimizer state.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff
import functional_fsdp.train as train_module
from functional_fsdp.models import GPT, GPTConfig, lm_loss

# Every dim 0 divides by 4: no padding, so the paper's accounting holds to the byte.
CFG = GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16)
BATCH, SEQ = 8, 13
LR = 1e-2
BF16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)

STRATEGIES: dict[str, tuple[dict[str, int], dict[str, Any], dict[str, Any]]] = {
    "ddp": ({"dp": 2}, dict(specs=ff.P()), {}),
    "zero1": ({"dp": 2}, dict(specs=ff.P()), dict(opt_specs=ff.P("dp"), accumulate_mode="local")),
    "zero2": ({"dp": 2}, dict(specs=ff.P()), dict(opt_specs=ff.P("dp"))),
    "shard_grad_op": ({"dp": 2}, dict(policy=ff.Policy(reshard_after_forward=False)), {}),
    "zero3": ({"dp": 2}, {}, {}),
    "hsdp": ({"replicate": 2, "shard": 2}, {}, {}),
    "ddp_dp4": ({"dp": 4}, dict(specs=ff.P()), {}),
    "zero1_dp4": (
        {"dp": 4},
        dict(specs=ff.P()),
        dict(opt_specs=ff.P("dp"), accumulate_mode="local"),
    ),
    "zero2_dp4": ({"dp": 4}, dict(specs=ff.P()), dict(opt_specs=ff.P("dp"))),
}


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g) for _ in range(n)]


def optimizer(bf16: bool) -> ff.GradientTransformation:
    opt = ff.adamw(LR, weight_decay=0.1, eps=1e-6)
    return ff.master_weights(opt, param_dtype=torch.bfloat16) if bf16 else opt


def setup(
    name: str, bf16: bool, spy: Any = None, masters: bool | None = None
) -> tuple[Any, Any, Any]:
    """``(sharded_model, step, state)`` of a strategy; ``spy(update) -> update`` wraps the
    optimizer's update for the step; ``masters``: fp32 masters (default: with bf16), else
    fp32 parameters at rest computing in bf16."""
    axes, fsdp_kwargs, step_kwargs = STRATEGIES[name]
    step_kwargs = dict(step_kwargs)
    opt_specs = step_kwargs.pop("opt_specs", None)
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = ff.make_mesh(axes)
    fsdp_kwargs = dict(fsdp_kwargs)
    if bf16:
        policy = fsdp_kwargs.pop("policy", ff.Policy())
        fsdp_kwargs["policy"] = ff.Policy(
            reshard_after_forward=policy.reshard_after_forward, mixed_precision=BF16
        )
    f = ff.fsdp(model, mesh, **fsdp_kwargs)
    opt = optimizer(bf16 if masters is None else masters)
    state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
    if spy is not None:
        opt = ff.GradientTransformation(opt.init, spy(opt.update))
    step = ff.train_step(
        lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f, **step_kwargs
    )
    return f, step, state


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ff.tree_leaves(tree) if torch.is_tensor(t))


def measure(names: list[str]) -> dict[tuple[str, bool], dict[str, Any]]:
    """Per ``(strategy, bf16)``: one step's collectives and the bytes it holds at rest: the
    parameters, the gradients (as the optimizer gets them; ZeRO-1: the full gradients summed
    before their reduce-scatter) and the optimizer state."""
    out = {}
    for name in names:
        for bf16 in (False, True):
            seen: dict[str, int] = {}

            def spy(update: Any) -> Any:
                def spied(grads: Any, s: Any, p: Any = None, **kw: Any) -> Any:
                    seen["grads"] = nbytes(grads)
                    return update(grads, s, p, **kw)

                return spied

            _, step, state = setup(name, bf16, spy)
            reduce = train_module.reduce_to_shards

            def reduce_spy(grads: Any, *a: Any) -> Any:
                seen["full_grads"] = nbytes(grads)
                return reduce(grads, *a)

            train_module.reduce_to_shards = reduce_spy
            try:
                with ff.count_comms() as comms:
                    new_state, _ = step(state, batches(1)[0])
            finally:
                train_module.reduce_to_shards = reduce
            out[(name, bf16)] = {
                "comms": comms.by_kind_and_axis(),
                "param_bytes": nbytes(state.params),
                "grad_bytes": seen.get("full_grads", seen["grads"]),
                "opt_state_bytes": nbytes(new_state.opt_state),
                "param_dtypes": sorted({str(v.dtype) for v in state.params.values()}),
            }
    return out


def trajectory(
    name: str, bf16: bool, steps: int, masters: bool | None = None
) -> tuple[list[float], Any, Any]:
    """Losses, the full fp32 values (the masters, if any) and the full parameters."""
    _, step, state = setup(name, bf16, masters=masters)
    losses = []
    for b in batches(steps):
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    has_masters = isinstance(state.opt_state, ff.MasterWeightsState)
    values = ff.gather(dict(state.opt_state.master if has_masters else state.params))
    return losses, {k: v.float() for k, v in values.items()}, ff.gather(dict(state.params))


def bf16_runs(names: list[str], steps: int) -> dict[str, Any]:
    """Per strategy, bf16 compute with fp32 masters against (a) the same bf16 compute with
    fp32 parameters at rest: ``(max loss diff, max master diff)``, and (b) the all-fp32 run:
    ``(max loss diff, max master diff, max bf16-param diff)``; and whether the bf16 params are
    exactly the masters rounded."""
    ref_losses, ref, _ = trajectory("ddp", False, steps)
    out = {}
    for name in names:
        losses, masters, params = trajectory(name, True, steps)
        fp32_losses, fp32_params, _ = trajectory(name, True, steps, masters=False)
        out[name] = {
            "vs_fp32_params": (
                max(abs(a - b) for a, b in zip(losses, fp32_losses)),
                max((masters[k] - fp32_params[k]).abs().max().item() for k in ref),
            ),
            "vs_fp32": (
                max(abs(a - b) for a, b in zip(losses, ref_losses)),
                max((masters[k] - ref[k]).abs().max().item() for k in ref),
                max((params[k].float() - ref[k]).abs().max().item() for k in ref),
            ),
            "rounded": all(torch.equal(params[k], masters[k].to(torch.bfloat16)) for k in params),
        }
    return out


def checkpoint_masters(name: str) -> tuple[bool, bool]:
    """Save a bf16 state with masters after 2 steps, load it into a fresh state and take 2
    more: ``(masters restored bitwise, losses bitwise those of an uninterrupted run)``."""
    data = batches(4)
    _, step, state = setup(name, True)
    straight = []
    for b in data:
        state, m = step(state, b)
        straight.append(float(m["loss"]))
    _, step, state = setup(name, True)
    for b in data[:2]:
        state, _ = step(state, b)
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    ff.checkpoint.save(f"{path[0]}/ckpt", state)
    _, step, template = setup(name, True)
    loaded = ff.checkpoint.load(f"{path[0]}/ckpt", template)
    masters = state.opt_state.master
    same = all(torch.equal(loaded.opt_state.master[k].local, v.local) for k, v in masters.items())
    resumed = straight[:2]
    for b in data[2:]:
        loaded, m = step(loaded, b)
        resumed.append(float(m["loss"]))
    return same, resumed == straight


def clipped_masters_optimizer() -> ff.GradientTransformation:
    clipped = ff.chain(
        ff.clip_by_global_norm(0.5, eps=1e-6), ff.adamw(LR, weight_decay=0.1, eps=1e-6)
    )
    return ff.master_weights(clipped, param_dtype=torch.bfloat16)


def clipped_masters(steps: int = 3) -> dict[str, Any]:
    """ZeRO-3 on dp=2 in bf16 with ``master_weights(chain(clip_by_global_norm, adamw))``: the
    all-reduces of one step, and whether the run with the step's gradient
    norm passed to the clip is bitwise the run whose clip computes its own."""
    opt = clipped_masters_optimizer()

    def without_norm(update: Any) -> Any:  # the inner clip then all-reduces a norm of its own
        def stripped(grads: Any, s: Any, p: Any = None, **kw: Any) -> Any:
            return update(grads, s, p, **{k: v for k, v in kw.items() if k != "grad_norm"})

        return stripped

    out: dict[str, Any] = {}
    for name, make in (("passed", lambda u: u), ("own", without_norm)):
        torch.manual_seed(0)
        model = GPT(CFG)
        f = ff.fsdp(model, ff.make_mesh({"dp": 2}), policy=ff.Policy(mixed_precision=BF16))
        state = ff.TrainState.create(f.shard(), opt)
        spied = ff.GradientTransformationExtraArgs(opt.init, make(opt.update))
        step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), spied, model=f)
        norms = []
        for i, b in enumerate(batches(steps)):
            with ff.count_comms() as comms:
                state, m = step(state, b)
            norms.append(float(m["grad_norm"]))
            if i == 0:
                out[f"{name}/all_reduces"] = comms.by_kind_and_axis()[("all_reduce", "dp")][0]
        out[f"{name}/masters"] = {k: v.local.clone() for k, v in state.opt_state.master.items()}
        out[f"{name}/norms"] = norms
    out["clipped"] = max(out["passed/norms"]) > 0.5  # the clip did scale some step
    return out
