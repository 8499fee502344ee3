"""The small transformers configs the tests build models from (never downloaded)."""

from __future__ import annotations

from typing import Any

_TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def tiny_llama_config(**overrides: Any) -> Any:
    """A Llama config with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**_TINY, **overrides})


def tiny_qwen2_config(**overrides: Any) -> Any:
    """A Qwen2 config of the same sizes (biases on q, k, v; an optional sliding window)."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**_TINY, **overrides})
