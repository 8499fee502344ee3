"""Tensor-parallel plans derived from a Hugging Face model's structure, where it ships none.

``transformers`` ships no ``base_model_tp_plan`` for some causal LMs (OPT, StableLM, ...).
:func:`derive_plan` reads one off the decoder layers instead: every ``nn.Linear`` of a layer
is named after its role (``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``/``out_proj`` in the
attention; ``gate_proj``/``up_proj``/``fc1`` and ``down_proj``/``fc2`` in the MLP), and each
module holding colwise linears holds the rowwise one that closes the region. A layer with a
linear of any other name, or a region left open, gets no derived plan (the caller raises).

Code written for one process reshapes with global head counts
(``q.view(bsz, -1, self.num_heads, self.head_dim)``), so the attention modules get their head
counts per rank for the call (:class:`~functional_fsdp.LocalAttributes`). Per-head norms
(StableLM's ``q_layernorm``: one ``LayerNorm`` per head) run on this rank's heads
(:class:`PerHeadNorms`); other modules with parameters beside the MLP's linears (a layer's
norms, on the residual stream) read replicated values and say so (``LocalAttributes()``).
Every derived plan is checked against one process by the zoo's tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .ops import scatter_to
from .styles import Forward, ForwardWrapper, LocalAttributes, PrepareInput, Style

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "w1", "w3")
ROWWISE = ("o_proj", "out_proj", "down_proj", "fc2", "w2")
# Head counts that code written for one process reshapes with.
HEAD_COUNTS = (
    "num_heads",
    "num_attention_heads",
    "n_heads",
    "n_head",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
)


@dataclass(frozen=True, kw_only=True)
class PerHeadNorms(Style):
    """A module with one ``LayerNorm`` per attention head (``norms``), applied to head-split
    ``[batch, heads, seq, head_dim]`` states, run on this rank's heads.

    The norms' weights are stacked and this rank keeps its heads' rows
    (:func:`~functional_fsdp.scatter_to`, whose backward all-gathers the rows' gradients),
    so each norm's gradient is whole on every rank.

    Example:
        >>> PerHeadNorms()
        PerHeadNorms()
    """

    def problem(self, module: nn.Module, tp: int) -> str | None:
        norms = getattr(module, "norms", None)
        if not (
            isinstance(norms, nn.ModuleList)
            and len(norms)
            and all(isinstance(n, nn.LayerNorm) for n in norms)
        ):
            return "PerHeadNorms needs a module with a ModuleList of LayerNorms as `norms`"
        if len(norms) % tp:
            return f"tp={tp} does not divide its {len(norms)} heads"
        return None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def per_head(x: torch.Tensor) -> torch.Tensor:
                norms = list(module.norms)  # type: ignore[arg-type]
                first = norms[0]
                y = F.layer_norm(x, first.normalized_shape, eps=first.eps)
                shape = (1, -1, 1, x.shape[-1])
                if first.weight is not None:
                    w = scatter_to(torch.stack([n.weight for n in norms]), mesh, axis, 0)
                    y = y * w.reshape(shape)
                if first.bias is not None:
                    b = scatter_to(torch.stack([n.bias for n in norms]), mesh, axis, 0)
                    y = y + b.reshape(shape)
                return y

            return per_head

        return wrapper


@dataclass(frozen=True)
class DerivedPlan:
    """A plan read off a model's structure.

    Attributes:
        base_plan: ``{pattern: "colwise" | "rowwise"}`` relative to the base model, as
            ``transformers``' ``base_model_tp_plan``.
        attention: ``{module path: head-count attributes}`` of the modules holding q/k/v.
        beside: module paths with parameters beside split linears that read replicated values.
        per_head: module paths of per-head norms.
    """

    base_plan: dict[str, str]
    attention: dict[str, tuple[str, ...]] = field(default_factory=dict)
    beside: tuple[str, ...] = ()
    per_head: tuple[str, ...] = ()

    def finish(self, plan: dict[str, Style]) -> None:
        """Add the per-rank head counts, per-head norms and replicated neighbours to ``plan``."""
        for path, attrs in self.attention.items():
            style = plan.get(path)
            if isinstance(style, PrepareInput):
                plan[path] = PrepareInput(
                    sequence_dim=style.sequence_dim, input_kwarg=style.input_kwarg, per_rank=attrs
                )
            elif style is None:
                plan[path] = LocalAttributes(attrs)
        for path in self.per_head:
            plan.setdefault(path, PerHeadNorms())
        for path in self.beside:
            plan.setdefault(path, LocalAttributes())


def _layer_list(model: nn.Module, config: Any) -> tuple[str, nn.ModuleList] | None:
    n = getattr(config, "num_hidden_layers", None)
    for path, m in model.named_modules():
        if (
            isinstance(m, nn.ModuleList)
            and len(m)
            and (n is None or len(m) == n)
            and any(isinstance(c, nn.Linear) for c in m[0].modules())
        ):
            return path, m
    return None


def derive_plan(model: nn.Module, base: str) -> DerivedPlan | None:
    """The plan of ``model``'s decoder layers read off their structure, or ``None``.

    Args:
        model: a ``transformers`` causal LM (never modified).
        base: the path of its base model with a trailing dot (``"model."``), or ``""``.

    Example:
        >>> import transformers
        >>> cfg = transformers.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64,
        ...     word_embed_proj_dim=32, num_hidden_layers=1, num_attention_heads=4)
        >>> d = derive_plan(transformers.OPTForCausalLM(cfg), "model.")
        >>> d.base_plan["decoder.layers.*.fc2"], d.attention
        ('rowwise', {'model.decoder.layers.0.self_attn': ('num_heads',)})
    """
    found = _layer_list(model, getattr(model, "config", None))
    if found is None:
        return None
    list_path, layers = found
    if base and not list_path.startswith(base):
        return None
    relative = list_path[len(base) :]
    kinds: dict[str, str] = {}
    for path, m in layers[0].named_modules():
        if isinstance(m, nn.Linear):
            leaf = path.rpartition(".")[2]
            if leaf in COLWISE:
                kinds[path] = "colwise"
            elif leaf in ROWWISE:
                kinds[path] = "rowwise"
            else:
                return None  # a linear whose role the name does not tell
        elif any(True for _ in m.parameters(recurse=False)) and not _is_norm(m):
            return None  # parameters of another kind (a Conv1D, a fused projection)
    parents: dict[str, set[str]] = {}
    for path, kind in kinds.items():
        parents.setdefault(path.rpartition(".")[0], set()).add(kind)
    if not kinds or any(k != {"colwise", "rowwise"} for k in parents.values()):
        return None  # a region a rowwise linear does not close
    base_plan = {f"{relative}.*.{p}": k for p, k in kinds.items()}
    attention: dict[str, tuple[str, ...]] = {}
    beside: list[str] = []
    per_head: list[str] = []
    for i, layer in enumerate(layers):
        prefix = f"{list_path}.{i}"
        modules = dict(layer.named_modules())
        for parent in parents:
            owner = modules[parent]
            names = {p.rpartition(".")[2] for p in kinds if p.rpartition(".")[0] == parent}
            full = f"{prefix}.{parent}" if parent else prefix
            if names & {"q_proj", "k_proj", "v_proj"}:
                attrs = tuple(a for a in HEAD_COUNTS if isinstance(getattr(owner, a, None), int))
                attention[full] = attrs
            for name, child in owner.named_children():
                if name in names or not any(True for _ in child.parameters()):
                    continue
                if _per_head_norms(child):
                    per_head.append(f"{full}.{name}")
                elif _is_norm(child) or all(_is_norm(c) for c in child.modules() if c is not child):
                    beside.append(f"{full}.{name}")
    return DerivedPlan(base_plan, attention, tuple(beside), tuple(per_head))


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(m).__name__.lower()


def _per_head_norms(m: nn.Module) -> bool:
    norms = getattr(m, "norms", None)
    return isinstance(norms, nn.ModuleList) and all(isinstance(n, nn.LayerNorm) for n in norms)
