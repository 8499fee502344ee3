"""torch's tensor-parallel API accepted as written: plans in torch's styles, translated.

The reference model is torchtitan's Llama3 (its package), parallelized by torchtitan's own
``apply_tp`` (torch's ``parallelize_module``) and ``apply_fsdp`` (``fully_shard``).
"""

from __future__ import annotations

import importlib.util

import pytest
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
)

from . import _torch_tp_workers as W

needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan (a test-only dependency in the dev extra) is not installed",
)


@needs_torchtitan
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "sequence_parallel, loss_parallel", [(False, False), (True, True)], ids=["tp", "tp+sp+loss"]
)
def test_torchtitan_llama3_with_the_tutorial_plan_in_torch_styles(
    pools, sequence_parallel, loss_parallel
):
    runs = pools.run(4, W.compare, sequence_parallel, loss_parallel)
    for r in runs:
        assert r["loss_vs_single"] < 1e-5 and r["loss_vs_titan"] < 1e-5, r
        assert r["grad_vs_single"] < 1e-5 and r["grad_vs_titan"] < 1e-5, r
        assert r["param_vs_single"] < 2e-4 and r["param_vs_titan"] < 2e-4, r
        assert r["losses"][-1] < r["losses"][0], r  # the five steps train
    print({k: max(r[k] for r in runs) for k in runs[0] if k != "losses"})


@pytest.mark.multiprocess
def test_every_torch_style_matches_torchs_dtensor_run(pools):
    # The embedding dim split, gathered outputs, a rowwise layer scattering its input and
    # reduce-scattering its output, sequence-parallel norms, a keyword input gathered and an
    # output scattered (PrepareModuleInputOutput), a gather for replicated compute, and
    # vocabulary-parallel logits (torch's loss_parallel; here vocab_parallel_cross_entropy).
    for r in pools.run(4, W.toy_compare):
        assert r["loss_vs_single"] < 1e-5 and r["loss_vs_torch"] < 1e-5, r
        assert r["grad_vs_single"] < 1e-5 and r["grad_vs_torch"] < 1e-5, r
        assert r["styles"] == [
            "ColwiseEmbedding", "ColwiseParallel", "GatherInput", "PrepareInputThen",
            "RowwiseParallel", "SequenceParallel",
        ], r  # fmt: skip


# --------------------------------------------------------------------------- translation


def _translate(plan, model=None):
    import functional_fsdp as ff

    return ff.from_torch_plan(model if model is not None else W.Toy(), plan, 2)


def test_torch_styles_translate_to_this_librarys():
    import functional_fsdp as ff
    from functional_fsdp.tp import torch_styles as T

    got = _translate(W.toy_plan())
    assert got["emb"] == T.ColwiseEmbedding(output="replicated")
    assert got["up"] == ff.ColwiseParallel(output="replicated")
    assert got["down"] == ff.RowwiseParallel(input="replicated", output="sequence")
    assert got["norm"] == got["norm2"] == ff.SequenceParallel()
    assert got["inner"] == T.PrepareInputThen(
        sequence_dim=1, input_kwarg="h", output=T.RedistributeOutput(op="scatter", dim=1)
    )
    # The colwise linear inside a PrepareModuleInput reads the prepared input: its input
    # gradient is reduced once, by the prepare (as DTensor does), not twice.
    assert got["inner.proj1"] == ff.ColwiseParallel(input="prepared")
    assert got["inner.proj2"] == ff.RowwiseParallel()
    assert got["pool"] == T.GatherInput(dim=1)  # no colwise inside: replicated compute
    assert got["head"] == ff.ColwiseParallel()
    # torch's defaults: RowwiseParallel(input_layouts=Replicate()) on an embedding is the
    # vocabulary-parallel embedding; output_layouts=Shard(1) enters sequence parallelism.
    emb = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
    assert _translate(emb)["emb"] == ff.VocabParallelEmbedding(output="sequence")
    # Logits that tp does not divide: vocab-sharded with -inf padding, as torch's uneven shards.
    head = nn.Linear(4, 5)
    assert _translate(ColwiseParallel(), head)[""] == ff.ColwiseParallel(padded=True)


def test_plans_match_modules_as_parallelize_module_does():
    model = nn.Sequential(nn.ModuleDict({"a": W.Inner(4, 6), "b": W.Inner(4, 6)}))
    flat = {"0.*.proj1": ColwiseParallel(), "0.*.proj2": RowwiseParallel()}
    nested = {"0": {"*": {"proj1": ColwiseParallel(), "proj2": RowwiseParallel()}}}
    assert _translate(flat, model) == _translate(nested, model)
    assert sorted(_translate(flat, model)) == ["0.a.proj1", "0.a.proj2", "0.b.proj1", "0.b.proj2"]
    # "*" matches one level of children, as in parallelize_module (not "0.a.proj1").
    with pytest.raises(ValueError, match=r"plan entry '\*\.proj1' matches no submodule"):
        _translate({"*.proj1": ColwiseParallel()}, model)
    # A plan that is one style applies to the module itself.
    assert list(_translate(ColwiseParallel(), nn.Linear(4, 6))) == [""]


