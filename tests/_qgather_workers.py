"""Quantized all-gathers (``Policy(gather_quantization=...)``): a step, and what one process
computes with every rank's shards quantized and dequantized. Runs in a simulated mesh or on
gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss

BLOCK = 32
CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=36)  # uneven splits


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CFG).double()


def data() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))


def _sharded(m: torch.nn.Module, mesh: Any, quantized: bool, checkpointing: bool) -> Any:
    policy = ff.Policy(
        gather_quantization=ff.QuantizedGather(block_size=BLOCK) if quantized else None,
        activation_checkpointing=checkpointing,
    )
    if "tp" in ff.axis_sizes(mesh):
        tp = ff.tensor_parallel(m, mesh, gpt_plan(CFG, loss_parallel=False))
        return ff.fsdp(m, mesh, specs=tp.specs, wrappers=tp.wrappers, policy=policy)
    return ff.fsdp(m, mesh, policy=policy)


def step(
    mesh: Any,
    m: torch.nn.Module,
    batch: torch.Tensor,
    *,
    quantized: bool = True,
    checkpointing: bool = False,
) -> dict[str, Any]:
    """One SGD(1) step: the loss, the gradients (the parameters' change), the all-gather
    bytes this rank sent, the weights, and the emulated weights (each rank's shard through
    quantize_blockwise / dequantize_blockwise, gathered)."""
    sharded = _sharded(m, mesh, quantized, checkpointing)
    params = sharded.shard()
    opt = ff.sgd(1.0)
    train = ff.train_step(
        lambda p, b: lm_loss(sharded.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sharded
    )
    with ff.count_comms() as comms:
        new, metrics = train(ff.TrainState.create(params, opt), batch)
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
    }


def on_ranks(axes: dict[str, int]) -> dict[str, Any]:
    mesh = ff.make_mesh(axes)
    m, batch = model(), data()
    return {
        "quantized": step(mesh, m, batch),
        "exact": step(mesh, m, batch, quantized=False),
    }
