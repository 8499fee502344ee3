"""Tensor-parallel styles: how one module runs split over the tensor-parallel axis.

A style gives the TP specs of a module's own parameters and wraps its forward with the
Megatron conjugate operations (:mod:`functional_fsdp.tp.ops`). Styles are immutable data;
:func:`functional_fsdp.tensor_parallel` matches them to modules through a plan, and the
wrappers run only inside ``FSDP.apply``, where a wrapped forward sees its parameters
gathered over the data axes only: the TP-local blocks.

Activations between modules are in one of three layouts over the tp axis: *replicated*
(every rank holds the whole tensor), *sharded* (split along the last, feature dim) or
*sequence* (split along the sequence dim, sequence parallelism). A colwise linear takes a
replicated (or sequence) input and gives a sharded output; a rowwise linear takes a sharded
input and gives a replicated (or sequence) output.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..dist import collectives as C
from ..spec import P
from .ops import copy_to, gather_from, reduce_from, scatter_to, vocab_parallel_embedding

Forward = Callable[..., Any]
ForwardWrapper = Callable[[Forward], Forward]


def _check_choice(style: object, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{type(style).__name__}({name}={value!r}): {name} must be one of {choices}."
        )


class Style(abc.ABC):
    """How one module runs split over the tensor-parallel axis.

    Subclasses give the TP specs of the module's own parameters (the rest are replicated
    over the axis), say why a module cannot take the style, and wrap its forward.

    Example:
        >>> import torch
        >>> class Double(Style):  # a style that only wraps the forward
        ...     def wrap(self, module, mesh, axis):
        ...         return lambda forward: lambda x: 2 * forward(x)
        >>> Double().param_specs(torch.nn.Linear(2, 2), "tp"), Double().problem(None, 2)
        ({}, None)
    """

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        """``{parameter name: P}`` for the module's own parameters split over ``axis``."""
        return {}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        """Why ``module`` cannot run with this style on ``tp`` ranks (with a fix), or ``None``."""
        return None

    @abc.abstractmethod
    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        """``forward -> forward``: the module's forward with the style's collectives."""


def _enter(x: torch.Tensor, layout: str, mesh: DeviceMesh, axis: str, seq_dim: int) -> torch.Tensor:
    if layout == "replicated":
        return copy_to(x, mesh, axis)
    if layout == "sequence":
        return C.all_gather(x, mesh, axis, seq_dim)
    return x  # "prepared": an enclosing PrepareInput entered the region (and reduces in backward)


def _divides(what: str, n: int, tp: int, fix: str) -> str | None:
    if n % tp:
        return f"tp={tp} does not divide its {n} {what}. {fix}"
    return None


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(Style):
    """An ``nn.Linear`` split over its output features: weight ``P("tp", None)``, bias ``P("tp")``.

    Attributes:
        input: the input's layout. ``"replicated"``: enter through :func:`copy_to` (its
            gradient is all-reduced); ``"sequence"``: all-gather it along ``sequence_dim``
            (reduce-scatter in backward); ``"prepared"``: an enclosing module's
            :class:`PrepareInput` already did one of these for several linears.
        output: ``"sharded"`` keeps the output split along the features (for a rowwise
            linear next, or vocab-sharded logits for :func:`vocab_parallel_cross_entropy`);
            ``"replicated"`` all-gathers it (:func:`gather_from`).
        sequence_dim: the sequence dim, for ``input="sequence"``.
        head_dim: output features per attention head, to check that tp divides the head count.

    Example:
        >>> ColwiseParallel(input="prepared", head_dim=16)
        ColwiseParallel(input='prepared', output='sharded', sequence_dim=1, head_dim=16)
    """

    input: Literal["replicated", "sequence", "prepared"] = "replicated"
    output: Literal["sharded", "replicated"] = "sharded"
    sequence_dim: int = 1
    head_dim: int | None = None

    def __post_init__(self) -> None:
        _check_choice(self, "input", self.input, ("replicated", "sequence", "prepared"))
        _check_choice(self, "output", self.output, ("sharded", "replicated"))

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        return {"weight": P(axis, None), "bias": P(axis)}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Linear):
            return f"ColwiseParallel needs an nn.Linear, not a {type(module).__name__}"
        out = module.out_features
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
        return _divides(
            "output features",
            out,
            tp,
            f"Use a tp that divides {out}, or make the layer's width a multiple of {tp}.",
        )

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def colwise(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                y = forward(_enter(x, self.input, mesh, axis, self.sequence_dim), *args, **kwargs)
                return gather_from(y, mesh, axis, -1) if self.output == "replicated" else y

            return colwise

        return wrapper


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(Style):
    """An ``nn.Linear`` split over its input features: weight ``P(None, "tp")``, bias replicated.

    The input arrives sharded along its last dim (from a colwise linear). The partial
    outputs are summed over tp (:func:`reduce_from`), then the bias is added once.

    Attributes:
        output: ``"replicated"`` all-reduces the output; ``"sequence"`` reduce-scatters it
            along ``sequence_dim`` into a sequence-parallel region.
        sequence_dim: the sequence dim, for ``output="sequence"``.

    Example:
        >>> RowwiseParallel(output="sequence")
        RowwiseParallel(output='sequence', sequence_dim=1)
    """

    output: Literal["replicated", "sequence"] = "replicated"
    sequence_dim: int = 1

    def __post_init__(self) -> None:
        _check_choice(self, "output", self.output, ("replicated", "sequence"))

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        return {"weight": P(None, axis)}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Linear):
            return f"RowwiseParallel needs an nn.Linear, not a {type(module).__name__}"
        n = module.in_features
        fix = f"Use a tp that divides {n}, or make the layer's input width a multiple of {tp}."
        return _divides("input features", n, tp, fix)

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        def wrapper(forward: Forward) -> Forward:
            def rowwise(x: torch.Tensor) -> torch.Tensor:
                y = F.linear(x, module.weight)
                bias = module.bias
                if self.output == "replicated":
                    y = reduce_from(y, mesh, axis)
                else:
                    y = C.reduce_scatter(y, mesh, axis, self.sequence_dim)
                    # Each rank sees only its part of the sequence: sum the bias gradient.
                    bias = copy_to(bias, mesh, axis) if bias is not None else None
                return y if bias is None else y + bias

            return rowwise

        return wrapper


