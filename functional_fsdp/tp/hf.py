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
| ``moe_tp_experts`` | ``ExpertParallel()`` (whole experts per rank; eager, ``grouped_mm`` or ``batched_mm`` experts) |
| ``packed_colwise``, ``rowwise`` on expert weights | covered by ``ExpertParallel`` |

Where ``transformers`` ships no plan (OPT, StableLM, GPT-2, GPTBigCode, Falcon, Bloom), one
is read off the decoder layers (:mod:`functional_fsdp.tp.hf_derive`): projections by their
names, fused q/k/v projections kept per rank by heads, head counts (and Bloom's ALiBi biases)
set per rank for the call.

Colwise linears that read nothing but their block's input (q, k, v of an attention) take
``input="prepared"`` under a :class:`PrepareInput` on the block: one backward all-reduce
for all of them. ``sequence_parallel=True`` adds Megatron's sequence parallelism. Both come
from the same builder as :func:`~functional_fsdp.llama_plan` (``tp/_megatron.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._megatron import COLWISE_KINDS, LINEAR_KINDS, head_style, megatron_plan, reads_input_only
from .hf_derive import derive_plan
from .styles import (
    ExpertParallel,
    Forward,
    ForwardWrapper,
    ReplicatedParallel,
    Style,
    VocabParallelEmbedding,
)

# The linear styles (colwise, rowwise, colwise_gather_output, rowwise_split_input) are
# mapped by megatron_plan; the rest here.
_STYLES: dict[str, Callable[[], Style]] = {
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
    sequence_parallel: bool = False,
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
        sequence_parallel: keep the residual stream split along the sequence between the
            decoder layers (Megatron's sequence parallelism): the first layer's input is
            scattered (the model computes its mask and positions from the whole sequence
            before that), the modules with parameters on the residual stream (the layers'
            norms, the final norm) run on a part of the sequence and sum their gradients
            over tp, each attention and MLP block all-gathers its input once, and the rowwise
            linears reduce-scatter instead of all-reducing. The sequence length must be a
            multiple of tp. Mixture-of-experts models are refused.

    One backward all-reduce per block: where a module's colwise linears (an attention's
    q, k and v; an MLP's gate and up) read nothing but the module's input (checked in the
    source of its ``forward``: the input reaches those linears and shape queries only), the
    module gets :class:`~functional_fsdp.PrepareInput` and the linears
    ``input="prepared"``, so the gradient of that input is all-reduced once, not once per
    linear. Elsewhere each colwise linear enters the region itself.

    Returns:
        ``{module path: Style}`` for :func:`~functional_fsdp.tensor_parallel`.

    Raises:
        ValueError: the config has no plan (and ``require_layer_plan``), or the plan uses a
            style this library cannot express (named with the module; pass ``overrides``),
            or ``sequence_parallel`` on a model whose layers or blocks it cannot place.

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
    base_prefix = getattr(inner, "base_model_prefix", "")
    derived = None
    if not base_plan:  # transformers ships none: read one off the decoder layers
        in_base = base_prefix and base_prefix in dict(inner.named_children())
        derived = derive_plan(inner, f"{base_prefix}." if in_base else "")
        base_plan = dict(derived.base_plan) if derived else {}
    if not base_plan and derived is None and require_layer_plan:
        raise ValueError(
            f"hf_tp_plan: {name}'s config ({type(config).__name__}) has no base_model_tp_plan: "
            f"transformers ships no tensor-parallel plan for it, and none can be read off its "
            f"decoder layers (their linears are not all named q/k/v/o_proj, out_proj, "
            f"gate/up/down_proj, fc1/fc2, or fuse several projections). Write a plan "
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
    base = f"{base_prefix}." if base_prefix and base_prefix in modules else ""
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", 0)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else None)
    plan: dict[str, Style] = {}
    linears: dict[str, str] = {}  # module path -> transformers style, for megatron_plan
    head_dims: dict[str, int] = {}
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
            plan.update({p: head_style(loss_parallel, sequence_parallel) for p in hits})
            continue
        if not hits:
            weights += [(key, kind, p) for p in _resolve(full, sorted(params))]
            continue
        if kind in LINEAR_KINDS:
            linears.update({p: kind for p in hits})
            if kind == "colwise" and key.rpartition(".")[2] in _HEAD_SPLIT and head_dim:
                head_dims.update({p: head_dim for p in hits})  # tp must divide the heads
            continue
        if kind not in _STYLES:
            raise _unsupported(name, key, kind, hits, modules)
        plan.update({p: _STYLES[kind]() for p in hits})
    for key, kind, param in weights:
        owner = param.rpartition(".")[0]
        if not (kind in _EXPERT_WEIGHT_STYLES and isinstance(plan.get(owner), ExpertParallel)):
            raise _unsupported(name, key, kind, [param], modules)
    blocks = _blocks(linears, plan, modules)
    first_layer, norms = None, []
    if sequence_parallel:
        first_layer, norms = _residual_stream(name, inner, base, base_plan, plan, linears, blocks)
    plan.update(
        megatron_plan(
            linears,
            blocks=blocks,
            head_dims=head_dims,
            first_layer=first_layer,
            sequence_norms=[n for n in norms if n not in plan],
            sequence_parallel=sequence_parallel,
        )
    )
    if derived is not None:
        derived.finish(plan)
    _add_vocabulary(inner, plan, loss_parallel, vocab_parallel, sequence_parallel)
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


def _blocks(
    linears: Mapping[str, str], plan: Mapping[str, Style], modules: Mapping[str, nn.Module]
) -> set[str]:
    """Modules whose colwise linears (children) read nothing but the module's input."""
    children: dict[str, list[str]] = {}
    for path, kind in linears.items():
        if kind in COLWISE_KINDS:
            parent, _, child = path.rpartition(".")
            children.setdefault(parent, []).append(child)
    return {
        block
        for block, names in children.items()
        if block not in plan and block in modules and reads_input_only(modules[block], names)
    }


def _residual_stream(
    name: str,
    model: nn.Module,
    base: str,
    base_plan: Mapping[str, str],
    plan: Mapping[str, Style],
    linears: Mapping[str, str],
    blocks: set[str],
) -> tuple[str, list[str]]:
    """For sequence parallelism: the first decoder layer, and the modules with parameters on
    the residual stream (the layers' norms, and the modules registered after the layer list,
    which run after it in every ``transformers`` decoder: the final norm)."""
    modules = dict(model.named_modules())
    lists = sorted({f"{base}{k.split('.*.')[0]}" for k in base_plan if ".*." in k})
    layer_list = modules.get(lists[0]) if len(lists) == 1 else None
    if not isinstance(layer_list, nn.ModuleList) or not len(layer_list):
        raise ValueError(
            f"hf_tp_plan(sequence_parallel=True): {name}'s plan does not name one list of "
            f"decoder layers (its patterns start with {lists}), so the residual stream "
            f"between them cannot be found. Use sequence_parallel=False, or write the plan "
            f"(ScatterInput on the first layer, SequenceParallel on the norms)."
        )
    experts = [p for p, s in plan.items() if isinstance(s, ExpertParallel)]
    if experts:
        raise ValueError(
            f"hf_tp_plan(sequence_parallel=True): {name} has experts ({experts[0]!r}, "
            f"ExpertParallel), which need every token of the sequence on every rank; sequence "
            f"parallelism would sum the outputs of different tokens. Use "
            f"sequence_parallel=False for mixture-of-experts models."
        )
    planned = {*plan, *linears, *blocks}
    layers = [f"{lists[0]}.{i}" for i, _ in layer_list.named_children()]
    norms: list[str] = []
    for layer in layers:
        # The layer's children that hold planned modules must gather the sequence once.
        roots = {
            f"{layer}.{p[len(layer) + 1 :].split('.')[0]}"
            for p in planned
            if p.startswith(f"{layer}.")
        }
        if unsure := sorted(roots - blocks):
            root = unsure[0]
            raise ValueError(
                f"hf_tp_plan(sequence_parallel=True): {root!r} ({type(modules[root]).__name__}) "
                f"holds split modules, but its forward cannot be shown to pass its input to "
                f"its colwise linears only (read from its source), so its input cannot be "
                f"all-gathered along the sequence once for them. Use sequence_parallel=False, "
                f"or write the plan (PrepareInput(sequence_dim=1) on it)."
            )
        norms += [
            p
            for p, m in modules[layer].named_modules(prefix=layer)
            if not any(p == r or p.startswith(f"{r}.") for r in roots)
            and any(True for _ in m.parameters(recurse=False))
        ]
    parent, _, list_name = lists[0].rpartition(".")
    after = False
    for child_name, child in modules[parent].named_children():
        after = after or child_name == list_name
        if after and child_name != list_name:
            norms += [
                p
                for p, m in child.named_modules(
                    prefix=f"{parent}.{child_name}" if parent else child_name
                )
                if any(True for _ in m.parameters(recurse=False))
            ]
    return layers[0], norms


def _add_vocabulary(
    model: nn.Module,
    plan: dict[str, Style],
    loss_parallel: bool,
    vocab_parallel: bool,
    sequence_parallel: bool,
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
        plan.setdefault(by_id[id(head)], head_style(loss_parallel, sequence_parallel))


def _unsupported(
    name: str, key: str, kind: str, hits: list[str], modules: dict[str, nn.Module]
) -> ValueError:
    where = hits[0] if hits else "(no module)"
    what = type(modules[where]).__name__ if where in modules else "a parameter"
    return ValueError(
        f"hf_tp_plan: {name}'s plan gives {key!r} the transformers style {kind!r} "
        f"({where!r}, {what}), which this library cannot express yet; it maps "
        f"{sorted([*LINEAR_KINDS, *_STYLES])} (and expert weights under 'moe_tp_experts'). Give that entry a "
        f"style yourself: hf_tp_plan(model, overrides={{{key!r}: ...}}) (a Style, or None to "
        f"leave it replicated)."
    )
