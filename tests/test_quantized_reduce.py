"""Quantized gradient reduction (ZeRO++'s qgZ, ``ff.QuantizedReduce``): the step's gradient
equals one process's emulation (every rank's local gradient, the block each rank owns
quantized and dequantized, summed over the ranks hop by hop, requantized between hops, and
divided by the ranks), int8 and 4-bit, one hop and ZeRO++'s two, on simulated meshes and
on 2 and 4 gloo ranks; the planner prices the all-to-alls the step sends; the exact path is
untouched."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.models import lm_loss

from . import _qgather_workers as W
from .test_quantized_gather import _equal_to_one_process

INT8 = ff.QuantizedReduce(block_size=W.BLOCK)
INT4 = ff.QuantizedReduce(block_size=W.BLOCK, bits=4)
MAJOR_FIRST = ff.QuantizedReduce(block_size=W.BLOCK, hierarchical=False)


def _local_grads(n: int, build: Any = W.model) -> list[dict[str, torch.Tensor]]:
    """Each of ``n`` ranks' local gradient: one process, on that rank's rows of the batch."""
    m, batch = build(), W.data()
    rows = batch.shape[0] // n
    out = []
    for r in range(n):
        b = batch[r * rows : (r + 1) * rows]
        params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        out_r = torch.func.functional_call(m, params, (b[:, :-1],))
        lm_loss(W.logits(out_r), b[:, 1:]).backward()
        out.append({name: p.grad for name, p in params.items()})
    return out


def _chunks(g: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Dim 0 split in ``n`` equal blocks, zero-padded at the end (a shard's layout)."""
    chunk = math.ceil(g.shape[0] / n)
    padded = torch.nn.functional.pad(g, [0, 0] * (g.ndim - 1) + [0, n * chunk - g.shape[0]])
    return list(padded.split(chunk))


def _qdq(x: torch.Tensor, option: ff.QuantizedReduce) -> torch.Tensor:
    q, scale = ff.quantize_blockwise(x, option.block_size, bits=option.bits)
    return ff.dequantize_blockwise(q, scale, x)


def _emulated_grads(
    axes: dict[str, int], option: ff.QuantizedReduce, *, hpz: bool = False, build: Any = W.model
) -> dict[str, torch.Tensor]:
    """The mean gradient as ``option`` reduces it over a ``{"major": N[, "minor": G]}`` data
    mesh, emulated in one process: blocks quantized where a rank sends them, summed where
    they arrive; with two axes, minor axis first if ``option.hierarchical``. A leading
    ``"replicate"`` axis (HSDP) sums its groups' results exactly.

    ``hpz``: hpZ's layout (``reshard_after_forward`` the minor axis) splits each dim over the
    minor axis first, so the exact reduction's order is already the node's first."""
    groups = axes.get("replicate", 1)
    sizes = [size for axis, size in axes.items() if axis != "replicate"]
    n, g = sizes + [1] * (2 - len(sizes))
    local = _local_grads(groups * n * g, build)
    if hpz:  # ranks (i, j) as the layout orders them, (j, i)
        local = [local[i * g + j] for j in range(g) for i in range(n)]
        n, g, option = g, n, dataclasses.replace(option, hierarchical=False)
    sums = [_reduced(local[k * n * g : (k + 1) * n * g], n, g, option) for k in range(groups)]
    return {name: sum(s[name] for s in sums) / (groups * n * g) for name in sums[0]}


