"""init_sharded's errors suggest the model's own initialisation, or describe the fix; never a
placeholder value (``torch.nn.init.ones_`` on a rotary cache would train silently wrong)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functional_fsdp as ff

from . import _init_advice_workers as W


def _error(model: nn.Module, mesh) -> str:
    with pytest.raises(ValueError) as e:
        ff.init_sharded(ff.fsdp(model, mesh))
    return str(e.value)


@pytest.mark.multiprocess
def test_gloo_a_cache_with_its_own_method_suggests_calling_it(pools):
    for result in pools.run(2, W.init_message_and_fix):
        assert result["message"].startswith(
            "init_sharded: buffer 'rope.cache' (shape (16, 8), torch.float32) of WithRoPE is on "
            "the meta device and nothing initialises it: CachedRoPE has no reset_parameters() "
            "and no init_fn wrote it. CachedRoPE._build_cache() writes it: call it as the "
            "initialisation, init_fn=lambda m: m._build_cache() if isinstance(m, CachedRoPE) "
            "else None."
        ), result["message"]
        assert result["equal"]  # following the advice gives the eagerly built cache


def test_the_models_own_init_weights_is_suggested():
    with torch.device("meta"):
        model = W.InitWeights()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        message = _error(model, mesh)
        assert message.endswith(
            "InitWeights._init_weights(module) writes it: pass init_fn=model._init_weights."
        ), message
        _, buffers = ff.init_sharded(ff.fsdp(model, mesh), init_fn=model._init_weights)
    assert torch.equal(ff.rank_values(buffers["rope.cache"])[0], torch.full((16, 8), 0.5))


def test_a_transformers_rotary_embedding_gets_no_placeholder_value():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from ._hf import tiny_llama_config

    config = tiny_llama_config()

    class Hand(nn.Module):  # transformers' rotary in a model of one's own (no post_init)
        def __init__(self) -> None:
            super().__init__()
            self.rotary = LlamaRotaryEmbedding(config)
            self.proj = nn.Linear(32, 32)

    with torch.device("meta"):
        model = Hand()
    with ff.simulated_mesh({"dp": 2}) as mesh:
        message = _error(model, mesh)
    assert "ones_" not in message and "init_fn=lambda" not in message, message
    assert (
        "buffer 'rotary.inv_freq' (shape (4,), torch.float32) of Hand is on the meta device "
        "and nothing initialises it: LlamaRotaryEmbedding has no reset_parameters() and no "
        "init_fn wrote it. Its value is computed when LlamaRotaryEmbedding is constructed, "
        "and construction on the meta device computed nothing. Put that computation in a "
        "LlamaRotaryEmbedding.reset_parameters()"
    ) in message, message
