"""Quantized gradient reduction (ZeRO++'s qgZ, ``ff.QuantizedReduce``): the step's gradient
equals one process's emulation (every rank's local gradient, the block each rank owns
quantized and dequantized, summed and divided by the ranks), on a simulated mesh and 2 gloo
ranks; the planner prices the all-to-all the step sends; the exact path is untouched."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import lm_loss

from . import _qgather_workers as W
from .test_quantized_gather import _equal_to_one_process

POLICY = ff.Policy(grad_quantization=ff.QuantizedReduce(block_size=W.BLOCK))


def _emulated_grads(n: int) -> dict[str, torch.Tensor]:
    """Each of ``n`` ranks' local gradient (its rows of the batch, one process), the block
    rank ``k`` owns (dim 0 split in ``n``, padded at the end) through int8 blocks, summed
    over the ranks and divided by ``n``."""
    m, batch = W.model(), W.data()
    rows = batch.shape[0] // n
    total: dict[str, torch.Tensor] = {}
    for r in range(n):
        b = batch[r * rows : (r + 1) * rows]
        params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        lm_loss(torch.func.functional_call(m, params, (b[:, :-1],)), b[:, 1:]).backward()
        for name, p in params.items():
            g = p.grad
            chunk = math.ceil(g.shape[0] / n)
            padded = torch.nn.functional.pad(g, [0, 0] * (g.ndim - 1) + [0, n * chunk - g.shape[0]])
            blocks = padded.reshape(n, -1)
            deq = torch.stack(
                [
                    ff.dequantize_blockwise(*ff.quantize_blockwise(row, W.BLOCK), row)
                    for row in blocks
                ]
            )
            total[name] = total.get(name, 0) + deq.reshape(padded.shape)[: g.shape[0]]
    return {name: t / n for name, t in total.items()}


def _check(got: dict[str, Any], exact: dict[str, Any], n: int) -> None:
    want = _emulated_grads(n)
    for name, g in want.items():
        assert float((got["grads"][name] - g).abs().max()) < 1e-12, name
    _equal_to_one_process(exact, "weights")  # the exact path is untouched
    assert any(not torch.allclose(g, exact["grads"][k], atol=1e-9) for k, g in got["grads"].items())
    assert got["loss"] == exact["loss"]  # the forward is exact


def test_bad_options_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"QuantizedReduce\(block_size=0\): a positive number"):
        ff.QuantizedReduce(block_size=0)
    with pytest.raises(TypeError, match=r"pass ff.QuantizedReduce\(block_size=\.\.\.\)"):
        ff.Policy(grad_quantization="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [2, 4])
def test_simulated_step_equals_the_emulated_reduction(n: int) -> None:
    m, batch = W.model(), W.data()
    with ff.simulated_mesh({"dp": n}) as mesh:
        got = W.step(mesh, m, batch, policy=POLICY)
        exact = W.step(mesh, m, batch, quantized=False)
    _check(got, exact, n)
    assert ("reduce_scatter", "dp") not in got["bytes"] and got["bytes"]["all_to_all", "dp"] > 0


@pytest.mark.multiprocess
def test_gloo_ranks_equal_the_emulation_and_the_planner_prices_the_bytes(pools: Any) -> None:
    results = pools.run(2, W.qgz_on_ranks, {"dp": 2}, W.BLOCK)
    for r in results:
        _check(r["qgz"], r["exact"], 2)
    r = results[0]
    # float64 gradients: 8 bytes per element reduce-scattered, 1 + 4 / 32 as int8 blocks
    # (plus each piece's last block's padding).
    ratio = r["qgz"]["bytes"]["all_to_all", "dp"] / r["exact"]["bytes"]["reduce_scatter", "dp"]
    assert (1 + 4 / W.BLOCK) / 8 <= ratio < 0.16, ratio
    # The planner prices the all-to-all the step sends, from shapes.
    priced = W.planned_bytes(
        {"dp": 2}, None, "all_to_all", grad_quantization=POLICY.grad_quantization
    )
    assert priced == r["qgz"]["bytes"]["all_to_all", "dp"]
