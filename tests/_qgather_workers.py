"""Quantized all-gathers (``Policy(gather_quantization=...)``): a step, and what one process
computes with every rank's shards quantized and dequantized. Runs in a simulated mesh or on
gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss

BLOCK = 32
# (mesh, activation checkpointing): the simulated meshes each quantized gather is run on.
CASES = [({"dp": 2}, False), ({"dp": 4}, False), ({"dp": 2, "tp": 2}, False), ({"dp": 2}, True)]
CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=36)  # uneven splits


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CFG).double()


def llama() -> torch.nn.Module:
    """A transformers Llama from a tiny config (never downloaded), in float64."""
    from ._zoo import ZOO

    return ZOO["llama"].build().double()


def logits(out: Any) -> torch.Tensor:
    """A model's logits: our GPT's output, or a transformers output's ``.logits``."""
    return getattr(out, "logits", out)


def data() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))


def _sharded(m: torch.nn.Module, mesh: Any, policy: ff.Policy, specs: Any) -> Any:
    if "tp" in ff.axis_sizes(mesh):
        tp = ff.tensor_parallel(m, mesh, gpt_plan(CFG, loss_parallel=False))
        return ff.fsdp(m, mesh, specs=tp.specs, wrappers=tp.wrappers, policy=policy)
    return ff.fsdp(m, mesh, policy=policy, specs=specs)


def step(
    mesh: Any,
    m: torch.nn.Module,
    batch: torch.Tensor,
    *,
    quantized: bool = True,
    checkpointing: bool = False,
    option: Any = None,
    policy: ff.Policy | None = None,
    specs: Any = None,
    opt_specs: Any = None,
) -> dict[str, Any]:
    """One SGD(1) step: the loss, the gradients (the parameters' change), the all-gather
    and all-reduce bytes this rank sent (and the bytes per collective and axis), the
    weights, and the emulated weights (each rank's shard through quantize_blockwise /
    dequantize_blockwise, gathered). ``specs=ff.P(), opt_specs=ff.P("dp")``: ZeRO-2.

    ``option``: the policy's ``gather_quantization`` (default: ``QuantizedGather(BLOCK)``
    when ``quantized``, else exact gathers); ``policy`` replaces the whole policy."""
    if option is None and quantized:
        option = ff.QuantizedGather(block_size=BLOCK)
    if policy is None:
        policy = ff.Policy(gather_quantization=option, activation_checkpointing=checkpointing)
    sharded = _sharded(m, mesh, policy, specs)
    params = sharded.shard()
    opt = ff.sgd(1.0)
    train = ff.train_step(
        lambda p, b: lm_loss(logits(sharded.apply(p, b[:, :-1])), b[:, 1:]), opt, model=sharded
    )
    with ff.count_comms() as comms:
        new, metrics = train(ff.TrainState.create(params, opt, opt_specs=opt_specs), batch)
    emulated = ff.tree_map(
        lambda s: ff.dequantize_blockwise(*ff.quantize_blockwise(s, BLOCK), s), params
    )
    before, after, emu = ff.gather(params), ff.gather(new.params), ff.gather(emulated)
    first = ff.rank_values
    return {
        "loss": float(first(metrics["loss"])[0]),
        "grads": {n: first(before[n] - after[n])[0] for n in before},
        "emulated": {n: first(v)[0] for n, v in emu.items()},
        "weights": {n: first(v)[0] for n, v in before.items()},
        "all_gather_bytes": comms.bytes("all_gather"),
        "dp_gather_bytes": comms.bytes("all_gather", axis="dp"),  # the weights' (not tp's)
        "all_reduce_bytes": comms.bytes("all_reduce"),
        "bytes": {(r.kind, r.axis): comms.bytes(r.kind, r.axis) for r in comms.records},
        "counts": {(r.kind, r.axis): comms.count(r.kind, r.axis) for r in comms.records},
    }


def on_simulated(
    axes: dict[str, int], checkpointing: bool, option: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quantized step (``option``, default int8 blocks) and an exact one, simulated."""
    m, batch = model(), data()
    with ff.simulated_mesh(axes) as mesh:
        got = step(mesh, m, batch, option=option, checkpointing=checkpointing)
        return got, step(mesh, m, batch, quantized=False)


def on_ranks(axes: dict[str, int]) -> dict[str, Any]:
    mesh = ff.make_mesh(axes)
    m, batch = model(), data()
    return {
        "quantized": step(mesh, m, batch),
        "exact": step(mesh, m, batch, quantized=False),
    }


def float8_on_ranks(axes: dict[str, int], params: Any = None) -> dict[str, Any]:
    """A float8 step and an exact one on this rank's mesh."""
    mesh = ff.make_mesh(axes)
    m, batch = model(), data()
    return {
        "float8": step(mesh, m, batch, option=ff.Float8Gather(params=params)),
        "exact": step(mesh, m, batch, quantized=False),
    }


def planned_bytes(axes: dict[str, int], option: Any, kind: str, **policy: Any) -> int:
    """The bytes of ``kind`` collectives ff.plan prices for :func:`step`'s model and batch."""
    report = ff.plan(
        model(),
        axes,
        policy=ff.Policy(gather_quantization=option, **policy),
        batch=data(),
        optimizer=ff.sgd(1.0),
    )
    return sum(c.bytes for c in report.comms if c.kind == kind)


def traced_equals_eager(option: Any, steps: int = 3) -> dict[str, Any]:
    """``steps`` SGD steps eager and traced (``ff.jit``, replayed op by op) from the same
    state on the same batch, ``option`` a gather's or a reduction's quantization: the
    largest difference of losses and parameters, and whether the collectives are the same."""
    mesh = ff.make_mesh({"dp": torch.distributed.get_world_size()})
    m, batch = model(), data()
    if isinstance(option, ff.QuantizedReduce):
        policy = ff.Policy(grad_quantization=option)
    else:
        policy = ff.Policy(gather_quantization=option)
    sharded = ff.fsdp(m, mesh, policy=policy)
    opt = ff.sgd(0.1)
    step = ff.train_step(
        lambda p, b: lm_loss(sharded.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sharded
    )
    fast = ff.jit(step, backend="eager")
    out: dict[str, Any] = {"loss": 0.0, "params": 0.0, "comms_equal": True}
    eager = traced = ff.TrainState.create(sharded.shard(), opt)
    for _ in range(steps):
        with ff.count_comms() as c_eager:
            eager, m_eager = step(eager, batch)
        with ff.count_comms() as c_traced:
            traced, m_traced = fast(traced, batch)
        out["loss"] = max(out["loss"], abs(float(m_eager["loss"]) - float(m_traced["loss"])))
        out["comms_equal"] &= c_eager.by_kind_and_axis() == c_traced.by_kind_and_axis()
    for a, b in zip(ff.tree_leaves(eager.params), ff.tree_leaves(traced.params)):
        out["params"] = max(out["params"], float((a - b).abs().max()))
    return out


def qgz_on_ranks(
    axes: dict[str, int], option: Any, build: Any = model, **zero: Any
) -> dict[str, Any]:
    """A step with quantized gradient reduction (``option``, a ``QuantizedReduce``) and an
    exact one, on ``build()`` (``zero``: :func:`step`'s ``specs`` and ``opt_specs``)."""
    mesh = ff.make_mesh(axes)
    m, batch = build(), data()
    return {
        "qgz": step(mesh, m, batch, policy=ff.Policy(grad_quantization=option), **zero),
        "exact": step(mesh, m, batch, quantized=False, **zero),
    }