@dataclass(frozen=True, kw_only=True)
class VocabParallelEmbedding(Style):
    """An ``nn.Embedding`` split over its rows (the vocabulary): weight ``P("tp", None)``.

    Ids outside a rank's block look up zeros; the partial results are all-reduced (see
    :func:`vocab_parallel_embedding`). A head tied to this weight takes
    :class:`ColwiseParallel`, and its vocab-sharded logits go to
    :func:`vocab_parallel_cross_entropy`.

    Attributes:
        output: ``"replicated"`` (all-reduce) or ``"sequence"`` (reduce-scatter along
            ``sequence_dim``).
        sequence_dim: the sequence dim, for ``output="sequence"``.

    Example:
        >>> VocabParallelEmbedding()
        VocabParallelEmbedding(output='replicated', sequence_dim=1)
    """

    output: Literal["replicated", "sequence"] = "replicated"
    sequence_dim: int = 1

    def __post_init__(self) -> None:
        _check_choice(self, "output", self.output, ("replicated", "sequence"))

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        return {"weight": P(axis, None)}

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Embedding):
            return f"VocabParallelEmbedding needs an nn.Embedding, not a {type(module).__name__}"
        if module.padding_idx is not None or module.max_norm is not None:
            return (
                "padding_idx and max_norm are not supported; build the embedding without "
                "them (mask padding in the loss with ignore_index)"
            )
        n = module.num_embeddings
        fix = f"Use a tp that divides {n}, or pad the vocabulary to a multiple of {tp}."
        return _divides("vocabulary rows", n, tp, fix)

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        seq = self.sequence_dim if self.output == "sequence" else None

        def wrapper(forward: Forward) -> Forward:
            def embedding(ids: torch.Tensor) -> torch.Tensor:
                return vocab_parallel_embedding(ids, module.weight, mesh, axis, sequence_dim=seq)

            return embedding

        return wrapper


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(Style):
    """A norm or dropout region run on this rank's part of the sequence.

    Input and output stay split along the sequence dim, so the forward communicates
    nothing. The parameters are replicated over tp, but each rank sees only part of the
    sequence, so they enter through :func:`copy_to` and their gradients are summed over tp.
    Every module that reads a sequence-split activation with replicated parameters needs
    this style, or its gradients stay partial. (Dropout masks come from each rank's RNG.)

    Example:
        >>> SequenceParallel()
        SequenceParallel()
    """

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        accessor = NamedMemberAccessor(module)

        def wrapper(forward: Forward) -> Forward:
            def sequence_parallel(*args: Any, **kwargs: Any) -> Any:
                params = {n: copy_to(p, mesh, axis) for n, p in module.named_parameters()}
                previous, _ = accessor.swap_tensors_dict(params)
                try:
                    return forward(*args, **kwargs)
                finally:
                    accessor.swap_tensors_dict(previous)

            return sequence_parallel

        return wrapper


@dataclass(frozen=True, kw_only=True)
class PrepareInput(Style):
    """Enter the tensor-parallel region once, for the colwise linears inside a module.

    Put it on a module (an attention or MLP block) whose colwise linears take
    ``ColwiseParallel(input="prepared")``: their inputs' gradients are then summed and
    reduced once, not once per linear.

    Attributes:
        sequence_dim: ``None``: the first input is replicated and enters through
            :func:`copy_to`; an int: it is split along that (sequence) dim and is all-gathered.

    Example:
        >>> PrepareInput(sequence_dim=1)
        PrepareInput(sequence_dim=1)
    """

    sequence_dim: int | None = None

    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> ForwardWrapper:
        layout = "replicated" if self.sequence_dim is None else "sequence"

        def wrapper(forward: Forward) -> Forward:
            def prepare(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                x = _enter(x, layout, mesh, axis, self.sequence_dim or 0)
                return forward(x, *args, **kwargs)

            return prepare

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
                return scatter_to(forward(*args, **kwargs), mesh, axis, self.dim)

            return scatter

        return wrapper