def _reduced(
    local: list[dict[str, torch.Tensor]], n: int, g: int, option: ff.QuantizedReduce
) -> dict[str, torch.Tensor]:
    """The sum of ``local`` (ranks ``(i, j)`` of an ``n`` x ``g`` data mesh, row-major) as
    ``option`` reduces it (see :func:`_emulated_grads`)."""
    out = {}
    for name, full in local[0].items():
        # a[i][j][k]: rank (i, j)'s block for node k; b[i][j][k][l]: its block for rank (k, l).
        a = [[_chunks(local[i * g + j][name], n) for j in range(g)] for i in range(n)]
        b = [[[_chunks(a[i][j][k], g) for k in range(n)] for j in range(g)] for i in range(n)]
        final = [[None] * g for _ in range(n)]
        for i in range(n):
            for j in range(g):
                if g == 1:  # one hop
                    final[i][j] = sum(_qdq(b[k][0][i][j], option) for k in range(n))
                elif option.hierarchical:  # node k's sum within it, requantized, sent to i
                    within = [
                        sum(_qdq(b[k][jj][i][j], option) for jj in range(g)) for k in range(n)
                    ]
                    final[i][j] = sum(_qdq(w, option) for w in within)
                else:  # the major hop, then the minor
                    node = [sum(_qdq(a[k][jj][i], option) for k in range(n)) for jj in range(g)]
                    final[i][j] = sum(_qdq(_chunks(node[jj], g)[j], option) for jj in range(g))
        rows = torch.cat([torch.cat(final[i])[: a[0][0][0].shape[0]] for i in range(n)])
        out[name] = rows[: full.shape[0]]
    return out


def _check(
    got: dict[str, Any],
    exact: dict[str, Any],
    want: dict[str, torch.Tensor],
    exact_want: dict[str, torch.Tensor] | None = None,
) -> None:
    """The quantized step's gradients are ``want``; the exact step's are one process's
    (``exact_want``, or our GPT's reference)."""
    for name, g in want.items():
        assert float((got["grads"][name] - g).abs().max()) < 1e-12, name
    if exact_want is None:
        _equal_to_one_process(exact, "weights")  # the exact path is untouched
    else:
        for name, g in exact_want.items():
            assert float((exact["grads"][name] - g).abs().max()) < 1e-12, name
    assert any(not torch.allclose(g, exact["grads"][k], atol=1e-9) for k, g in got["grads"].items())
    assert got["loss"] == exact["loss"]  # the forward is exact


def test_bad_options_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"QuantizedReduce\(block_size=0\): a positive number"):
        ff.QuantizedReduce(block_size=0)
    with pytest.raises(ValueError, match=r"QuantizedReduce\(bits=2\): 8 \(int8 blocks\) or 4"):
        ff.QuantizedReduce(bits=2)
    with pytest.raises(ValueError, match=r"block_size=33, bits=4\).*use block_size=34"):
        ff.QuantizedReduce(block_size=33, bits=4)
    with pytest.raises(TypeError, match=r"pass ff.QuantizedReduce\(block_size=\.\.\.\)"):
        ff.Policy(grad_quantization="int8")  # type: ignore[arg-type]


def test_four_bit_blocks_round_trip_within_half_a_step() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    q, scale = ff.quantize_blockwise(x, 64, bits=4)
    assert q.abs().max() == 7 and scale.dtype == torch.float32
    back = ff.dequantize_blockwise(q, scale, x)
    step = scale.double().repeat_interleave(64)[:1000]
    assert ((back - x).abs() <= step / 2 + 1e-12).all()
    # On the wire: two values per byte, and back to the same values.
    codec = INT4._codec()
    wire = codec.pack([x, x[:10]])
    blocks = math.ceil(1000 / W.BLOCK) + 1  # each piece's blocks start at its first element
    assert wire.numel() == blocks * 4 + blocks * W.BLOCK // 2  # float32 scales, then nibbles
    same = codec.unpack(wire.view(1, -1), [1000, 10], torch.float64)[0]
    want = torch.cat([_qdq(x, INT4), _qdq(x[:10], INT4)])
    assert torch.equal(same, want)


