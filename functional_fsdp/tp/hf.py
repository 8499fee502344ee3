"""Tensor-parallel plans from a Hugging Face model's own plan.

``transformers`` ships, for most decoders, its authors' tensor-parallel plan: the config's
``base_model_tp_plan`` (module patterns of the base model, such as
``"layers.*.self_attn.q_proj": "colwise"``) and the causal-LM class's ``_tp_plan`` for the
head (``{"lm_head": "colwise_gather_output"}``). :func:`hf_tp_plan` turns both into this
library's styles, with the patterns resolved to the model's module paths, so that any such
model runs FSDP + TP in one line::

    tp = ff.tensor_parallel(model, mesh, ff.hf_tp_plan(model))
    sharded = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)

| ``transformers`` style | style here |
|---|---|
| ``colwise`` | ``ColwiseParallel()`` |
| ``rowwise`` | ``RowwiseParallel()`` |
| ``colwise_gather_output`` | ``ColwiseParallel(output="replicated")`` |
| ``rowwise_split_input`` | ``RowwiseParallel(input="replicated")`` |
| ``embedding_rowwise`` | ``VocabParallelEmbedding()`` |
| ``replicated_with_grad_allreduce`` | ``ReplicatedParallel()`` |
| ``moe_tp_experts`` | ``ExpertParallel()`` (whole experts per rank) |
| ``packed_colwise``, ``rowwise`` on expert weights | covered by ``ExpertParallel`` |
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .styles import (
    ColwiseParallel,
    ExpertParallel,
    Forward,
    ForwardWrapper,
    ReplicatedParallel,
    RowwiseParallel,
    Style,
    VocabParallelEmbedding,
)

_STYLES: dict[str, Callable[[], Style]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output="replicated"),
    "rowwise_split_input": lambda: RowwiseParallel(input="replicated"),
    "embedding_rowwise": VocabParallelEmbedding,
    "replicated_with_grad_allreduce": ReplicatedParallel,
    "moe_tp_experts": ExpertParallel,
}
# Projections split by whole attention heads (checked against the config's head_dim).
_HEAD_SPLIT = ("q_proj", "k_proj", "v_proj")
# Styles of single expert weights: the ExpertParallel style of their module places them.
_EXPERT_WEIGHT_STYLES = ("packed_colwise", "rowwise", "colwise")


def _unwrap(model: nn.Module) -> tuple[nn.Module, str]:
    """The ``transformers`` model inside a peft model, and the path prefix to it."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and isinstance(inner := get_base(), nn.Module) and inner is not model:
        for path, module in model.named_modules():
            if module is inner:
                return inner, f"{path}." if path else ""
    return model, ""


def _resolve(pattern: str, paths: list[str]) -> list[str]:
    """Paths matching a ``transformers`` plan pattern (``*`` stands for one path component)."""
    regex = re.compile(
        "\\.".join("[^.]+" if c == "*" else re.escape(c) for c in pattern.split("."))
    )
    return [p for p in paths if regex.fullmatch(p)]


