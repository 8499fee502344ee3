"""Worker functions for the real multi-process training tests."""

from __future__ import annotations

import copy

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, lm_loss

from ._fsdp_workers import CFG

STEPS = 10
LR = 1e-2
# eps=1e-6: attention's key bias has an exactly-zero gradient, and Adam with a tiny eps
# turns its rounding noise into O(lr) updates on both sides of a comparison.
OPT = dict(weight_decay=0.1, eps=1e-6)

# (mesh, ff.fsdp kwargs, train_step kwargs; "opt_specs" goes to TrainState.create only)
ZERO1 = dict(opt_specs=ff.P("dp"), accumulate_mode="local")  # the ZeRO paper's stages
ZERO2 = dict(opt_specs=ff.P("dp"))
STRATEGIES = {
    "ddp": ({"dp": 2}, dict(specs=ff.P()), {}),
    "zero1": ({"dp": 2}, dict(specs=ff.P()), ZERO1),
    "zero2": ({"dp": 2}, dict(specs=ff.P()), ZERO2),
    "zero1_accumulate": ({"dp": 2}, dict(specs=ff.P()), dict(ZERO1, accumulate=2)),
    "zero2_accumulate_donate": (
        {"dp": 2},
        dict(specs=ff.P()),
        dict(ZERO2, accumulate=2, donate=True),
    ),
    "shard_grad_op": ({"dp": 2}, dict(policy=ff.Policy(reshard_after_forward=False)), {}),
    "zero3": ({"dp": 2}, {}, {}),
    "hsdp": ({"replicate": 2, "shard": 2}, {}, {}),
    "zero3_accumulate_local": ({"dp": 2}, {}, dict(accumulate=2, accumulate_mode="local")),
    "zero3_accumulate_each": ({"dp": 2}, {}, dict(accumulate=2)),
    "zero3_donate": ({"dp": 2}, {}, dict(donate=True)),
    "zero1_dp4": ({"dp": 4}, dict(specs=ff.P()), ZERO1),
    "zero2_dp4": ({"dp": 4}, dict(specs=ff.P()), ZERO2),
}


def batches(n: int = STEPS, size: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (size, 13), generator=g) for _ in range(n)]


