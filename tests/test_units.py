"""Default units: repeated blocks wherever the model keeps them; a large single-unit model warns."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import functional_fsdp as ff
from functional_fsdp.fsdp.policy import default_units

from . import _units_workers as W


@pytest.mark.multiprocess
def test_gloo_module_dict_layers_get_one_unit_per_block_and_match_one_process(pools):
    for result in pools.run(2, W.gloo_module_dict_units):
        assert result["units"] == ("layers.0", "layers.1", "layers.2"), result
        assert result["loss_diff"] < 1e-6 and result["grad_err"] < 1e-6, result
        assert result["grad_norm"] > 0.1, result
        assert result["gathers"] == 8, result  # per unit forward and backward; the root's too


def test_default_units_in_any_container():
    class Pair(nn.Module):  # repeated blocks as plain attributes
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second, self.head = W.Block(), W.Block(), nn.Linear(16, 1)

    assert default_units(Pair()) == ["first", "second"]
    assert default_units(W.DictLayers()) == ["layers.0", "layers.1", "layers.2"]

    class EncoderDecoder(nn.Module):  # T5: two stacks of one class, each holding a ModuleList
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.blocks = nn.ModuleList(W.Block() for _ in range(2))
            self.decoder = nn.Module()
            self.decoder.blocks = nn.ModuleList(W.Block() for _ in range(2))

    assert default_units(EncoderDecoder()) == [
        "encoder.blocks.0",
        "encoder.blocks.1",
        "decoder.blocks.0",
        "decoder.blocks.1",
    ]
    # A ModuleDict of leaf layers (q/k/v) or of one module (peft's modules_to_save) is no block.
    attn = nn.Module()
    attn.qkv = nn.ModuleDict({n: nn.Linear(4, 4) for n in "qkv"})
    attn.saved = nn.ModuleDict({"default": W.Block()})
    assert default_units(attn) == []
    assert ff.find_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))) == ["0", "2"]


def _meta_two_parts() -> nn.Module:
    with torch.device("meta"):
        model = nn.Module()
        model.encoder = nn.Linear(4096, 4096)
        model.mixer = nn.TransformerEncoderLayer(512, 8)
    return model


def test_a_large_model_left_as_one_unit_warns_with_its_gathered_bytes():
    model = _meta_two_parts()
    total = sum(p.numel() * 4 for p in model.parameters())
    with ff.simulated_mesh({"dp": 2}, shapes_only=True) as mesh:
        with pytest.warns(ff.SingleUnitWarning) as seen:
            f = ff.fsdp(model, mesh)
        assert f.units == ()
        assert f.layout.units[""].gathered_bytes == total
        message = str(seen[0].message)
        gib = f"{total / 1024**2:.2f} MiB"
        assert re.search(
            rf"ff\.fsdp: found no units in Module, so the whole model is one unit: every step "
            rf"gathers all of its parameters at once, {re.escape(gib)} on each rank \(the "
            rf"planner's gathered bytes; an unsharded model's memory\), where its shards at rest "
            rf"are about {re.escape(f'{total / 2 / 1024**2:.2f} MiB')}\. .*Name its blocks: "
            rf"ff\.fsdp\(model, mesh, units=BlockClass\), or module paths such as "
            rf"units=\['encoder', 'mixer'\]",
            message,
        ), message
        # Following the fix: no warning, two units.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ff.fsdp(model, mesh, units=["encoder", "mixer"]).units == ("encoder", "mixer")


def test_small_or_unsplittable_models_do_not_warn():
    with ff.simulated_mesh({"dp": 2}, shapes_only=True) as mesh, warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.device("meta"):
            big_layer = nn.Linear(8192, 8192)  # one layer: nothing to split it into
        assert ff.fsdp(big_layer, mesh).units == ()
        small = nn.Module()
        small.a, small.b = nn.Linear(4, 4), nn.TransformerEncoderLayer(8, 2)
        assert ff.fsdp(small, mesh).units == ()
