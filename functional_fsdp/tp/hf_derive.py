"""Tensor-parallel plans derived from a Hugging Face model's structure, where it ships none.

``transformers`` ships no ``base_model_tp_plan`` for some causal LMs (OPT, StableLM, GPT-2,
GPTBigCode, Falcon, Bloom).
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
Fused q/k/v projections (GPT-2's ``c_attn``, Falcon's and Bloom's ``query_key_value``) are
recognised by their modules' names and layouts; Bloom's ALiBi biases, built by the model for
every head, are cut to each rank's heads (:class:`AlibiHeads`). Every derived plan is checked
against one process by the zoo's tests.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..spec import P
from .ops import copy_to, reduce_from, scatter_to
from .styles import (
    ColwiseParallel,
    Forward,
    ForwardWrapper,
    LocalAttributes,
    PerRank,
    PrepareInput,
    RowwiseParallel,
    Style,
    _map_input,
    _PerRank,
)
from .torch_styles import GatherInput

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


def _is_conv1d(module: nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a linear layer whose weight is ``[in, out]``."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.ndim == 2


@dataclass(frozen=True, kw_only=True)
class Conv1DColwise(Style):
    """``transformers``' ``Conv1D`` (weight ``[in, out]``) split over its output features:
    weight ``P(None, "tp")``, bias ``P("tp")``; the input enters through :func:`copy_to`.

    Example:
        >>> Conv1DColwise()
        Conv1DColwise()
    """

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        return {"weight": P(None, axis), "bias": P(axis)}

    def local_attributes(self, module: nn.Module, tp: int) -> dict[str, Any]:
        return {"nf": module.nf // tp}  # Conv1D reshapes its output with nf

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not _is_conv1d(module):
            return f"Conv1DColwise needs a transformers Conv1D, not a {type(module).__name__}"
        out = module.weight.shape[1]
        return f"tp={tp} does not divide its {out} output features" if out % tp else None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def colwise(*args: Any, **kwargs: Any) -> Any:
                enter = lambda x: copy_to(x, mesh, axis)  # noqa: E731
                args, kwargs = _map_input(self, module, None, args, kwargs, enter)
                return forward(*args, **kwargs)

            return colwise

        return wrapper


@dataclass(frozen=True, kw_only=True)
class Conv1DRowwise(Style):
    """``transformers``' ``Conv1D`` split over its input features: weight ``P("tp", None)``;
    the partial outputs are summed over tp, then the bias is added once.

    Example:
        >>> Conv1DRowwise()
        Conv1DRowwise()
    """

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        return {"weight": P(axis, None)}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not _is_conv1d(module):
            return f"Conv1DRowwise needs a transformers Conv1D, not a {type(module).__name__}"
        n = module.weight.shape[0]
        return f"tp={tp} does not divide its {n} input features" if n % tp else None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def rowwise(x: torch.Tensor) -> torch.Tensor:
                y = reduce_from(x @ module.weight, mesh, axis)
                bias = module.bias
                return y if bias is None else y + bias

            return rowwise

        return wrapper


@dataclass(frozen=True, kw_only=True)
class FusedColwise(Style):
    """A fused projection (q, k and v in one weight, ``parts`` wide each) computed whole
    from a replicated weight, whose output keeps this rank's block of each part.

    ``split[i]`` False keeps part ``i`` whole (a multi-query attention's single key/value
    head, which every rank reads: its gradient is summed over tp). The weight's gradient is
    whole on every rank (the kept blocks' gradients are all-gathered in backward), so the
    weight stays replicated over tp: its layout (``[q | k | v]``, each split by heads) is
    not one block per rank, which a :class:`~functional_fsdp.P` cannot express.

    Example:
        >>> FusedColwise(parts=(32, 8, 8), split=(True, False, False)).parts
        (32, 8, 8)
    """

    parts: tuple[int, ...]
    split: tuple[bool, ...]

    def problem(self, module: nn.Module, tp: int) -> str | None:
        base = getattr(module, "base_layer", module)
        out = base.nf if _is_conv1d(base) else getattr(base, "out_features", None)
        if out != sum(self.parts):
            return f"its {out} output features are not the parts {self.parts}"
        bad = [p for p, s in zip(self.parts, self.split) if s and p % tp]
        return f"tp={tp} does not divide its parts {bad}" if bad else None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def fused(*args: Any, **kwargs: Any) -> torch.Tensor:
                y = forward(*args, **kwargs)
                pieces = y.split(list(self.parts), dim=-1)
                kept = [
                    scatter_to(p, mesh, axis, -1) if s else copy_to(p, mesh, axis)
                    for p, s in zip(pieces, self.split)
                ]
                return torch.cat(kept, dim=-1)

            return fused

        return wrapper


@dataclass(frozen=True, kw_only=True)
class AlibiHeads(_PerRank, Style):
    """An attention whose ALiBi biases (keyword ``alibi``, ``[batch * heads, 1, keys]``, heads
    minor: ``transformers``' ``build_alibi_tensor``) are built by the model for every head:
    this rank keeps its heads' biases (each head its own slope), and ``per_rank`` attributes
    (the head count the attention reshapes with) are set per rank for the call.

    The model builds the biases once, before its layers, from the global head count; the
    attention's ``query_key_value`` keeps whole heads per rank, so rank ``r`` of ``tp`` runs
    heads ``r * heads / tp`` to ``(r + 1) * heads / tp`` and needs their slopes.

    Attributes:
        heads: the global number of attention heads the biases were built for.
        kwarg: the keyword argument holding the biases.
        per_rank: as :class:`~functional_fsdp.LocalAttributes`.

    Example:
        >>> AlibiHeads(heads=4).per_rank[0][0]
        'num_heads'
    """

    heads: int
    kwarg: str = "alibi"
    per_rank: PerRank = ("num_heads",)

    def __post_init__(self) -> None:
        self._normalise_per_rank()

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if self.heads % tp:
            return f"tp={tp} does not divide its {self.heads} attention heads"
        return _PerRank.problem(self, module, tp)

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        try:
            names = list(inspect.signature(type(module).forward).parameters)[1:]
        except (TypeError, ValueError):
            names = []
        position = names.index(self.kwarg) if self.kwarg in names else None

        def keep(alibi: Any) -> Any:
            if not isinstance(alibi, torch.Tensor):
                return alibi  # None: the model built no biases for this call
            rest = alibi.shape[1:]
            by_head = alibi.reshape(-1, self.heads, *rest)
            return scatter_to(by_head, mesh, axis, 1).reshape(-1, *rest)

        def wrapper(forward: Forward) -> Forward:
            def per_rank_heads(*args: Any, **kwargs: Any) -> Any:
                if self.kwarg in kwargs:
                    kwargs = {**kwargs, self.kwarg: keep(kwargs[self.kwarg])}
                elif position is not None and position < len(args):
                    args = (*args[:position], keep(args[position]), *args[position + 1 :])
                return forward(*args, **kwargs)

            return per_rank_heads

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
    styles: dict[str, Style] = field(default_factory=dict)
    attention: dict[str, tuple[str, ...]] = field(default_factory=dict)
    beside: tuple[str, ...] = ()
    per_head: tuple[str, ...] = ()

    def finish(self, plan: dict[str, Style]) -> None:
        """Add the per-rank head counts, per-head norms and replicated neighbours to ``plan``."""
        plan.update(self.styles)
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
            and any(isinstance(c, nn.Linear) or _is_conv1d(c) for c in m[0].modules())
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
    fused = (
        _gpt2_like(model, list_path, layers)
        or _falcon_like(list_path, layers)
        or _bloom_like(list_path, layers)
    )
    if fused is not None:
        return fused
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
    return DerivedPlan(
        base_plan, attention=attention, beside=tuple(beside), per_head=tuple(per_head)
    )


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(m).__name__.lower()


def _per_head_norms(m: nn.Module) -> bool:
    norms = getattr(m, "norms", None)
    return isinstance(norms, nn.ModuleList) and all(isinstance(n, nn.LayerNorm) for n in norms)


def _gpt2_like(model: nn.Module, list_path: str, layers: nn.ModuleList) -> DerivedPlan | None:
    """GPT-2 and GPTBigCode: ``attn.c_attn`` (q, k and v fused), ``attn.c_proj``,
    ``mlp.c_fc`` and ``mlp.c_proj``, as ``Conv1D`` (GPT-2) or ``nn.Linear`` (GPTBigCode)."""
    layer = layers[0]
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    names = ("c_attn", "c_proj")
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
        return None
    if not (hasattr(mlp, "c_fc") and hasattr(mlp, "c_proj")):
        return None
    heads, hidden = getattr(attn, "num_heads", None), getattr(attn, "embed_dim", None)
    if not (isinstance(heads, int) and isinstance(hidden, int)):
        return None
    head_dim = hidden // heads
    c_attn = attn.c_attn
    if _is_conv1d(getattr(c_attn, "base_layer", c_attn)):  # GPT-2: [q | k | v], split by split_size
        qkv: Style = FusedColwise(parts=(hidden,) * 3, split=(True,) * 3)
        attrs: tuple[str, ...] = ("split_size", "embed_dim", "num_heads")
    elif getattr(attn, "multi_query", False):  # one key/value head, read by every rank
        kv = getattr(attn, "kv_dim", head_dim)
        qkv = FusedColwise(parts=(hidden, kv, kv), split=(True, False, False))
        attrs = ("embed_dim", "num_heads", "num_key_value_groups")
    elif isinstance(c_attn, nn.Linear):  # [q, k, v] interleaved per head: whole heads
        qkv = ColwiseParallel(head_dim=3 * head_dim)
        attrs = ("embed_dim", "num_heads", "kv_heads", "kv_dim")
    else:
        return None

    def linear(module: nn.Module, colwise: bool) -> Style | None:
        if _is_conv1d(module):
            return Conv1DColwise() if colwise else Conv1DRowwise()
        base = getattr(module, "base_layer", None)
        if base is not None and _is_conv1d(base):
            # A peft LoRA layer around a Conv1D runs whole, from replicated weights: a
            # colwise one keeps this rank's block of its output, a rowwise one gathers its
            # input first.
            return FusedColwise(parts=(base.nf,), split=(True,)) if colwise else GatherInput(dim=-1)
        if isinstance(module, nn.Linear):
            return ColwiseParallel() if colwise else RowwiseParallel()
        return None

    styles: dict[str, Style] = {}
    attention: dict[str, tuple[str, ...]] = {}
    for i, block in enumerate(layers):
        prefix = f"{list_path}.{i}"
        parts = {
            "attn.c_attn": qkv,
            "attn.c_proj": linear(block.attn.c_proj, colwise=False),
            "mlp.c_fc": linear(block.mlp.c_fc, colwise=True),
            "mlp.c_proj": linear(block.mlp.c_proj, colwise=False),
        }
        if any(s is None for s in parts.values()):
            return None
        styles.update({f"{prefix}.{p}": s for p, s in parts.items()})  # type: ignore[misc]
        attention[f"{prefix}.attn"] = tuple(
            a for a in attrs if isinstance(getattr(block.attn, a, None), int)
        )
    return DerivedPlan({}, styles, attention)


def _falcon_like(list_path: str, layers: nn.ModuleList) -> DerivedPlan | None:
    """Falcon: ``self_attention.query_key_value`` (q, k and v fused), ``self_attention.dense``,
    ``mlp.dense_h_to_4h`` and ``mlp.dense_4h_to_h``. Multi-query: ``[q heads | k | v]``;
    otherwise ``[q, k, v]`` interleaved per head (whole heads per rank). The grouped layout of
    ``new_decoder_architecture`` gets no derived plan, nor does Falcon with ALiBi."""
    attn, mlp = getattr(layers[0], "self_attention", None), getattr(layers[0], "mlp", None)
    qkv_name, out_name = "query_key_value", "dense"
    if attn is None or mlp is None or getattr(attn, "new_decoder_architecture", True):
        return None
    if getattr(getattr(attn, "config", None), "alibi", False):
        return None  # its ALiBi biases are folded into a per-head mask, cut by neither style

    def linear(m: Any) -> bool:  # an nn.Linear, or a peft LoRA layer around one
        return isinstance(getattr(m, "base_layer", m), nn.Linear)

    up, down = getattr(mlp, "dense_h_to_4h", None), getattr(mlp, "dense_4h_to_h", None)
    if not all(
        linear(m) for m in (getattr(attn, qkv_name, None), getattr(attn, out_name, None), up, down)
    ):
        return None
    heads, head_dim = attn.num_heads, attn.head_dim
    if attn.multi_query:
        qkv: Style = FusedColwise(
            parts=(heads * head_dim, head_dim, head_dim), split=(True, False, False)
        )
        attrs: tuple[str, ...] = ("num_heads",)
    else:
        qkv = ColwiseParallel(head_dim=3 * head_dim)
        attrs = ("num_heads", "num_kv_heads")
    styles: dict[str, Style] = {}
    attention: dict[str, tuple[str, ...]] = {}
    for i in range(len(layers)):
        prefix = f"{list_path}.{i}"
        styles.update(
            {
                f"{prefix}.self_attention.{qkv_name}": qkv,
                f"{prefix}.self_attention.{out_name}": RowwiseParallel(),
                f"{prefix}.mlp.dense_h_to_4h": ColwiseParallel(),
                f"{prefix}.mlp.dense_4h_to_h": RowwiseParallel(),
            }
        )
        attention[f"{prefix}.self_attention"] = attrs
    return DerivedPlan({}, styles, attention)


def _bloom_like(list_path: str, layers: nn.ModuleList) -> DerivedPlan | None:
    """Bloom: ``self_attention.query_key_value`` (``[q, k, v]`` interleaved per head: whole
    heads per rank), ``self_attention.dense``, ``mlp.dense_h_to_4h`` and ``mlp.dense_4h_to_h``;
    the ALiBi biases the model builds for every head are cut to this rank's heads
    (:class:`AlibiHeads`)."""
    attn, mlp = getattr(layers[0], "self_attention", None), getattr(layers[0], "mlp", None)
    if attn is None or mlp is None or hasattr(attn, "new_decoder_architecture"):
        return None
    try:
        takes_alibi = "alibi" in inspect.signature(type(attn).forward).parameters
    except (TypeError, ValueError):
        return None
    heads, head_dim = getattr(attn, "num_heads", None), getattr(attn, "head_dim", None)
    if not (takes_alibi and isinstance(heads, int) and isinstance(head_dim, int)):
        return None
    names = ("query_key_value", "dense")
    modules = [getattr(attn, n, None) for n in names]
    modules += [getattr(mlp, "dense_h_to_4h", None), getattr(mlp, "dense_4h_to_h", None)]
    if not all(isinstance(getattr(m, "base_layer", m), nn.Linear) for m in modules):
        return None
    qkv = getattr(modules[0], "base_layer", modules[0])
    if qkv.out_features != 3 * heads * head_dim:  # type: ignore[union-attr]
        return None
    styles: dict[str, Style] = {}
    for i in range(len(layers)):
        prefix = f"{list_path}.{i}"
        styles.update(
            {
                f"{prefix}.self_attention": AlibiHeads(heads=heads),
                f"{prefix}.self_attention.query_key_value": ColwiseParallel(head_dim=3 * head_dim),
                f"{prefix}.self_attention.dense": RowwiseParallel(),
                f"{prefix}.mlp.dense_h_to_4h": ColwiseParallel(),
                f"{prefix}.mlp.dense_4h_to_h": RowwiseParallel(),
            }
        )
    return DerivedPlan({}, styles)
