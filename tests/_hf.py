"""The small transformers configs the tests build models from (never downloaded)."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(**overrides: Any) -> Any:
    """A Llama config with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig

    options: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaConfig(**{**options, **overrides})
