"""A zoo of ``transformers`` causal LMs built from tiny configs (never downloaded).

``ZOO[name]`` is an :class:`Arch`: ``arch.build()`` returns a fresh model, seeded, in eval
mode (no dropout), with eager attention. The flags say which variants it covers, so a check
run over the zoo can select (``[a for a in ZOO.values() if a.tp_plan]``). Configs are tiny:
hidden 32, 2 layers, 4 heads (2 key/value heads where the architecture has GQA), a
vocabulary of 64 (GPT-2 keeps its own 50257, which tp=2 does not divide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 64
_SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@dataclass(frozen=True)
class Arch:
    """One architecture of the zoo.

    Attributes:
        name: the zoo's key.
        cls: the ``transformers`` causal-LM class name.
        options: config keyword arguments.
        covers: the variants it stands for (tied head, GQA, partial rotary, ...).
        tied: the head shares the embedding's weight.
        moe: it has mixture-of-experts layers.
        tp_plan: ``ff.hf_tp_plan`` splits its layers: from the plan ``transformers`` ships
            (``base_model_tp_plan``), or from one read off the layers' structure.
        sequence_parallel: ``hf_tp_plan(sequence_parallel=True)`` can place it.
        torch_func: ``torch.func.grad`` can differentiate it; otherwise ``why_not`` says why.
        config_cls: the config class name, if not ``cls`` with ``ForCausalLM`` replaced.
    """

    name: str
    cls: str
    options: dict[str, Any]
    covers: tuple[str, ...]
    tied: bool = False
    moe: bool = False
    tp_plan: bool = True
    sequence_parallel: bool = True
    torch_func: bool = True
    why_not: str = ""
    config_cls: str | None = None
    vocab: int = VOCAB
    lora_targets: Any = field(default="all-linear")

    def config(self, experts: str | None = "eager") -> Any:
        import transformers

        name = self.config_cls or self.cls.replace("ForCausalLM", "Config").replace(
            "LMHeadModel", "Config"
        )
        cfg = getattr(transformers, name)(**self.options)
        cfg._attn_implementation = "eager"
        if self.moe and experts is not None:  # None: transformers' default (grouped_mm)
            cfg._experts_implementation = experts
        return cfg

    def build(self, seed: int = 0, experts: str | None = "eager") -> nn.Module:
        """A fresh model; ``experts``: the MoE experts implementation (``None``: the
        ``transformers`` default, stacked expert weights run by ``grouped_mm``)."""
        import transformers

        torch.manual_seed(seed)
        model = getattr(transformers, self.cls)(self.config(experts))
        return model.eval()


_TOKENS: dict[str, Any] = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _llama_like(**extra: Any) -> dict[str, Any]:
    return {**_SMALL, **_TOKENS, "head_dim": 8, "tie_word_embeddings": False, **extra}


_ARCHS = [
    Arch("llama", "LlamaForCausalLM", _llama_like(), ("GQA", "untied")),
    Arch(
        "gemma",
        "GemmaForCausalLM",
        _llama_like(tie_word_embeddings=True),
        ("scaled embedding", "tied", "GQA"),
        tied=True,
    ),
    Arch(
        "gemma2",
        "Gemma2ForCausalLM",
        _llama_like(tie_word_embeddings=True, sliding_window=4),
        ("scaled embedding", "tied", "soft-capping", "sliding window"),
        tied=True,
    ),
    Arch(
        "gemma3",
        "Gemma3ForCausalLM",
        _llama_like(tie_word_embeddings=True, sliding_window=4),
        ("scaled embedding", "tied", "q/k norm (per head)"),
        tied=True,
        config_cls="Gemma3TextConfig",
    ),
    Arch("mistral", "MistralForCausalLM", _llama_like(), ("GQA", "sliding window")),
    Arch("qwen2", "Qwen2ForCausalLM", _llama_like(), ("GQA", "q/k/v bias")),
    Arch(
        "qwen3",
        "Qwen3ForCausalLM",
        _llama_like(tie_word_embeddings=True),
        ("q/k norm (per head)", "tied"),
        tied=True,
    ),
    Arch(
        "olmo2",
        "Olmo2ForCausalLM",
        _llama_like(),
        ("q/k norm (over the whole projection)", "post-norm"),
    ),
    Arch(
        "cohere",
        "CohereForCausalLM",
        _llama_like(tie_word_embeddings=True, use_qk_norm=False),
        ("parallel attention + MLP", "logit scale", "tied"),
        tied=True,
    ),
    Arch(
        "phi",
        "PhiForCausalLM",
        {**_SMALL, **_TOKENS, "partial_rotary_factor": 0.5, "tie_word_embeddings": False},
        ("partial rotary", "parallel attention + MLP", "LayerNorm", "biases"),
    ),
    Arch(
        "phi3",
        "Phi3ForCausalLM",
        _llama_like(partial_rotary_factor=0.5),
        ("packed qkv and gate/up", "partial rotary"),
    ),
    Arch(
        "starcoder2",
        "Starcoder2ForCausalLM",
        _llama_like(tie_word_embeddings=True),
        ("GQA", "biases", "LayerNorm", "tied"),
        tied=True,
    ),
    Arch(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        {**_SMALL, **_TOKENS, "rotary_pct": 0.25, "use_parallel_residual": True},
        ("parallel attention + MLP", "partial rotary", "packed qkv per head"),
    ),
    Arch(
        "mixtral",
        "MixtralForCausalLM",
        _llama_like(num_local_experts=4, num_experts_per_tok=2),
        ("MoE (4 experts, top-2)", "GQA"),
        moe=True,
        lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    ),
    Arch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _llama_like(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
        ),
        ("MoE (4 experts, top-2) + shared expert", "dense and sparse layers"),
        moe=True,
        lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    ),
    Arch(
        "gpt2",
        "GPT2LMHeadModel",
        dict(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        (
            "Conv1D",
            "tied",
            "learned positions",
            "vocabulary 50257 (uneven on tp=2)",
            "TP plan read off its layers (fused q/k/v)",
        ),
        tied=True,
        sequence_parallel=False,
        vocab=50257,
    ),
    Arch(
        "gpt_bigcode",
        "GPTBigCodeForCausalLM",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **_TOKENS),
        ("multi-query attention", "tied", "TP plan read off its layers (fused q/k/v)"),
        tied=True,
        sequence_parallel=False,
    ),
    Arch(
        "falcon",
        "FalconForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            parallel_attn=True,
            bias=False,
            **_TOKENS,
        ),
        (
            "parallel attention + MLP",
            "multi-query attention",
            "tied",
            "TP plan read off its layers (fused q/k/v)",
        ),
        tied=True,
        sequence_parallel=False,
    ),
    Arch(
        "opt",
        "OPTForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            word_embed_proj_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            **_TOKENS,
        ),
        ("learned positions with offset", "tied", "TP plan read off its layers"),
        tied=True,
        sequence_parallel=False,  # its MLP's linears sit in the layer, beside the norms
    ),
    Arch(
        "stablelm",
        "StableLmForCausalLM",
        _llama_like(partial_rotary_factor=0.25, qk_layernorm=True),
        ("partial rotary", "q/k LayerNorm (per head)", "TP plan read off its layers"),
    ),
    Arch(
        "bloom",
        "BloomForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **_TOKENS),
        ("ALiBi", "tied", "TP plan read off its layers (fused q/k/v, ALiBi per rank)"),
        tied=True,
        sequence_parallel=False,
        torch_func=False,
        why_not=(
            "its MLP's GELU runs a custom autograd.Function without setup_context, "
            "which torch.func.grad cannot differentiate"
        ),
    ),
]

ZOO: dict[str, Arch] = {a.name: a for a in _ARCHS}