def reference_trajectory(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, full global batch, ff.adamw on plain tensors."""
    torch.manual_seed(0)
    model = GPT(CFG)
    return adamw_trajectory(
        model, {n: p.detach().clone() for n, p in model.named_parameters()}, steps
    )


def adamw_trajectory(
    model: torch.nn.Module, params: dict[str, torch.Tensor], steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` ff.adamw steps of ``model`` from ``params``, one process, full global batch."""
    opt = ff.adamw(LR, **OPT)
    state, losses = opt.init(params), []
    for b in batches(steps):
        grads, loss = torch.func.grad_and_value(
            lambda p: lm_loss(torch.func.functional_call(model, p, (b[:, :-1],)), b[:, 1:])
        )(params)
        updates, state = opt.update(grads, state, params)
        params = ff.apply_updates(params, updates)
        losses.append(loss.item())
    return losses, params


def run_strategy(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    axes, fsdp_kwargs, step_kwargs = STRATEGIES[name]
    step_kwargs = dict(step_kwargs)
    opt_specs = step_kwargs.pop("opt_specs", None)
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = ff.make_mesh(axes)
    f = ff.fsdp(model, mesh, **fsdp_kwargs)
    opt = ff.adamw(LR, **OPT)
    step = ff.train_step(
        lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f, **step_kwargs
    )
    state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
    losses = []
    for b in batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses, ff.gather(state.params)


def compare_strategies(names: list[str]) -> dict[str, tuple[float, float]]:
    """``{name: (max loss diff, max param diff)}`` against the reference trajectory."""
    ref_losses, ref_params = reference_trajectory()
    out = {}
    for name in names:
        losses, params = run_strategy(name)
        out[name] = (
            max(abs(a - b) for a, b in zip(losses, ref_losses)),
            max((params[k] - ref_params[k]).abs().max().item() for k in ref_params),
        )
    return out


def zero3_vs_fsdp2_adamw() -> tuple[float, float]:
    """ZeRO-3 with ff.adamw vs FSDP2 fully_shard with torch.optim.AdamW, 10 steps."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = ff.make_mesh({"dp": 2})
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, **OPT)
    f = ff.fsdp(model, mesh)
    opt = ff.adamw(LR, **OPT)
    step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
    state = ff.TrainState.create(f.shard(), opt)
    loss_diff = 0.0
    rank = torch.distributed.get_rank()
    for b in batches():
        state, metrics = step(state, b)
        local = b[rank * 4 : rank * 4 + 4]
        loss = lm_loss(ref(local[:, :-1]), local[:, 1:])
        loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        ref_loss = ff.all_reduce(loss.detach(), mesh, "dp", op="mean")
        loss_diff = max(loss_diff, abs(float(metrics["loss"]) - ref_loss.item()))
    ours = ff.gather(state.params)
    theirs = {n: p.full_tensor() for n, p in ref.named_parameters()}
    return loss_diff, max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


def determinism() -> bool:
    """Two runs with the same seed give bitwise-identical losses."""
    return run_strategy("zero3")[0] == run_strategy("zero3")[0]


def clip_norm_once(names: list[str], steps: int = 3) -> dict[str, dict]:
    """Per strategy, ``chain(clip_by_global_norm, adamw)`` as train_step runs it (the step's
    gradient norm handed to the clipping) against the same chain behind a plain
    ``GradientTransformation`` (which takes no keywords, so the clipping computes its own
    norm): the collectives of one step, and whether losses and parameters are bitwise equal."""
    out = {}
    for name in names:
        axes, fsdp_kwargs, step_kwargs = STRATEGIES[name]
        step_kwargs = dict(step_kwargs)
        opt_specs = step_kwargs.pop("opt_specs", None)
        runs = {}
        for variant in ("shared", "own"):
            torch.manual_seed(0)
            f = ff.fsdp(GPT(CFG), ff.make_mesh(axes), **fsdp_kwargs)
            opt = ff.chain(ff.clip_by_global_norm(0.05, eps=1e-6), ff.adamw(LR, **OPT))
            if variant == "own":
                opt = ff.GradientTransformation(opt.init, opt.update)
            step = ff.train_step(
                lambda p, b, f=f: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]),
                opt,
                model=f,
                **step_kwargs,
            )
            state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
            losses, comms = [], None
            for b in batches(steps):
                with ff.count_comms() as counted:
                    state, metrics = step(state, b)
                comms = comms or counted.by_kind_and_axis()
                losses.append(float(metrics["loss"]))
            runs[variant] = (losses, ff.gather(dict(state.params)), comms)
        (l1, p1, c1), (l2, p2, c2) = runs["shared"], runs["own"]
        out[name] = {
            "shared": c1,
            "own": c2,
            "bitwise": l1 == l2 and all(torch.equal(p1[k], p2[k]) for k in p1),
        }
    return out


NAN_STEP = 2  # the first micro-step of MultiSteps' second round (the case a flag missed)
NAN_STRATEGIES = [
    "ddp",
    "zero1_accumulate",
    "zero2_accumulate_donate",
    "zero3_accumulate_local",
    "zero3_accumulate_each",
]


def nan_batches(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches with a per-example loss weight: ones, but the last example's is NaN at
    ``NAN_STEP`` (it lives on the last rank, in its last micro-batch)."""
    out = []
    for i, b in enumerate(batches(steps)):
        weight = torch.ones(b.shape[0])
        if i == NAN_STEP:
            weight[-1] = float("nan")
        out.append((b, weight))
    return out


def weighted_lm_loss(logits: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return lm_loss(logits, b[0][:, 1:]) * b[1].mean()


def multi_steps_apply_if_finite() -> ff.GradientTransformation:
    return ff.MultiSteps(ff.apply_if_finite(ff.sgd(0.5), 3), 2).gradient_transformation()


def nan_micro_step(names: list[str]) -> dict[str, dict]:
    """Per strategy, ``MultiSteps(apply_if_finite(sgd), 2)`` under train_step over
    :func:`nan_batches`: the gathered parameters and each step's finite/skipped metrics."""
    out = {}
    for name in names:
        axes, fsdp_kwargs, step_kwargs = STRATEGIES[name]
        step_kwargs = dict(step_kwargs)
        opt_specs = step_kwargs.pop("opt_specs", None)
        torch.manual_seed(0)
        f = ff.fsdp(GPT(CFG), ff.make_mesh(axes), **fsdp_kwargs)
        opt = multi_steps_apply_if_finite()
        step = ff.train_step(
            lambda p, b, f=f: weighted_lm_loss(f.apply(p, b[0][:, :-1]), b),
            opt,
            model=f,
            **step_kwargs,
        )
        state = ff.TrainState.create(f.shard(), opt, opt_specs=opt_specs)
        flags = []
        for b in nan_batches():
            state, metrics = step(state, b)
            flags.append((bool(metrics["finite"]), bool(metrics["skipped"])))
        out[name] = {"params": ff.gather(dict(state.params)), "flags": flags}
    return out
