"""The library's side of tests/test_optax.py: optimizers by case name, the gradient sequences,
and the run on 2 gloo ranks with sharded leaves (an uneven (7, 3) weight split by rows, a
(3, 7) one split by columns, a one-element leaf replicated)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.optim import elementwise, factored, wrappers
from functional_fsdp.optim import schedules as fs
from functional_fsdp.optim.clipping import global_norm_and_finite

STEPS = 9
SCHEDULE = dict(init_value=0.0, peak_value=3e-2, warmup_steps=3, decay_steps=10, end_value=1e-3)
# w: split along its longest dim (rows); c: along its longest (columns); r: along its shorter
# dim (rows); each unevenly.
SPECS = {"w": ff.P("dp"), "c": ff.P(None, "dp"), "r": ff.P("dp"), "b": ff.P(), "v": ff.P("dp")}


def params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (7, 3), "c": (3, 7), "r": (3, 5), "b": (1,), "v": (5,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def grads(steps: int = STEPS, nan_at: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Gradient sequences whose norm goes over and under 1.0 (the clipping cases' limit)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        scale = 0.15 if i % 3 else 0.6
        step = {k: scale * torch.randn(v.shape, generator=g) for k, v in params().items()}
        if nan_at == i:
            step["w"][2, 1] = float("nan")
        out.append(step)
    return out


def decay_matrices(p: Any) -> dict[str, bool]:
    """optax's mask form, fn(params): decay the 2-D leaves only."""
    return {k: v.ndim > 1 for k, v in p.items()}


def labels(p: Any) -> dict[str, str]:
    return {k: "adam" if v.ndim > 1 else "sgd" for k, v in p.items()}


CASES: dict[str, Callable[[], ff.GradientTransformation]] = {
    "sgd": lambda: ff.sgd(0.1),
    "sgd_nesterov": lambda: ff.sgd(0.05, 0.9, True),
    "adam": lambda: ff.adam(1e-2),
    "adam_eps_root_nesterov": lambda: ff.adam(1e-2, 0.8, 0.95, 1e-6, 1e-8, nesterov=True),
    "adam_mu_bf16": lambda: ff.adam(1e-2, mu_dtype=torch.bfloat16),
    "adamw_defaults": lambda: ff.adamw(1e-2),
    "adamw_mask_fn": lambda: ff.adamw(1e-2, weight_decay=0.3, mask=decay_matrices),
    "adamw_schedule": lambda: ff.adamw(fs.warmup_cosine_decay_schedule(**SCHEDULE)),
    "clip_sgd": lambda: ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.1)),
    "clip_elementwise": lambda: ff.chain(elementwise.clip(0.2), ff.sgd(0.1)),
    "zero_nans": lambda: ff.chain(elementwise.zero_nans(), ff.sgd(0.1)),
    "ema": lambda: ff.chain(elementwise.ema(0.9), ff.sgd(0.1)),
    "lion": lambda: elementwise.lion(1e-2),
    "lamb": lambda: elementwise.lamb(1e-2, weight_decay=0.01),
    "lamb_mask_fn": lambda: elementwise.lamb(1e-2, weight_decay=0.5, mask=decay_matrices),
    "lion_mask_fn": lambda: elementwise.lion(1e-2, weight_decay=0.5, mask=decay_matrices),
    "multi_transform": lambda: wrappers.multi_transform(
        {"adam": ff.adam(1e-2), "sgd": ff.sgd(0.1, 0.9)}, labels
    ),
    "inject_hyperparams": lambda: wrappers.inject_hyperparams(ff.adamw)(
        learning_rate=fs.warmup_cosine_decay_schedule(**SCHEDULE), weight_decay=0.01
    ),
    "apply_if_finite": lambda: ff.apply_if_finite(ff.sgd(0.1), 2),
    "adafactor": lambda: factored.adafactor(1e-2, min_dim_size_to_factor=2),
    "adafactor_momentum_decay": lambda: factored.adafactor(
        1e-2, 3, momentum=0.9, weight_decay_rate=0.1, weight_decay_mask=decay_matrices
    ),
    "multi_steps": lambda: wrappers.MultiSteps(ff.adam(1e-2), 3),
    "multi_steps_sum_schedule": lambda: wrappers.MultiSteps(
        ff.sgd(0.1, 0.9), lambda step: 2 if step < 2 else 3, use_grad_mean=False
    ),
    # apply_if_finite inside each wrapper that forwards keyword arguments: its decision must
    # come from the updates it receives, whatever train_step's finite= says of the step's.
    "multi_steps_apply_if_finite": lambda: wrappers.MultiSteps(
        ff.apply_if_finite(ff.sgd(0.1), 3), 2
    ).gradient_transformation(),
    "chain_clip_apply_if_finite": lambda: ff.chain(
        ff.clip_by_global_norm(1.0), ff.apply_if_finite(ff.adam(1e-2), 2)
    ),
    "masked_apply_if_finite": lambda: ff.chain(
        ff.masked(ff.apply_if_finite(ff.sgd(0.1), 2), decay_matrices), elementwise.zero_nans()
    ),
    "multi_transform_apply_if_finite": lambda: wrappers.multi_transform(
        {
            "adam": ff.apply_if_finite(ff.adam(1e-2), 2),
            "sgd": ff.chain(elementwise.zero_nans(), ff.sgd(0.1)),
        },
        labels,
    ),
    "apply_if_finite_inject_hyperparams": lambda: ff.apply_if_finite(
        wrappers.inject_hyperparams(ff.adamw)(
            learning_rate=fs.warmup_cosine_decay_schedule(**SCHEDULE), weight_decay=0.01
        ),
        2,
    ),
    "inject_hyperparams_apply_if_finite": lambda: wrappers.inject_hyperparams(
        lambda learning_rate: ff.apply_if_finite(ff.sgd(learning_rate), 2)
    )(learning_rate=fs.warmup_cosine_decay_schedule(**SCHEDULE)),
}