class _MyColwise(ColwiseParallel):
    """A subclass (as torchao's Float8ColwiseParallel is): its own semantics, not translated."""


class _Custom(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module

    def __repr__(self):
        return "_Custom()"


@pytest.mark.parametrize(
    "plan, match",
    [
        (
            {"up": ColwiseParallel(output_layouts=Partial())},
            r"plan entry 'up' gives module 'up' \(Linear\) torch's ColwiseParallel\("
            r"input_layouts=\(Replicate\(\),\), output_layouts=\(Partial\(sum\),\).*Partial\(\) "
            r"layouts have no equivalent",
        ),
        (
            {"up": ColwiseParallel(output_layouts=Shard(1))},
            r"plan entry 'up' .* output_layouts=Shard\(dim=1\) would need an all-to-all",
        ),
        (
            {"down": RowwiseParallel(input_layouts=Shard(1))},
            r"plan entry 'down' .* input_layouts=Shard\(dim=1\) would need an all-to-all",
        ),
        (
            {"emb": RowwiseParallel()},
            r"plan entry 'emb' gives module 'emb' \(Embedding\).*torch's default for "
            r"RowwiseParallel is Shard\(-1\).*write input_layouts=Replicate\(\)",
        ),
        (
            {"emb": ColwiseParallel(input_layouts=Shard(1))},
            r"plan entry 'emb' .* its ids' layout is Shard\(dim=1\)",
        ),
        (
            {"norm": ColwiseParallel()},
            r"plan entry 'norm' gives module 'norm' \(LayerNorm\).*takes an nn.Linear or an "
            r"nn.Embedding, not a LayerNorm",
        ),
        (
            {"pool": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(2))},
            r"plan entry 'pool' .* PrepareModuleInput\(input_layouts=\(Shard\(dim=1\),\).*"
            r"input 0: Shard\(dim=1\) -> Shard\(dim=2\) would need an all-to-all",
        ),
        (
            {
                "pool": PrepareModuleInput(
                    input_layouts=(None, Shard(1)), desired_input_layouts=(None, Replicate())
                )
            },
            r"plan entry 'pool' .* it redistributes inputs \[1\]; this library prepares one "
            r"input",
        ),
        (
            {
                "pool": PrepareModuleOutput(
                    output_layouts=Partial(), desired_output_layouts=Replicate()
                )
            },
            r"plan entry 'pool' .* PrepareModuleOutput\(.*output 0: Partial\(\) layouts",
        ),
        (
            {"up": _MyColwise()},
            r"plan entry 'up' .* _MyColwise is not one of torch's styles",
        ),
        ({"up": _Custom()}, r"plan entry 'up' .* torch's _Custom\(\), but _Custom is not one"),
        (
            {"layers.*": {"wq": ColwiseParallel()}},
            r"plan entry 'layers.\*' matches no submodule \(Toy\); torch's parallelize_module "
            r"would skip it",
        ),
        (
            {"inner": {"proj3": ColwiseParallel()}},
            r"plan entry 'inner' -> 'proj3' matches no submodule of 'inner' \(Inner\).*did you "
            r"mean \['proj2', 'proj1'\]",
        ),
        (
            {"up": ColwiseParallel(), "u*": RowwiseParallel()},
            r"module 'up' \(Linear\) is given ColwiseParallel\(.*\) by plan entry 'up' and "
            r"RowwiseParallel\(.*\) by plan entry 'u\*'",
        ),
    ],
    ids=[
        "partial", "colwise-all-to-all", "rowwise-all-to-all", "rowwise-embedding-ids",
        "colwise-embedding-ids", "wrong-module", "prepare-all-to-all", "second-input",
        "output-partial", "subclass", "custom", "no-match", "nested-no-match", "conflict",
    ],
)  # fmt: skip
def test_torch_styles_without_an_equivalent_raise_naming_the_entry(plan, match):
    with pytest.raises(ValueError, match=match):
        _translate(plan)


def test_a_plan_value_that_is_no_style_raises():
    with pytest.raises(TypeError, match=r"plan entry 'inner' -> 'proj1' maps to 'colwise' \(str\)"):
        _translate({"inner": {"proj1": "colwise"}})


def test_tensor_parallel_takes_torch_plans_and_parallelize_module_a_mesh_slice():
    import torch

    import functional_fsdp as ff

    model = W.Toy()
    with ff.simulated_mesh({"dp": 2, "tp": 2}) as mesh:
        ported = ff.parallelize_module(model, mesh["tp"], W.toy_plan())
        direct = ff.tensor_parallel(model, mesh, W.toy_plan())
        assert ported.specs == direct.specs and ported.axis == "tp"
        assert ported.specs["emb.weight"] == ff.P("dp", "tp")  # the embedding dim split
        assert ported.specs["head.weight"] == ff.P(("tp", "dp"), None)
        with pytest.raises(ValueError, match=r"plan entry 'norm' gives module 'norm'"):
            ff.tensor_parallel(model, mesh, {"norm": ColwiseParallel()})
    assert isinstance(model.up.weight, torch.nn.Parameter)  # the model is untouched
    assert type(model.up.weight) is torch.nn.Parameter