@pytest.mark.parametrize(
    ("axes", "option"),
    [
        ({"dp": 2}, INT8),
        ({"dp": 4}, INT8),
        ({"dp": 2}, INT4),
        ({"node": 2, "gpu": 2}, INT8),
        ({"node": 2, "gpu": 2}, MAJOR_FIRST),
        ({"node": 2, "gpu": 2}, INT4),
        ({"replicate": 2, "shard": 2}, INT8),
    ],
    ids=["dp2", "dp4", "dp2-4bit", "2x2-two-hops", "2x2-major-first", "2x2-4bit", "hsdp"],
)
def test_simulated_step_equals_the_emulated_reduction(axes: dict[str, int], option: Any) -> None:
    m, batch = W.model(), W.data()
    with ff.simulated_mesh(axes) as mesh:
        got = W.step(mesh, m, batch, policy=ff.Policy(grad_quantization=option))
        exact = W.step(mesh, m, batch, quantized=False)
    _check(got, exact, _emulated_grads(axes, option))
    assert not any(kind == "reduce_scatter" for kind, _ in got["bytes"])
    sharded = [axis for axis in axes if axis != "replicate"]
    assert all(got["bytes"]["all_to_all", axis] > 0 for axis in sharded)
    # HSDP's replicas are all-reduced exactly, as without the option.
    replicas = ("all_reduce", "replicate")
    assert got["bytes"].get(replicas) == exact["bytes"].get(replicas)


@pytest.mark.parametrize("option", [INT8, INT4], ids=["int8", "4bit"])
def test_with_hpz_the_reduction_goes_within_the_node_first_as_it_comes(option: Any) -> None:
    # hpZ (reshard_after_forward="gpu") lays each dim out over "gpu" first: the exact
    # reduction's order is already within the node first, quantized hop by hop.
    m, batch = W.model(), W.data()
    policy = ff.Policy(grad_quantization=option, reshard_after_forward="gpu")
    with ff.simulated_mesh({"node": 2, "gpu": 2}) as mesh:
        got = W.step(mesh, m, batch, policy=policy)
        exact = W.step(mesh, m, batch, quantized=False)
    _check(got, exact, _emulated_grads({"node": 2, "gpu": 2}, option, hpz=True))
    assert got["bytes"]["all_to_all", "node"] < got["bytes"]["all_to_all", "gpu"]


def test_with_tensor_parallelism_only_the_dp_reduction_is_quantized() -> None:
    m, batch = W.model(), W.data()
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        got = W.step(mesh, m, batch, policy=ff.Policy(grad_quantization=INT8))
        exact = W.step(mesh, m, batch, quantized=False)
    assert {k: v for k, v in got["bytes"].items() if k[1] == "tp"} == {
        k: v for k, v in exact["bytes"].items() if k[1] == "tp"
    }
    assert got["bytes"]["all_to_all", "dp"] < exact["bytes"]["reduce_scatter", "dp"] / 6
    assert got["loss"] == exact["loss"]
    for name, g in exact["grads"].items():  # within int8 blocks' rounding of the dp sum
        assert float((got["grads"][name] - g).abs().max()) <= 0.01 * float(g.abs().max()), name