def hf_tp_plan(
    model: nn.Module,
    *,
    loss_parallel: bool = True,
    vocab_parallel: bool = True,
    overrides: Mapping[str, Style | None] | None = None,
    require_layer_plan: bool = True,
) -> dict[str, Style]:
    """A TP plan for a ``transformers`` model from the model's own plan.

    Reads ``model.config.base_model_tp_plan`` and the class's ``_tp_plan`` (the head), maps
    their styles to this library's (see the module docstring) and resolves each pattern to
    the module paths of ``model``. A peft model works as is (its paths get peft's prefix).

    Args:
        model: a ``transformers`` causal LM (or a peft model around one); never modified.
        loss_parallel: leave the logits split over the vocabulary for
            :func:`~functional_fsdp.vocab_parallel_cross_entropy`; ``False`` gathers them
            (``transformers``' ``"colwise_gather_output"``) for an ordinary loss.
        vocab_parallel: split the input embedding over the vocabulary, also where the
            model's plan leaves it replicated. Needed when the head is tied to it.
        overrides: ``{plan pattern: Style or None}``: replaces the style of an entry of the
            model's plan (keys as written there, e.g. ``"layers.*.mlp.gate_proj"``), or
            leaves it out with ``None``.
        require_layer_plan: raise when the config has no ``base_model_tp_plan``; ``False``
            splits only the vocabulary (embedding and head) of such a model.

    Returns:
        ``{module path: Style}`` for :func:`~functional_fsdp.tensor_parallel`.

    Raises:
        ValueError: the config has no plan (and ``require_layer_plan``), or the plan uses a
            style this library cannot express (named with the module; pass ``overrides``).

    Example:
        >>> import transformers
        >>> cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        >>> plan = hf_tp_plan(transformers.Qwen3ForCausalLM(cfg))
        >>> plan["model.layers.0.self_attn.q_norm"], plan["model.layers.0.mlp.down_proj"]
        (ReplicatedParallel(), RowwiseParallel(output='replicated', sequence_dim=1, input_kwarg=None, input='sharded'))
    """
    inner, prefix = _unwrap(model)
    config = getattr(inner, "config", None)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    name = type(inner).__name__
    if not base_plan and require_layer_plan:
        raise ValueError(
            f"hf_tp_plan: {name}'s config ({type(config).__name__}) has no base_model_tp_plan: "
            f"transformers ships no tensor-parallel plan for it. Write a plan "
            f"({{module pattern: Style}}), or pass require_layer_plan=False to split only the "
            f"vocabulary (embedding and head)."
        )
    overrides = dict(overrides or {})
    unknown = [k for k in overrides if k not in base_plan and k not in _head_plan(inner)]
    if unknown:
        raise ValueError(
            f"hf_tp_plan: overrides {unknown} are not entries of {name}'s plan; its entries "
            f"are {sorted({**base_plan, **_head_plan(inner)})}."
        )
    modules = dict(inner.named_modules())
    paths = list(modules)
    params = {n for n, _ in inner.named_parameters(remove_duplicate=False)}
    base_prefix = getattr(inner, "base_model_prefix", "")
    base = f"{base_prefix}." if base_prefix and base_prefix in modules else ""
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", 0)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else None)
    plan: dict[str, Style] = {}
    weights: list[tuple[str, str, str]] = []  # (pattern, kind, parameter path)
    entries = [(f"{base}{k}", k, v) for k, v in base_plan.items()]
    entries += [(k, k, v) for k, v in _head_plan(inner).items()]
    for full, key, kind in entries:
        hits = _resolve(full, paths)
        if key in overrides:
            if overrides[key] is not None:
                plan.update({p: overrides[key] for p in hits})  # type: ignore[misc]
            continue
        if key in _head_plan(inner):
            if kind != "colwise_gather_output":
                raise _unsupported(name, key, kind, hits, modules)
            plan.update({p: _head(loss_parallel) for p in hits})
            continue
        if not hits:
            weights += [(key, kind, p) for p in _resolve(full, sorted(params))]
            continue
        if kind not in _STYLES:
            raise _unsupported(name, key, kind, hits, modules)
        style = _STYLES[kind]()
        if kind == "colwise" and key.rpartition(".")[2] in _HEAD_SPLIT and head_dim:
            style = ColwiseParallel(head_dim=head_dim)  # tp must divide the (key/value) heads
        plan.update({p: style for p in hits})
    for key, kind, param in weights:
        owner = param.rpartition(".")[0]
        if not (kind in _EXPERT_WEIGHT_STYLES and isinstance(plan.get(owner), ExpertParallel)):
            raise _unsupported(name, key, kind, [param], modules)
    _add_vocabulary(inner, plan, loss_parallel, vocab_parallel)
    out = {f"{prefix}{p}": s for p, s in plan.items()}
    if loss_parallel:
        out[""] = LogitsSplitOverVocab()
    return out


@dataclass(frozen=True)
class LogitsSplitOverVocab(Style):
    """On the model: its logits are split over the vocabulary, so its own loss cannot run.

    ``hf_tp_plan(loss_parallel=True)`` puts it on the root module: a call with ``labels=``
    (``transformers`` computing the loss from the whole vocabulary) raises, naming the fix.

    Example:
        >>> LogitsSplitOverVocab()
        LogitsSplitOverVocab()
    """

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def refuse_labels(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("labels") is not None:
                    raise ValueError(
                        f"{type(module).__name__} was called with labels=, but hf_tp_plan("
                        f"loss_parallel=True) leaves its logits split over the vocabulary on "
                        f"{axis!r}, and the model's own loss needs them whole. Compute the loss "
                        f"from the split logits: ff.vocab_parallel_cross_entropy(out.logits[:, "
                        f":-1], labels[:, 1:], mesh), or build the plan with "
                        f"hf_tp_plan(model, loss_parallel=False)."
                    )
                return forward(*args, **kwargs)

            return refuse_labels

        return wrapper


def _head_plan(model: nn.Module) -> dict[str, str]:
    return dict(getattr(type(model), "_tp_plan", None) or {})


def _head(loss_parallel: bool) -> ColwiseParallel:
    if loss_parallel:
        return ColwiseParallel(padded=True)
    return ColwiseParallel(output="replicated")


def _add_vocabulary(
    model: nn.Module, plan: dict[str, Style], loss_parallel: bool, vocab_parallel: bool
) -> None:
    """The input embedding vocab-parallel and the output head colwise, where the plan is silent."""
    by_id = {id(m): p for p, m in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if vocab_parallel and isinstance(embedding, nn.Embedding) and id(embedding) in by_id:
        plan.setdefault(by_id[id(embedding)], VocabParallelEmbedding())
    if isinstance(head, nn.Linear) and id(head) in by_id:
        plan.setdefault(by_id[id(head)], _head(loss_parallel))


def _unsupported(
    name: str, key: str, kind: str, hits: list[str], modules: dict[str, nn.Module]
) -> ValueError:
    where = hits[0] if hits else "(no module)"
    what = type(modules[where]).__name__ if where in modules else "a parameter"
    return ValueError(
        f"hf_tp_plan: {name}'s plan gives {key!r} the transformers style {kind!r} "
        f"({where!r}, {what}), which this library cannot express yet; it maps "
        f"{sorted(_STYLES)} (and expert weights under 'moe_tp_experts'). Give that entry a "
        f"style yourself: hf_tp_plan(model, overrides={{{key!r}: ...}}) (a Style, or None to "
        f"leave it replicated)."
    )