# Where each case's gradients are not finite: {step: [(leaf, index, value)]}.
BAD = {
    "apply_if_finite": {2: [("w", (0, 0), 1e20)], 5: [("c", (1, 1), float("nan"))]},
    # a NaN on the first micro-step of a round (the case train_step's flag missed), then on
    # the last, and an inf that overflows nothing else
    "multi_steps_apply_if_finite": {
        4: [("w", (2, 1), float("nan"))],
        7: [("c", (1, 1), float("inf"))],
    },
    "chain_clip_apply_if_finite": {3: [("r", (0, 4), float("nan"))]},
    # a NaN outside the mask (zeroed after it) must not skip the masked leaves' step; one
    # inside must
    "masked_apply_if_finite": {3: [("v", (1,), float("nan"))], 6: [("w", (3, 0), float("nan"))]},
    # a NaN in the sgd group (zeroed there) must not skip the adam group; one in it must
    "multi_transform_apply_if_finite": {
        2: [("v", (0,), float("nan"))],
        5: [("c", (2, 6), float("nan"))],
    },
    "apply_if_finite_inject_hyperparams": {1: [("w", (0, 0), float("nan"))]},
    "inject_hyperparams_apply_if_finite": {4: [("b", (0,), float("inf"))]},
}


def case_grads(name: str) -> list[dict[str, torch.Tensor]]:
    if name == "zero_nans":
        return grads(nan_at=4)
    out = grads()
    for i, bad in BAD.get(name, {}).items():
        for leaf, index, value in bad:
            out[i][leaf][index] = value
    return out


def run(name: str, p: Any, steps: list[Any], *, extras: bool = False) -> Any:
    return run_opt(CASES[name](), p, steps, extras=extras)


def run_opt(
    opt: ff.GradientTransformation, p: Any, steps: list[Any], *, extras: bool = False
) -> Any:
    """``opt`` over ``steps`` from ``p``. With ``extras``, each update also gets the keyword
    arguments train_step passes: the gradients' global norm and per-element finiteness."""
    state = opt.init(p)
    for g in steps:
        kwargs = {}
        if extras:
            norm, finite = global_norm_and_finite(g)
            kwargs = dict(grad_norm=norm, finite=finite)
        updates, state = opt.update(g, state, p, **kwargs)
        p = ff.apply_updates(p, updates)
    return p


def on_two_ranks(names: list[str]) -> dict[str, Any]:
    """Each case on sharded leaves, gathered; and the per-element finiteness across ranks."""
    mesh = ff.make_mesh({"dp": 2})
    out = {}
    for name in names:
        p = ff.shard(params(), mesh, SPECS)
        steps = [ff.shard(g, mesh, SPECS) for g in case_grads(name)]
        for extras in (False, True):
            got = ff.gather(run(name, p, steps, extras=extras))
            out[name, extras] = {k: v.clone() for k, v in got.items()}
    # A 1e20 on rank 0's block, NaN on rank 1's: each rank's count reaches the other.
    rank = torch.distributed.get_rank()
    big = {k: torch.ones(v.shape) for k, v in params().items()}
    big["w"][0, 0] = 1e20  # row 0 lives on rank 0
    sharded = ff.shard(big, mesh, SPECS)
    out["huge_finite"] = [x.item() for x in global_norm_and_finite(sharded)]
    bad = dict(big)
    bad["w"] = big["w"].clone()
    bad["w"][6, 0] = float("nan")  # row 6 lives on rank 1
    out["nan_on_rank_1"] = [x.item() for x in global_norm_and_finite(ff.shard(bad, mesh, SPECS))]
    # A one-element leaf split over 2 ranks: rank 1's block is all padding (empty).
    tiny = ff.shard({"x": torch.tensor([1e20])}, mesh, ff.P("dp"))
    out["empty_block"] = [x.item() for x in global_norm_and_finite(tiny)]
    out["rank"] = rank
    return out
