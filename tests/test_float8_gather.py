"""Float8 weight all-gathers (``ff.Float8Gather``, FSDP2 + torchao's): the cast is torchao's
own (its scaling and casting functions are the reference), and the step equals one process
computing with every parameter cast whole and dequantized, on simulated meshes and gloo
ranks; the exact path is untouched; the planner prices the bytes the step sends; a float8
cast that cannot apply is refused with the parameter's path and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_fsdp as ff
from functional_fsdp.fsdp.float8_gather import amax_to_scale

from . import _qgather_workers as W
from .test_quantized_gather import _equal_to_one_process, _exact_untouched_and_quantized_changed

torchao_fp8 = pytest.importorskip("torchao.float8.float8_scaling_utils")
torchao_tensor = pytest.importorskip("torchao.float8.float8_training_tensor")
torchao_utils = pytest.importorskip("torchao.float8.float8_utils")


def _torchao_round_trip(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """torchao's dynamic float8 cast of ``x`` (a weight) and back to ``x``'s dtype."""
    fp8 = torchao_fp8.hp_tensor_to_float8_dynamic(
        x,
        dtype,
        torchao_tensor.LinearMMConfig(),
        gemm_input_role=torchao_tensor.GemmInputRole.WEIGHT,
    )
    return fp8.to_original_precision()


def _emulated(weights: dict[str, torch.Tensor], cast: Any = lambda name: True) -> dict[str, Any]:
    return {n: _torchao_round_trip(w) if cast(n) else w for n, w in weights.items()}


@pytest.mark.parametrize("wire", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_cast_is_torchaos(wire: torch.dtype, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(257, generator=g) * torch.logspace(-4, 3, 257)).to(dtype)
    got = ff.float8_round_trip(x, wire)
    assert got.dtype == dtype
    assert torch.equal(got, _torchao_round_trip(x, wire))
    assert not torch.equal(got, x)  # a real cast: float8 keeps 3 (e4m3) or 2 mantissa bits
    amax = x.abs().amax()
    assert torch.equal(amax_to_scale(amax, wire), torchao_utils.amax_to_scale(amax, wire))
    zeros = torch.zeros(5, dtype=dtype)  # the scale of an all-zero tensor is clamped, as torchao's
    assert torch.equal(ff.float8_round_trip(zeros, wire), _torchao_round_trip(zeros, wire))


@pytest.mark.parametrize(("axes", "checkpointing"), W.CASES)
def test_simulated_step_equals_one_process_on_torchaos_cast(
    axes: dict[str, int], checkpointing: bool
) -> None:
    got, exact = W.on_simulated(axes, checkpointing, ff.Float8Gather())
    _equal_to_one_process({**got, "float8": _emulated(got["weights"])}, "float8")
    _exact_untouched_and_quantized_changed(got, exact)
    # float64 weights: 8 bytes exact, 1 in float8 (plus each piece's padding to 8 bytes).
    assert got["dp_gather_bytes"] < exact["dp_gather_bytes"] / 7
    # One small all-reduce (MAX) of the float64 amaxes per mesh axis the parameters are split
    # over, booked as a ring all-reduce: 2 (n - 1) / n of its bytes.
    amaxes = 8 * len(got["weights"])
    extra = sum(amaxes * 2 * (n - 1) // n for n in axes.values())
    assert got["all_reduce_bytes"] - exact["all_reduce_bytes"] == extra


def test_params_selects_what_is_cast_and_the_rest_is_exact() -> None:
    m, batch = W.model(), W.data()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        got = W.step(mesh, m, batch, option=ff.Float8Gather(params="blocks.*.weight"))
    cast = lambda name: name.startswith("blocks.") and name.endswith(".weight")  # noqa: E731
    assert any(cast(n) for n in got["weights"]) and not all(cast(n) for n in got["weights"])
    _equal_to_one_process({**got, "float8": _emulated(got["weights"], cast)}, "float8")


def test_under_mixed_precision_the_cast_reads_the_fp32_masters() -> None:
    # x = I: the bf16 output is the gathered weight itself (each entry one product by 1).
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        lin.weight[0, 0] = 7.3  # an outlier sets the scale
    policy = ff.Policy(
        mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16),
        gather_quantization=ff.Float8Gather(),
    )
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sharded = ff.fsdp(lin, mesh, policy=policy)
        out = ff.rank_values(sharded.apply(sharded.shard(), torch.eye(8)))[0]
    # torchao casts the fp32 master and dequantizes to the compute dtype (bf16).
    expected = _torchao_round_trip(lin.weight.detach()).to(torch.bfloat16).T
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    # Not the cast of the bf16 copy, which is another amax and other values here.
    assert not torch.equal(out, _torchao_round_trip(lin.weight.detach().bfloat16()).T)


class _WithCounts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.counts = torch.nn.Parameter(torch.arange(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.counts[:4].to(x.dtype)


def test_bad_options_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Float8Gather\(dtype=torch.int8\).*float8_e4m3fn"):
        ff.Float8Gather(dtype=torch.int8)
    with pytest.raises(TypeError, match=r"Float8Gather\(params=3\): pass None"):
        ff.Float8Gather(params=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ff.Float8Gather\(\)"):
        ff.Policy(gather_quantization="float8")  # type: ignore[arg-type]
    m = _WithCounts()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        # Every floating parameter by default: the integer one is gathered as it is.
        sharded = ff.fsdp(m, mesh, policy=ff.Policy(gather_quantization=ff.Float8Gather()))
        x = torch.ones(2, 4)
        sharded.apply(sharded.shard(), x)
        # Selected by name, it is refused with its path, shape, spec, mesh and the fix.
        policy = ff.Policy(gather_quantization=ff.Float8Gather(params="*"))
        sharded = ff.fsdp(m, mesh, policy=policy)
        with pytest.raises(
            ValueError,
            match=r"params\['counts'\] \(shape \(8,\), P\('dp'\), Mesh\(dp=2\)\) is torch.int64, "
            r"and float8 casts floating tensors only. Leave it out of params=",
        ):
            sharded.apply(sharded.shard(), x)


@pytest.mark.multiprocess
def test_gloo_ranks_equal_one_process_and_the_planner_prices_the_bytes(pools: Any) -> None:
    results = pools.run(2, W.float8_on_ranks, {"dp": 2})
    for r in results:
        _equal_to_one_process({**r["float8"], "f8": _emulated(r["float8"]["weights"])}, "f8")
        _equal_to_one_process(r["exact"], "weights")
    r = results[0]
    ratio = r["float8"]["all_gather_bytes"] / r["exact"]["all_gather_bytes"]
    assert 1 / 8 <= ratio < 0.14, ratio  # float64 weights: 1 byte of 8, plus padding
    # The planner prices the same bytes, from shapes: the float8 gathers and the amaxes'
    # all-reduce, priced by running the step's own code on a shapes-only mesh.
    for name, q in (("float8", ff.Float8Gather()), ("exact", None)):
        for kind in ("all_gather", "all_reduce"):
            priced = W.planned_bytes({"dp": 2}, q, kind)
            assert priced == r[name][f"{kind}_bytes"], (name, kind)


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch.compile's, as in test_jit.py
def test_a_traced_step_equals_the_eager_one_bitwise(pools: Any) -> None:
    # ff.jit traces the quantized gathers and the amaxes' all-reduce into the step's graph.
    for option in (ff.Float8Gather(), ff.QuantizedGather(block_size=W.BLOCK)):
        r = pools.run(2, W.traced_equals_eager, option)[0]
        assert r == {"loss": 0.0, "params": 0.0, "comms_equal": True}, (option, r)
