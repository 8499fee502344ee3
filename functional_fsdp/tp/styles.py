"""Tensor-parallel styles: how one module runs split over the tensor-parallel axis.

A style gives the TP specs of a module's parameters and wraps its forward with the
Megatron conjugate operations (:mod:`functional_fsdp.tp.ops`). Styles are immutable data;
:func:`functional_fsdp.tensor_parallel` matches them to modules through a plan, and the
wrappers run only inside ``FSDP.apply``, where a wrapped forward sees its parameters
gathered over the data axes only: the TP-local blocks. A style reads parameters from the
module it is given at call time, never from one captured when the plan was made.

Activations between modules are in one of three layouts over the tp axis: *replicated*
(every rank holds the whole tensor), *sharded* (split along the last, feature dim) or
*sequence* (split along the sequence dim, sequence parallelism). A colwise linear takes a
replicated (or sequence) input and gives a sharded output; a rowwise linear takes a sharded
input and gives a replicated (or sequence) output.

A module's *input* is its forward's first argument, passed positionally or by keyword (Hugging
Face decoder layers call ``self_attn(hidden_states=...)``); ``input_kwarg=`` names another one.

Per-rank attributes: code that reshapes with a global size (``q.view(b, t, self.n_heads, hd)``)
does not fit the local blocks. :class:`PrepareInput` and :class:`LocalAttributes` take
``local_attributes=``, attributes set to their per-rank value (e.g. divided by tp) for the
duration of the module's call, as torchtitan's plans adjust ``n_heads``.

``nn.Linear`` styles also take a peft LoRA layer around an ``nn.Linear`` (plain LoRA): the
base weight is split as usual, ``lora_B`` of a colwise layer splits its output dim like the
base weight, ``lora_A`` of a rowwise layer splits its input dim; the other LoRA factor is
replicated and its gradient is summed over tp.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from .. import rng
from ..distributed import collectives as C
from ..distributed.simulate import per_coordinate
from ..spec import P
from .ops import (
    _local_ids,
    copy_to,
    fill_padding,
    gather_from,
    reduce_from,
    scatter_to,
    vocab_parallel_embedding,
)
from .ops import _size as size

Forward = Callable[..., Any]
ForwardWrapper = Callable[[Forward], Forward]
LocalRule = Callable[[Any, int], Any]


def _check_choice(style: object, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{type(style).__name__}({name}={value!r}): {name} must be one of {choices}."
        )


class Style(abc.ABC):
    """How one module runs split over the tensor-parallel axis.

    Subclasses give the TP specs of the module's parameters (the rest are replicated over
    the axis), say why a module cannot take the style, give per-rank attribute values, and
    wrap its forward.

    Example:
        >>> import torch
        >>> class Double(Style):  # a style that only wraps the forward
        ...     def wrap(self, module, mesh, axis):
        ...         return lambda forward: lambda x: 2 * forward(x)
        >>> Double().param_specs(torch.nn.Linear(2, 2), "tp"), Double().problem(None, 2)
        ({}, None)
    """

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        """``{parameter name: P}`` for parameters split over ``axis``, named relative to
        ``module`` (its own, or a submodule's such as a LoRA layer's ``"base_layer.weight"``)."""
        return {}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        """Why ``module`` cannot run with this style on ``tp`` ranks (with a fix), or ``None``."""
        return None

    def local_attributes(self, module: nn.Module, tp: int) -> dict[str, Any]:
        """``{attribute: per-rank value}`` set on the module for the duration of its call."""
        return {}

    @abc.abstractmethod
    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        """``forward -> forward``: the module's forward with the style's collectives."""


# --------------------------------------------------------------------------- helpers


def _enter(x: torch.Tensor, layout: str, mesh: DeviceMesh, axis: str, seq_dim: int) -> torch.Tensor:
    if layout == "replicated":
        return copy_to(x, mesh, axis)
    if layout == "sequence":
        return _leave_sequence(C.all_gather(x, mesh, axis, seq_dim))
    return x  # "prepared": an enclosing PrepareInput entered the region (and reduces in backward)


def _enter_sequence(x: Any) -> Any:
    """``x`` has just entered the sequence-parallel region: draw from each tp rank's own
    stream from now on (:func:`functional_fsdp.rng.sequence_stream`; forward only)."""
    rng.sequence_stream(True)
    return x


def _leave_sequence(x: Any) -> Any:
    """``x`` has just been gathered out of the sequence-parallel region: draw from the stream
    common to the tp ranks from now on."""
    rng.sequence_stream(False)
    return x


def _divides(what: str, n: int, tp: int, fix: str) -> str | None:
    if n % tp:
        return f"tp={tp} does not divide its {n} {what}. {fix}"
    return None


@functools.cache
def _first_parameter(forward: Callable[..., Any]) -> str | None:
    """The name of an (unbound) ``forward``'s first argument after ``self``."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return params[0].name if params and params[0].kind in kinds else None


