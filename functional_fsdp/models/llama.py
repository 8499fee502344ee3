"""The tensor-parallel plan of Hugging Face Llama-style models (``LlamaForCausalLM``).

Megatron-style, as ``transformers``' own ``base_model_tp_plan`` and torchtitan's Llama plan:
q, k, v, gate and up colwise, o and down rowwise (one :class:`PrepareInput` per attention and
MLP block), the token embedding vocab-parallel and the LM head colwise over the vocabulary.
Grouped-query attention splits the key/value heads like the query heads, so tp must divide
``num_key_value_heads``. HF's attention reshapes with ``-1`` heads and ``head_dim``, so it
reads the local head count from the shapes and needs no per-rank attributes.

The same plan serves other decoders with Llama's module names (Mistral, Qwen2, ...), and a
peft LoRA model (``prefix="base_model.model."``): the colwise and rowwise styles take peft's
LoRA layers around the projections.

For any other ``transformers`` model, :func:`functional_fsdp.hf_tp_plan` reads the model's own
plan. Both build their styles with the same function (``tp/_megatron.py``): on a Llama,
``hf_tp_plan(model)`` gives the same styles as ``llama_plan(model.config)``, keyed by module
paths instead of patterns (plus the check that the model's call has no ``labels=``). This
plan needs only the config, and serves other models with Llama's names whose plans differ.
"""

from __future__ import annotations

from typing import Any

from ..tp._megatron import megatron_plan
from ..tp.styles import Style


def _config_problem(config: Any) -> str | None:
    needed = ("hidden_size", "num_attention_heads")
    missing = [n for n in needed if not isinstance(getattr(config, n, None), int)]
    if missing:
        return f"the config has no integer {missing}"
    return None


def llama_plan(
    config: Any,
    *,
    loss_parallel: bool = True,
    sequence_parallel: bool = False,
    prefix: str = "",
) -> dict[str, Style]:
    """The TP plan of a Hugging Face ``LlamaForCausalLM`` (and models with its module names).

    Args:
        config: the model's config (a ``transformers.LlamaConfig``), for the head size.
        loss_parallel: leave the logits split over the vocabulary, for
            :func:`~functional_fsdp.vocab_parallel_cross_entropy`; ``False`` all-gathers
            them for an ordinary loss.
        sequence_parallel: keep the residual stream split along the sequence between the
            decoder layers: the first layer's input is scattered (the model computes its
            attention mask and positions from the whole sequence before that), the norms run
            on a part of the sequence, and the blocks all-gather and reduce-scatter instead of
            all-reducing. The sequence length must be a multiple of tp.
        prefix: put in front of every pattern, for a model wrapped in another, e.g.
            ``"base_model.model."`` for a peft ``PeftModelForCausalLM``.

    Raises:
        TypeError: ``config`` lacks ``hidden_size`` or ``num_attention_heads``.

    Example:
        >>> from types import SimpleNamespace  # or the model's transformers.LlamaConfig
        >>> plan = llama_plan(SimpleNamespace(hidden_size=64, num_attention_heads=4))
        >>> plan["model.layers.*.self_attn.[qkv]_proj"]
        ColwiseParallel(input='prepared', output='sharded', sequence_dim=1, head_dim=16, input_kwarg=None, padded=False)
    """
    problem = _config_problem(config)
    if problem:
        raise TypeError(
            f"llama_plan: {problem}; pass the model's config (model.config, a "
            f"transformers LlamaConfig), not {type(config).__name__}."
        )
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    layers = f"{prefix}model.layers.*"
    qkv = f"{layers}.self_attn.[qkv]_proj"
    # Llama's attention and MLP read their input only through these linears (as
    # hf_tp_plan finds in their forward's source): one PrepareInput each.
    return megatron_plan(
        {
            qkv: "colwise",
            f"{layers}.self_attn.o_proj": "rowwise",
            f"{layers}.mlp.gate_proj": "colwise",
            f"{layers}.mlp.up_proj": "colwise",
            f"{layers}.mlp.down_proj": "rowwise",
        },
        blocks=(f"{layers}.self_attn", f"{layers}.mlp"),
        head_dims={qkv: head_dim},
        embedding=f"{prefix}model.embed_tokens",
        head=f"{prefix}lm_head",
        first_layer=f"{prefix}model.layers.0",
        sequence_norms=(
            f"{layers}.input_layernorm",
            f"{layers}.post_attention_layernorm",
            f"{prefix}model.norm",
        ),
        loss_parallel=loss_parallel,
        sequence_parallel=sequence_parallel,
    )
