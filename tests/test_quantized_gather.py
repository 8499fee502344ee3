"""Quantized weight all-gathers (ZeRO++'s qwZ, ``ff.QuantizedGather``): the step equals one
process computing with every rank's shard quantized and dequantized, on simulated meshes and
gloo ranks, for FSDP, uneven shards, FSDP + TP and activation checkpointing; the bytes sent
are what the format says; the exact path is untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import lm_loss

from . import _qgather_workers as W


def _one_process(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The loss and gradients of one process computing with ``weights``."""
    m, batch = W.model(), W.data()
    params = {n: w.clone().requires_grad_() for n, w in weights.items()}
    loss = lm_loss(torch.func.functional_call(m, params, (batch[:, :-1],)), batch[:, 1:])
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad for n, p in params.items()}}


def _equal_to_one_process(got: dict[str, Any], weights: str = "emulated") -> None:
    """The step's loss and gradients are one process's computing with ``got[weights]``."""
    ref = _one_process(got[weights])
    assert abs(got["loss"] - ref["loss"]) < 1e-6  # the metric is float32
    for name, g in ref["grads"].items():
        assert float((got["grads"][name] - g).abs().max()) < 1e-12, name


def test_blockwise_int8_round_trip_is_within_half_a_step() -> None:
    x = torch.randn(1000, dtype=torch.float64) * torch.logspace(-3, 3, 1000, dtype=torch.float64)
    q, scale = ff.quantize_blockwise(x, 64)
    assert q.dtype == torch.int8 and q.shape == (16, 64) and scale.dtype == torch.float32
    back = ff.dequantize_blockwise(q, scale, x)
    step = scale.double().repeat_interleave(64)[:1000]
    assert ((back - x).abs() <= step / 2 + 1e-12).all()
    # Each block's largest value comes back to float32 rounding of its scale.
    amax = torch.nn.functional.pad(x, (0, 24)).view(16, 64).abs().amax(1)
    assert torch.allclose(scale.double() * 127, amax, rtol=1e-6)
    zeros = torch.zeros(10)
    assert ff.dequantize_blockwise(*ff.quantize_blockwise(zeros, 4), zeros).eq(0).all()


def test_bad_options_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"QuantizedGather\(block_size=0\): a positive number"):
        ff.QuantizedGather(block_size=0)
    with pytest.raises(TypeError, match=r"pass ff.QuantizedGather\(block_size=\.\.\.\)"):
        ff.Policy(gather_quantization="int8")  # type: ignore[arg-type]


def _exact_untouched_and_quantized_changed(got: dict[str, Any], exact: dict[str, Any]) -> None:
    _equal_to_one_process(exact, "weights")  # the exact path is untouched
    # The quantization is real: other gradients than the exact step's.
    assert any(not torch.allclose(g, exact["grads"][n], atol=1e-9) for n, g in got["grads"].items())


@pytest.mark.parametrize(("axes", "checkpointing"), W.CASES)
def test_simulated_step_equals_one_process_on_dequantized_shards(
    axes: dict[str, int], checkpointing: bool
) -> None:
    got, exact = W.on_simulated(axes, checkpointing)
    _equal_to_one_process(got)
    _exact_untouched_and_quantized_changed(got, exact)
    assert got["all_gather_bytes"] < exact["all_gather_bytes"] / 4


def test_checkpointing_recomputes_with_the_same_quantized_weights() -> None:
    m, batch = W.model(), W.data()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        plain = W.step(mesh, m, batch)
        ckpt = W.step(mesh, m, batch, checkpointing=True)
    for name, g in plain["grads"].items():
        assert torch.equal(g, ckpt["grads"][name]), name


@pytest.mark.multiprocess
def test_gloo_ranks_equal_one_process_and_the_planner_prices_the_bytes(pools: Any) -> None:
    for axes in ({"dp": 2},):
        for r in pools.run(2, W.on_ranks, axes):
            _equal_to_one_process(r["quantized"])
            _equal_to_one_process(r["exact"], "weights")
            # float64 weights: 8 bytes exact, 1 + 4 / 32 quantized, plus each piece's last
            # block's padding.
            ratio = r["quantized"]["all_gather_bytes"] / r["exact"]["all_gather_bytes"]
            assert (1 + 4 / W.BLOCK) / 8 <= ratio < 0.16, ratio
    # The planner prices the same bytes, from shapes.
    for name, q in (("quantized", ff.QuantizedGather(block_size=W.BLOCK)), ("exact", None)):
        assert W.planned_bytes({"dp": 2}, q, "all_gather") == r[name]["all_gather_bytes"], name
