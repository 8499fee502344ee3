"""hpZ, a secondary shard within the node (``Policy(reshard_after_forward="gpu")`` on a
``{"node": 2, "gpu": 2}`` mesh, FSDP2's integer ``reshard_after_forward``): the step's loss
and gradients are plain FSDP's, bitwise on the same specs, and FSDP2's with
``reshard_after_forward=2`` to float rounding; the backward's all-gathers stay on the inner
axis; the planner prices the bytes the step sends; bad input is refused with the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_fsdp as ff

from . import _hpz_workers as H


def _same_numbers_and_inner_backward(r: dict[str, Any]) -> None:
    hpz, fsdp, default = r["hpz"], r["fsdp"], r["default"]
    assert hpz["loss"] == fsdp["loss"]
    for name, g in fsdp["grads"].items():
        assert torch.equal(hpz["grads"][name], g), name  # the same specs: bitwise
        assert torch.allclose(default["grads"][name], g, rtol=0, atol=1e-12), name
    # The forward gathers over both axes; the backward over "gpu" only: half the
    # all-gathers (and their bytes) over "node", the same over "gpu".
    node, gpu = ("all_gather", "node"), ("all_gather", "gpu")
    assert fsdp["counts"][node] > 0
    assert hpz["counts"][node] * 2 == fsdp["counts"][node]
    assert hpz["bytes"][node] * 2 == fsdp["bytes"][node]
    assert (hpz["counts"][gpu], hpz["bytes"][gpu]) == (fsdp["counts"][gpu], fsdp["bytes"][gpu])
    # The reductions do not change.
    assert {k: v for k, v in hpz["bytes"].items() if k[0] != "all_gather"} == {
        k: v for k, v in fsdp["bytes"].items() if k[0] != "all_gather"
    }


def test_simulated_hpz_is_plain_fsdp_with_the_backward_gathers_within_the_node() -> None:
    with ff.simulated_mesh(H.AXES) as mesh:
        _same_numbers_and_inner_backward(H.compare(mesh))


@pytest.mark.parametrize("gather", [ff.Float8Gather(), ff.QuantizedGather(block_size=32)])
def test_composes_with_quantized_gathers_and_checkpointing(gather: Any) -> None:
    # The backward gathers the forward's dequantized values over "gpu": the same weights.
    kw = {"gather_quantization": gather, "activation_checkpointing": True}
    with ff.simulated_mesh(H.AXES) as mesh:
        hpz = H.step(mesh, ff.Policy(reshard_after_forward="gpu", **kw))
        fsdp = H.step(mesh, ff.Policy(**kw), specs=ff.P(("gpu", "node")))
    assert hpz["loss"] == fsdp["loss"]
    for name, g in fsdp["grads"].items():
        assert torch.equal(hpz["grads"][name], g), name
    assert hpz["counts"]["all_gather", "node"] * 2 == fsdp["counts"]["all_gather", "node"]


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"reshard_after_forward=2\): True \(ZeRO-3\), False"):
        ff.Policy(reshard_after_forward=2)  # type: ignore[arg-type]
    with ff.simulated_mesh(H.AXES) as mesh:
        with pytest.raises(ValueError, match=r"'nodes' is not a data axis of Mesh\(node=2"):
            H.step(mesh, ff.Policy(reshard_after_forward="nodes"))
        with pytest.raises(
            ValueError,
            match=r"params\['tok_emb.weight'\] \(shape \(61, 36\), P\(\('node', 'gpu'\), None\), "
            r"Mesh\(node=2, gpu=2\)\) is gathered over 'gpu' before another axis.*"
            r"P\(\('gpu', 'node'\)\)",
        ):
            H.step(mesh, ff.Policy(reshard_after_forward="gpu"), specs=ff.P(("node", "gpu")))


@pytest.mark.multiprocess
def test_gloo_ranks_equal_fsdp_and_fsdp2_and_the_planner_prices_the_bytes(pools: Any) -> None:
    results = pools.run(4, H.on_ranks)
    for r in results:
        _same_numbers_and_inner_backward(r)
        ref = r["fsdp2"]
        assert abs(ref["loss"] - r["hpz"]["loss"]) < 1e-12
        for name, g in ref["grads"].items():
            assert torch.allclose(r["hpz"]["grads"][name], g, rtol=0, atol=1e-12), name
    # The planner prices each axis's bytes as the step sends them, from shapes (under hpZ
    # with the specs it picks itself: "gpu" major).
    specs, hpz = ff.P(("gpu", "node")), ff.Policy(reshard_after_forward="gpu")
    assert H.planned(hpz, None) == H.planned(hpz, specs) == results[0]["hpz"]["bytes"]
    assert H.planned(ff.Policy(), specs) == results[0]["fsdp"]["bytes"]
    # And the memory hpZ adds: at the start of the backward the step holds every unit's
    # secondary shard (each parameter as gathered over "node", padded), which plain FSDP
    # does not, less the one such tensor plain FSDP holds while it gathers the last block
    # again over "node" then "gpu" (hpZ's backward starts from the secondary shard). The
    # planner prices the first (the secondary shards, in gathered_peak), not the second (a
    # gather's intermediate, which it prices for neither).
    planned = H.planned_peak(hpz) - H.planned_peak(ff.Policy(), specs)
    intermediate = H.intermediate_bytes("blocks.1")
    assert 0 < intermediate < planned
    for r in results:
        measured = r["peaks"]["hpz"] - r["peaks"]["fsdp"]
        assert measured == planned - intermediate, (measured, planned, intermediate)