def _map_input(
    style: Style,
    module: nn.Module,
    input_kwarg: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fn: Callable[[Any], Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply ``fn`` to the module's input: the keyword argument naming it, or ``args[0]``."""
    name = input_kwarg or _first_parameter(type(module).forward)
    if name is not None and name in kwargs:
        return args, {**kwargs, name: fn(kwargs[name])}
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    raise TypeError(
        f"{style} on {type(module).__name__}: the call passed no positional argument and no "
        f"keyword argument {name!r} to take as the module's input (it got keywords "
        f"{sorted(kwargs)}). Name the input's keyword: "
        f"{type(style).__name__}(input_kwarg=...)."
    )


def _input(
    style: Style,
    module: nn.Module,
    input_kwarg: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    found: list[Any] = []
    _map_input(style, module, input_kwarg, args, kwargs, lambda x: found.append(x) or x)
    return found[0]


@contextlib.contextmanager
def _attributes_set(module: nn.Module, values: Mapping[str, Any]) -> Iterator[None]:
    """Module attributes set for the duration of the block, then restored (or removed)."""
    missing = object()
    saved = {n: module.__dict__.get(n, missing) for n in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


@contextlib.contextmanager
def _swapped(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Module tensors (dotted names) replaced for the duration of the block."""
    if not tensors:
        yield
        return
    accessor = NamedMemberAccessor(module)
    previous, _ = accessor.swap_tensors_dict(dict(tensors))
    try:
        yield
    finally:
        accessor.swap_tensors_dict(previous)


def _summed_over_tp(
    module: nn.Module, names: Sequence[str], mesh: DeviceMesh, axis: str
) -> dict[str, torch.Tensor]:
    """Replicated parameters whose gradients are partial per rank, through :func:`copy_to`."""
    accessor = NamedMemberAccessor(module)
    return {n: copy_to(accessor.get_tensor(n), mesh, axis) for n in names}


def _submodules_of_type(module: nn.Module, cls: type[nn.Module]) -> list[str]:
    return [p for p, m in module.named_modules() if p and isinstance(m, cls)]


def _wrong_type(style: Style, module: nn.Module, cls: type[nn.Module], lora: bool) -> str:
    msg = f"{type(style).__name__} needs an nn.{cls.__name__}, not a {type(module).__name__}"
    if lora:
        msg += f" (or a peft LoRA layer around an nn.{cls.__name__})"
    inside = _submodules_of_type(module, cls)
    if inside:
        msg += (
            f"; its nn.{cls.__name__} submodules are {inside[:6]}: point the pattern at them "
            f"(append '.{inside[0]}'), and give this module PrepareInput() if they share its input"
        )
    return msg


# --------------------------------------------------------------------------- peft LoRA


@dataclass(frozen=True)
class _Lora:
    """A peft LoRA layer around an ``nn.Linear`` (duck-typed: peft is not imported)."""

    base: nn.Linear
    adapters: tuple[str, ...]

    @staticmethod
    def of(module: nn.Module) -> _Lora | None:
        base = getattr(module, "base_layer", None)
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not (
            isinstance(base, nn.Linear)
            and isinstance(lora_a, nn.ModuleDict)
            and isinstance(lora_b, nn.ModuleDict)
        ):
            return None
        return _Lora(base, tuple(lora_a.keys()))

    def problem(self, module: nn.Module, style: Style, rowwise: bool) -> str | None:
        variants = sorted(getattr(module, "lora_variant", None) or {})
        if variants:
            return (
                f"{type(style).__name__} supports plain LoRA only; adapters {variants} use a "
                f"LoRA variant (DoRA, ...). Build them with use_dora=False, or leave this "
                f"module out of the plan."
            )
        if getattr(module, "merged_adapters", None):
            return "its adapters are merged into the base weight; unmerge them first"
        for name in self.adapters:
            a, b = module.lora_A[name], module.lora_B[name]  # type: ignore[index]
            if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)):
                return f"adapter {name!r}'s lora_A/lora_B are not nn.Linear"
            if rowwise and b.bias is not None:
                return (
                    f"adapter {name!r} has a lora_B bias (lora_bias=True), which a rowwise "
                    f"layer would add once per rank; build it with lora_bias=False"
                )
        return None


# --------------------------------------------------------------------------- linear styles


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(Style):
    """An ``nn.Linear`` split over its output features: weight ``P("tp", None)``, bias ``P("tp")``.

    On a peft LoRA layer around an ``nn.Linear``, ``lora_B`` is split like the base weight
    and ``lora_A`` is replicated (its gradient summed over tp); peft's forward runs as is.
    (LoRA dropout then draws a mask per rank for the whole input.)

    Attributes:
        input: the input's layout. ``"replicated"``: enter through :func:`copy_to` (its
            gradient is all-reduced); ``"sequence"``: all-gather it along ``sequence_dim``
            (reduce-scatter in backward); ``"prepared"``: an enclosing module's
            :class:`PrepareInput` already did one of these for several linears.
        output: ``"sharded"`` keeps the output split along the features (for a rowwise
            linear next, or vocab-sharded logits for :func:`vocab_parallel_cross_entropy`);
            ``"replicated"`` all-gathers it (:func:`gather_from`).

        padded: allow ``"sharded"`` outputs whose width tp does not divide (logits).

    When tp does not divide the output features (a vocabulary of 50257 on tp=2), the weight's
    last block is padded: ``"replicated"`` outputs drop the padding; ``"sharded"`` outputs,
    with ``padded=True``, hold ``-inf`` in the padded features, so a softmax and
    :func:`vocab_parallel_cross_entropy` ignore them. (A rowwise layer still needs tp to
    divide its input features.)
        sequence_dim: the sequence dim, for ``input="sequence"``.
        head_dim: output features per attention head, to check that tp divides the head count.
        input_kwarg: the keyword the input is passed by, if not the forward's first argument.

    Example:
        >>> ColwiseParallel(input="prepared", head_dim=16)
        ColwiseParallel(input='prepared', output='sharded', sequence_dim=1, head_dim=16, input_kwarg=None, padded=False)
    """

    input: Literal["replicated", "sequence", "prepared"] = "replicated"
    output: Literal["sharded", "replicated"] = "sharded"
    sequence_dim: int = 1
    head_dim: int | None = None
    input_kwarg: str | None = None
    padded: bool = False

    def __post_init__(self) -> None:
        _check_choice(self, "input", self.input, ("replicated", "sequence", "prepared"))
        _check_choice(self, "output", self.output, ("sharded", "replicated"))

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        split = {"weight": P(axis, None), "bias": P(axis)}
        lora = _Lora.of(module)
        if lora is None:
            return split
        out = {f"base_layer.{n}": s for n, s in split.items()}
        for name in lora.adapters:
            out.update({f"lora_B.{name}.{n}": s for n, s in split.items()})
        return out

    def problem(self, module: nn.Module, tp: int) -> str | None:
        lora = _Lora.of(module)
        if lora is None and not isinstance(module, nn.Linear):
            return _wrong_type(self, module, nn.Linear, lora=True)
        if lora is not None and (problem := lora.problem(module, self, rowwise=False)):
            return problem
        out = (lora.base if lora else module).out_features  # type: ignore[union-attr]
        if self.head_dim is not None:
            if out % self.head_dim:
                return f"its {out} output features are not whole heads of head_dim {self.head_dim}"
            heads = out // self.head_dim
            ok = [d for d in range(1, heads + 1) if heads % d == 0]
            return _divides(
                f"attention heads ({out} output features, head_dim {self.head_dim})",
                heads,
                tp,
                f"Use a tp that divides the head count (one of {ok}), or change the number "
                f"of heads.",
            )
        if out % tp and self.output == "sharded" and not self.padded:
            return (
                f"tp={tp} does not divide its {out} output features. Use a tp that divides "
                f"{out}, or ColwiseParallel(padded=True) for logits (the last block is padded "
                f"and its padded outputs are -inf), or output='replicated'."
            )
        return None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        lora = _Lora.of(module)
        replicated = [f"lora_A.{n}.weight" for n in lora.adapters] if lora else []
        out = getattr(lora.base if lora else module, "out_features", None)

        def leave(y: torch.Tensor) -> torch.Tensor:
            if self.output == "replicated":
                y = gather_from(y, mesh, axis, -1)
                return y if out is None or y.shape[-1] == out else y[..., :out]
            if out is None or out % size(mesh, axis) == 0:
                return y
            return fill_padding(y, out, mesh, axis, float("-inf"))

        def enter(x: torch.Tensor) -> torch.Tensor:
            return _enter(x, self.input, mesh, axis, self.sequence_dim)

        def wrapper(forward: Forward) -> Forward:
            def colwise(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = _map_input(self, module, self.input_kwarg, args, kwargs, enter)
                with _swapped(module, _summed_over_tp(module, replicated, mesh, axis)):
                    y = forward(*args, **kwargs)
                return leave(y)

            return colwise

        return wrapper


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(Style):
    """An ``nn.Linear`` split over its input features: weight ``P(None, "tp")``, bias replicated.

    The input arrives sharded along its last dim (from a colwise linear). The partial
    outputs are summed over tp (:func:`reduce_from`), then the bias is added once. On a peft
    LoRA layer, ``lora_A`` is split like the base weight and ``lora_B`` is replicated (its
    gradient summed over tp); base and LoRA partial outputs are reduced together.

    A subclass of ``nn.Linear`` with its own forward runs that forward on the local blocks
    (with a zero bias), so it must be linear in its input.

    Attributes:
        output: ``"replicated"`` all-reduces the output; ``"sequence"`` reduce-scatters it
            along ``sequence_dim`` into a sequence-parallel region.
        sequence_dim: the sequence dim, for ``output="sequence"``.
        input_kwarg: the keyword the input is passed by, if not the forward's first argument.
        input: ``"sharded"``: the input arrives split along its last dim; ``"replicated"``:
            it arrives whole and each rank keeps its block (:func:`scatter_to`), for a
            colwise layer with ``output="replicated"`` before it (``transformers``'
            ``"rowwise_split_input"``).

    Example:
        >>> RowwiseParallel(output="sequence")
        RowwiseParallel(output='sequence', sequence_dim=1, input_kwarg=None, input='sharded')
    """

    output: Literal["replicated", "sequence"] = "replicated"
    sequence_dim: int = 1
    input_kwarg: str | None = None
    input: Literal["sharded", "replicated"] = "sharded"

    def __post_init__(self) -> None:
        _check_choice(self, "output", self.output, ("replicated", "sequence"))
        _check_choice(self, "input", self.input, ("sharded", "replicated"))

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        lora = _Lora.of(module)
        if lora is None:
            return {"weight": P(None, axis)}
        return {
            "base_layer.weight": P(None, axis),
            **{f"lora_A.{n}.weight": P(None, axis) for n in lora.adapters},
        }

    def problem(self, module: nn.Module, tp: int) -> str | None:
        lora = _Lora.of(module)
        if lora is None and not isinstance(module, nn.Linear):
            return _wrong_type(self, module, nn.Linear, lora=True)
        if lora is not None and (problem := lora.problem(module, self, rowwise=True)):
            return problem
        n = (lora.base if lora else module).in_features  # type: ignore[union-attr]
        fix = f"Use a tp that divides {n}, or make the layer's input width a multiple of {tp}."
        return _divides("input features", n, tp, fix)

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        lora = _Lora.of(module)
        prefix = "base_layer." if lora else ""
        replicated = [f"lora_B.{n}.weight" for n in lora.adapters] if lora else []

        def reduce(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if self.output == "replicated":
                y = reduce_from(y, mesh, axis)
            else:
                y = _enter_sequence(C.reduce_scatter(y, mesh, axis, self.sequence_dim))
                # Each rank sees only its part of the sequence: sum the bias gradient.
                bias = copy_to(bias, mesh, axis) if bias is not None else None
            return y if bias is None else y + bias

        plain = lora is None and type(module).forward is nn.Linear.forward

        def split(x: torch.Tensor) -> torch.Tensor:
            return scatter_to(x, mesh, axis, -1)

        def wrapper(forward: Forward) -> Forward:
            def rowwise(*args: Any, **kwargs: Any) -> torch.Tensor:
                base = lora.base if lora else module  # type: ignore[union-attr]
                bias = base.bias
                if self.input == "replicated":
                    args, kwargs = _map_input(self, module, self.input_kwarg, args, kwargs, split)
                if plain:
                    x = _input(self, module, self.input_kwarg, args, kwargs)
                    return reduce(F.linear(x, base.weight), bias)
                # The module's own forward (peft's, or a subclass's) on the local blocks gives
                # a partial sum; the bias is added once, after the reduction.
                swaps = _summed_over_tp(module, replicated, mesh, axis)
                if bias is not None:
                    swaps[f"{prefix}bias"] = torch.zeros_like(bias)
                with _swapped(module, swaps):
                    y = forward(*args, **kwargs)
                return reduce(y, bias)

            return rowwise

        return wrapper


# --------------------------------------------------------------------------- other styles


@dataclass(frozen=True, kw_only=True)
class VocabParallelEmbedding(Style):
    """An ``nn.Embedding`` split over its rows (the vocabulary): weight ``P("tp", None)``.

    Ids outside a rank's block look up zeros; the partial results are all-reduced (see
    :func:`vocab_parallel_embedding`). A subclass with its own forward (Gemma's embedding,
    scaled by sqrt(hidden)) runs that forward on the local rows, with the ids shifted into
    them, and the rows the rank does not own are zeroed after it: the forward must act on
    each looked-up row alone (a scale does). A vocabulary that tp does not divide is padded
    at the end of the last block; the padded rows are never looked up. A head tied to this weight takes
    :class:`ColwiseParallel`, and its vocab-sharded logits go to
    :func:`vocab_parallel_cross_entropy`. A ``padding_idx`` row gets no gradient, as in
    ``nn.Embedding``.

    Attributes:
        output: ``"replicated"`` (all-reduce) or ``"sequence"`` (reduce-scatter along
            ``sequence_dim``).
        sequence_dim: the sequence dim, for ``output="sequence"``.
        input_kwarg: the keyword the ids are passed by, if not the forward's first argument.

    Example:
        >>> VocabParallelEmbedding()
        VocabParallelEmbedding(output='replicated', sequence_dim=1, input_kwarg=None)
    """

    output: Literal["replicated", "sequence"] = "replicated"
    sequence_dim: int = 1
    input_kwarg: str | None = None

    def __post_init__(self) -> None:
        _check_choice(self, "output", self.output, ("replicated", "sequence"))

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        return {"weight": P(axis, None)}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Embedding):
            return _wrong_type(self, module, nn.Embedding, lora=False)
        if module.max_norm is not None:
            return "max_norm is not supported; build the embedding without it"
        return None  # tp need not divide the vocabulary: the last block is padded

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        seq = self.sequence_dim if self.output == "sequence" else None
        pad = module.padding_idx if isinstance(module, nn.Embedding) else None
        plain = type(module).forward is nn.Embedding.forward

        def own_forward(
            forward: Forward, weight: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> torch.Tensor:
            # A subclass's forward (Gemma's embedding scales by sqrt(hidden)) runs on this
            # rank's rows with ids shifted into them; the rows other ranks own give zero.
            ids = _input(self, module, self.input_kwarg, args, kwargs)
            local, inside = _local_ids(ids, weight.shape[0], mesh, axis)
            args, kwargs = _map_input(self, module, self.input_kwarg, args, kwargs, lambda _: local)
            with (
                _swapped(module, {"weight": weight}),
                _attributes_set(module, {"padding_idx": None}),
            ):
                out = forward(*args, **kwargs)
            out = out * inside.unsqueeze(-1).to(out.dtype)
            if seq is None:
                return C.all_reduce(out, mesh, axis)
            return _enter_sequence(C.reduce_scatter(out, mesh, axis, seq))

        def wrapper(forward: Forward) -> Forward:
            def embedding(*args: Any, **kwargs: Any) -> torch.Tensor:
                ids = _input(self, module, self.input_kwarg, args, kwargs)
                weight = module.weight
                if pad is not None:  # the padding row's gradient is zero
                    rows = weight.shape[0]
                    frozen = per_coordinate(
                        mesh,
                        lambda c: (
                            torch.arange(rows, device=weight.device) + c[axis] * rows == pad
                        ).unsqueeze(-1),
                    )
                    weight = torch.where(frozen, weight.detach(), weight)
                if not plain:
                    return own_forward(forward, weight, args, kwargs)
                out = vocab_parallel_embedding(ids, weight, mesh, axis, sequence_dim=seq)
                return out if seq is None else _enter_sequence(out)

            return embedding

        return wrapper


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(Style):
    """A norm or dropout region run on this rank's part of the sequence.

    Input and output stay split along the sequence dim, so the forward communicates
    nothing. The parameters are replicated over tp, but each rank sees only part of the
    sequence, so they enter through :func:`copy_to` and their gradients are summed over tp.
    Every module that reads a sequence-split activation with replicated parameters needs
    this style, or its gradients stay partial. (Dropout here draws from each tp rank's own
    stream under a key: :func:`functional_fsdp.rng.sequence_stream`.)

    Example:
        >>> SequenceParallel()
        SequenceParallel()
    """

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        return _parameter_gradients_summed(module, mesh, axis)


def _parameter_gradients_summed(module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
    def wrapper(forward: Forward) -> Forward:
        def summed(*args: Any, **kwargs: Any) -> Any:
            names = [n for n, _ in module.named_parameters()]
            with _swapped(module, _summed_over_tp(module, names, mesh, axis)):
                return forward(*args, **kwargs)

        return summed

    return wrapper


@dataclass(frozen=True, kw_only=True)
class ReplicatedParallel(Style):
    """A module with replicated parameters that reads an activation split over tp.

    Each rank's gradient of its parameters is then partial (from its heads or features
    only), so the parameters enter through :func:`copy_to` and their gradients are summed
    over tp. For a norm applied per head to head-split queries and keys (Qwen3's and
    Gemma-3's ``q_norm``/``k_norm``; ``transformers``' ``"replicated_with_grad_allreduce"``).
    A norm over the whole projection needs the whole features instead: gather them
    (``ColwiseParallel(output="replicated")``).

    Example:
        >>> ReplicatedParallel()
        ReplicatedParallel()
    """

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        return _parameter_gradients_summed(module, mesh, axis)


# transformers experts implementations that skip expert ids >= num_experts (the sentinel of
# other ranks' experts) when the module's _is_expert_parallel is set.
_SENTINEL_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


@dataclass(frozen=True, kw_only=True)
class ExpertParallel(Style):
    """A ``transformers`` mixture-of-experts module (``MixtralExperts``, ``Qwen2MoeExperts``)
    with its experts split over tp: every expert weight ``P("tp", None, None)``.

    The module is called as ``experts(hidden_states, top_k_index, top_k_weights)`` with the
    routing computed on every rank. Each rank runs only its own experts: the indices of other
    ranks' experts become the module's "no expert" value (``num_experts``, which it skips),
    ``num_experts`` is the local count for the call, and the partial outputs are summed
    over tp (:func:`reduce_from`). The hidden states and routing weights enter through
    :func:`copy_to`, so their gradients (and the router's) are summed.

    ``transformers``' own plan splits each expert's intermediate features instead
    (``"packed_colwise"`` on ``gate_up_proj``, whose gate and up halves are interleaved per
    rank), a layout a :class:`~functional_fsdp.P` cannot express; splitting whole experts
    needs only ``P``.

    Runs under ``transformers``' eager experts implementation and under its default ones,
    ``"grouped_mm"`` and ``"batched_mm"`` (stacked expert weights, ``[experts, out, in]``):
    those skip the "no expert" index when the module's ``_is_expert_parallel`` is set, which
    this style sets for the call. Needs tp dividing the number of experts.

    Example:
        >>> ExpertParallel()
        ExpertParallel()
    """

    def _experts(self, module: nn.Module) -> int | None:
        n = getattr(module, "num_experts", None)
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        n = self._experts(module)
        return {
            name: P(axis)
            for name, p in module.named_parameters(recurse=False)
            if p.ndim and p.shape[0] == n
        }

    def problem(self, module: nn.Module, tp: int) -> str | None:
        n = self._experts(module)
        if n is None:
            return (
                f"ExpertParallel needs a transformers experts module with an integer "
                f"num_experts (MixtralExperts, Qwen2MoeExperts, ...), not a {type(module).__name__}"
            )
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if impl not in (None, "eager") and not (
            impl in _SENTINEL_IMPLEMENTATIONS and hasattr(module, "_is_expert_parallel")
        ):
            return (
                f"its experts implementation is {impl!r}; ExpertParallel runs the eager one and "
                f"{', '.join(map(repr, _SENTINEL_IMPLEMENTATIONS))} (build the model with "
                f"experts_implementation='eager' or one of those)"
            )
        return _divides("experts", n, tp, "Use a tp that divides the number of experts.")

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        tp = size(mesh, axis)
        local = (self._experts(module) or 0) // tp
        signature = inspect.signature(type(module).forward)  # (self, hidden, index, weights)

        def wrapper(forward: Forward) -> Forward:
            def experts(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(module, *args, **kwargs)
                x, index, weights = list(bound.arguments.values())[1:4]
                shifted, mine = _local_ids(index, local, mesh, axis)
                index = torch.where(mine, shifted, torch.full_like(shifted, local))
                x, weights = copy_to(x, mesh, axis), copy_to(weights, mesh, axis)
                local_attributes: dict[str, Any] = {"num_experts": local}
                if hasattr(module, "_is_expert_parallel"):  # skip the sentinel `local`
                    local_attributes["_is_expert_parallel"] = True
                with _attributes_set(module, local_attributes):
                    return reduce_from(forward(x, index, weights), mesh, axis)

            return experts

        return wrapper


def divide_by_tp(value: int, tp: int) -> int:
    """A per-rank attribute rule: ``value // tp``, refusing a ``value`` that tp does not divide.

    The default rule of ``local_attributes=`` (e.g. a module's head count).

    Example:
        >>> divide_by_tp(8, 2)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"divide_by_tp: the attribute is {value!r} ({type(value).__name__}), not an int; "
            f"give it its own rule, local_attributes={{name: lambda value, tp: ...}}."
        )
    if value % tp:
        raise ValueError(f"tp={tp} does not divide its value {value}; use a tp that divides it")
    return value // tp


def _rules(
    style: Style, value: Sequence[str] | Mapping[str, LocalRule]
) -> tuple[tuple[str, LocalRule], ...]:
    if isinstance(value, str):
        value = (value,)
    items = value.items() if isinstance(value, Mapping) else value
    rules = []
    for item in items:
        pair = isinstance(item, tuple) and len(item) == 2  # already (name, rule)
        name, rule = item if pair else (item, divide_by_tp)
        if not (isinstance(name, str) and name.isidentifier() and callable(rule)):
            raise TypeError(
                f"{type(style).__name__}(per_rank=...): entries are attribute names (divided "
                f"by tp) or {{name: rule(value, tp)}}, e.g. ('n_heads',) or "
                f"{{'n_heads': divide_by_tp}}; got {item!r}."
            )
        rules.append((name, rule))
    return tuple(rules)


class _PerRank:
    """``per_rank`` attributes: normalised to ``((name, rule), ...)`` and applied per call."""

    per_rank: Any

    def _normalise_per_rank(self) -> None:
        object.__setattr__(self, "per_rank", _rules(self, self.per_rank))  # type: ignore[arg-type]

    def local_attributes(self, module: nn.Module, tp: int) -> dict[str, Any]:
        out = {}
        for name, rule in self.per_rank:
            if not hasattr(module, name):
                raise AttributeError(
                    f"{type(module).__name__} has no attribute {name!r} to set per rank; name "
                    f"one of its attributes"
                )
            try:
                out[name] = rule(getattr(module, name), tp)
            except (TypeError, ValueError) as e:
                raise type(e)(f"per-rank attribute {name!r}: {e}") from None
        return out

    def problem(self, module: nn.Module, tp: int) -> str | None:
        try:
            self.local_attributes(module, tp)
        except (AttributeError, TypeError, ValueError) as e:
            return str(e)
        return None


PerRank = Sequence[str] | Mapping[str, LocalRule]


@dataclass(frozen=True, kw_only=True)
class PrepareInput(_PerRank, Style):
    """Enter the tensor-parallel region once, for the colwise linears inside a module.

    Put it on a module (an attention or MLP block) whose colwise linears take
    ``ColwiseParallel(input="prepared")``: their inputs' gradients are then summed and
    reduced once, not once per linear.

    Attributes:
        sequence_dim: ``None``: the input is replicated and enters through
            :func:`copy_to`; an int: it is split along that (sequence) dim and is all-gathered.
        input_kwarg: the keyword the input is passed by, if not the forward's first argument
            (by default the first argument, positional or by its keyword: an HF decoder
            layer's ``self_attn(hidden_states=...)`` needs nothing).
        per_rank: attributes set to their per-rank value for the module's call only: names
            divided by tp (``("n_heads",)``) or ``{name: rule(value, tp)}``; for code that
            reshapes with a global size, e.g. ``q.view(b, t, self.n_heads, head_dim)``.

    Example:
        >>> attn = torch.nn.Module()
        >>> attn.n_heads = 8
        >>> PrepareInput(per_rank=("n_heads",)).local_attributes(attn, 2), attn.n_heads
        ({'n_heads': 4}, 8)
    """

    sequence_dim: int | None = None
    input_kwarg: str | None = None
    per_rank: PerRank = ()

    def __post_init__(self) -> None:
        self._normalise_per_rank()

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        layout = "replicated" if self.sequence_dim is None else "sequence"

        def enter(x: torch.Tensor) -> torch.Tensor:
            return _enter(x, layout, mesh, axis, self.sequence_dim or 0)

        def wrapper(forward: Forward) -> Forward:
            def prepare(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = _map_input(self, module, self.input_kwarg, args, kwargs, enter)
                return forward(*args, **kwargs)

            return prepare

        return wrapper


@dataclass(frozen=True)
class LocalAttributes(_PerRank, Style):
    """Set attributes of a module to their per-rank values for its call; nothing else.

    For a module that needs per-rank attributes but no :class:`PrepareInput` (its colwise
    linears enter the region themselves). The user's module is never changed: the values
    hold for the duration of the call only.

    Attributes:
        per_rank: names divided by tp (``("n_heads", "n_kv_heads")``) or
            ``{name: rule(value, tp)}``, e.g. ``{"n_heads": divide_by_tp}``.

    Example:
        >>> attn = torch.nn.Module()
        >>> attn.n_heads, attn.scale = 8, 0.5
        >>> LocalAttributes({"n_heads": divide_by_tp, "scale": lambda v, tp: v}).local_attributes(attn, 4)
        {'n_heads': 2, 'scale': 0.5}
    """

    per_rank: PerRank = ()

    def __post_init__(self) -> None:
        self._normalise_per_rank()

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        return lambda forward: forward


@dataclass(frozen=True, kw_only=True)
class ScatterInput(Style):
    """Keep this rank's block of the (replicated) input along ``dim``: :func:`scatter_to`.

    Enters a sequence-parallel region at a module's input, e.g. at the first decoder layer
    of a model that computes its attention mask and positions from the full embedding.

    Attributes:
        dim: the dim to split (the sequence dim).
        input_kwarg: the keyword the input is passed by, if not the forward's first argument.

    Example:
        >>> ScatterInput(dim=1)
        ScatterInput(dim=1, input_kwarg=None)
    """

    dim: int = 1
    input_kwarg: str | None = None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def scatter(x: torch.Tensor) -> torch.Tensor:
            return _enter_sequence(scatter_to(x, mesh, axis, self.dim))

        def wrapper(forward: Forward) -> Forward:
            def scatter_input(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = _map_input(self, module, self.input_kwarg, args, kwargs, scatter)
                return forward(*args, **kwargs)

            return scatter_input

        return wrapper


@dataclass(frozen=True, kw_only=True)
class ScatterOutput(Style):
    """Keep this rank's block of the (replicated) output along ``dim``: :func:`scatter_to`.

    For modules whose output joins a sequence-parallel region, such as a position
    embedding looked up for the whole sequence (``dim=0`` for ``[seq, dim]``).

    Example:
        >>> ScatterOutput(dim=0)
        ScatterOutput(dim=0)
    """

    dim: int = 1

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def scatter(*args: Any, **kwargs: Any) -> Any:
                return _enter_sequence(scatter_to(forward(*args, **kwargs), mesh, axis, self.dim))

            return scatter

        return wrapper