@pytest.mark.multiprocess
def test_gloo_ranks_equal_the_emulation_and_the_planner_prices_the_bytes(pools: Any) -> None:
    results = pools.run(2, W.qgz_on_ranks, {"dp": 2}, INT8)
    want = _emulated_grads({"dp": 2}, INT8)
    for r in results:
        _check(r["qgz"], r["exact"], want)
    r = results[0]
    # float64 gradients: 8 bytes per element reduce-scattered, 1 + 4 / 32 as int8 blocks
    # (plus each piece's last block's padding).
    ratio = r["qgz"]["bytes"]["all_to_all", "dp"] / r["exact"]["bytes"]["reduce_scatter", "dp"]
    assert (1 + 4 / W.BLOCK) / 8 <= ratio < 0.16, ratio
    # The planner prices the all-to-all the step sends, from shapes.
    priced = W.planned_bytes({"dp": 2}, None, "all_to_all", grad_quantization=INT8)
    assert priced == r["qgz"]["bytes"]["all_to_all", "dp"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("option", [INT8, INT4], ids=["int8", "4bit"])
def test_two_hops_on_four_gloo_ranks_cut_the_bytes_between_nodes(pools: Any, option: Any) -> None:
    axes = {"node": 2, "gpu": 2}
    results = pools.run(4, W.qgz_on_ranks, axes, option)
    want = _emulated_grads(axes, option)
    for r in results:
        _check(r["qgz"], r["exact"], want)
    got, exact = results[0]["qgz"]["bytes"], results[0]["exact"]["bytes"]
    # Between nodes: 1/2 of the gradient (the minor hop's sums), quantized, against the exact
    # reduce-scatter's whole gradient in float64; within the node, the whole gradient.
    bpe = option.bytes_per_element()
    assert (
        bpe / 8 / 2
        <= got["all_to_all", "node"] / exact["reduce_scatter", "node"]
        < 1.3 * bpe / 8 / 2
    )
    assert got["all_to_all", "gpu"] > got["all_to_all", "node"]
    for axis in axes:
        priced = W.planned_bytes(axes, None, "all_to_all", grad_quantization=option)
        assert priced == sum(got["all_to_all", a] for a in axes), axis


@pytest.mark.multiprocess
def test_a_transformers_llama_reduces_in_two_hops_on_four_gloo_ranks(pools: Any) -> None:
    # A model nobody here wrote (tied-free Llama with GQA, built from a config), 4-bit.
    axes = {"node": 2, "gpu": 2}
    results = pools.run(4, W.qgz_on_ranks, axes, INT4, W.llama)
    want = _emulated_grads(axes, INT4, build=W.llama)
    local = _local_grads(4, W.llama)
    exact_want = {name: sum(g[name] for g in local) / 4 for name in local[0]}
    for r in results:
        _check(r["qgz"], r["exact"], want, exact_want)
    got, exact = results[0]["qgz"]["bytes"], results[0]["exact"]["bytes"]
    assert got["all_to_all", "node"] < got["all_to_all", "gpu"]
    assert ("reduce_scatter", "node") in exact and ("reduce_scatter", "node") not in got


@pytest.mark.multiprocess
def test_hsdp_on_four_gloo_ranks_quantizes_the_shard_axis_only(pools: Any) -> None:
    axes = {"replicate": 2, "shard": 2}
    results = pools.run(4, W.qgz_on_ranks, axes, INT4)
    want = _emulated_grads(axes, INT4)
    for r in results:
        _check(r["qgz"], r["exact"], want)
        replicas = r["qgz"]["bytes"]["all_reduce", "replicate"]
        assert replicas == r["exact"]["bytes"]["all_reduce", "replicate"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("option", [INT8, INT4], ids=["int8", "4bit"])
def test_zero2_reduces_through_the_same_blocks_on_gloo_ranks(pools: Any, option: Any) -> None:
    # ZeRO-2 (the paper's): replicated parameters, the gradients reduce-scattered onto the
    # optimizer's shards, here as quantized blocks.
    zero2 = dict(specs=ff.P(), opt_specs=ff.P("dp"))
    results = pools.run(2, W.qgz_on_ranks, {"dp": 2}, option, **zero2)
    want = _emulated_grads({"dp": 2}, option)
    for r in results:
        _check(r["qgz"], r["exact"], want)
        assert ("all_to_all", "dp") in r["qgz"]["bytes"]
        assert ("reduce_scatter", "dp") not in r["qgz"]["bytes"]


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch.compile's, as in test_jit.py
def test_a_traced_step_equals_the_eager_one_bitwise(pools: Any) -> None:
    # ff.jit traces the quantization, the all-to-all and the dequantized sums into the graph.
    r = pools.run(2, W.traced_equals_eager, INT4)[0]
    assert r == {"loss": 0.0, "params": 0.0, "comms_equal": True}, r
