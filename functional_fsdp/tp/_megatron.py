"""The Megatron plan of a decoder, from where its linears are and what kind each one is.

One function builds the styles of :func:`~functional_fsdp.hf_tp_plan` (keys are module
paths read off the model) and :func:`~functional_fsdp.llama_plan` (keys are patterns written
from Llama's module names): colwise and rowwise linears, one :class:`PrepareInput` per block
whose colwise linears all read the block's input, and, with sequence parallelism, the
residual stream split along the sequence between the decoder layers.

:func:`reads_input_only` decides, from a module's ``forward`` source, whether a block may take
:class:`PrepareInput`: its input must reach nothing but those linears (and shape queries).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Collection, Iterable, Mapping

from torch import nn

from .styles import (
    ColwiseParallel,
    PrepareInput,
    RowwiseParallel,
    ScatterInput,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
)

# transformers' linear styles: (colwise?, output gathered / input split)
LINEAR_KINDS = ("colwise", "colwise_gather_output", "rowwise", "rowwise_split_input")
COLWISE_KINDS = ("colwise", "colwise_gather_output")
# Reading these off the input needs no value of it (they hold also after PrepareInput).
_SHAPE_ATTRIBUTES = ("shape", "dtype", "device", "ndim")
_SHAPE_METHODS = ("size", "dim")


def megatron_plan(
    linears: Mapping[str, str],
    *,
    blocks: Collection[str] = (),
    head_dims: Mapping[str, int] | None = None,
    embedding: str | None = None,
    head: str | None = None,
    first_layer: str | None = None,
    sequence_norms: Iterable[str] = (),
    loss_parallel: bool = True,
    sequence_parallel: bool = False,
) -> dict[str, Style]:
    """``{key: Style}`` for a decoder's linears, blocks, embedding, head and norms.

    Args:
        linears: ``{key: transformers style}``, one of :data:`LINEAR_KINDS`; keys are module
            paths or patterns.
        blocks: keys of modules whose colwise linears (the keys ``f"{block}.{name}"``) read
            nothing but the block's input: the block gets :class:`PrepareInput` and they
            ``input="prepared"``, so their input gradient is all-reduced once.
        head_dims: ``{linear key: head_dim}`` for colwise linears split by attention heads.
        embedding: the input embedding's key (vocab-parallel).
        head: the output head's key (colwise over the vocabulary).
        first_layer: the first decoder layer (its input is scattered along the sequence).
        sequence_norms: modules with replicated parameters on the sequence-split residual
            stream (the layers' norms and the final norm).
        loss_parallel: leave the logits split over the vocabulary.
        sequence_parallel: split the residual stream along the sequence between the layers.

    Returns:
        The plan; with ``sequence_parallel``, colwise linears outside a block all-gather
        their input each, and ``first_layer`` must be given.
    """
    sp = sequence_parallel
    head_dims = dict(head_dims or {})
    plan: dict[str, Style] = {}
    if embedding is not None:
        plan[embedding] = VocabParallelEmbedding()
    for block in blocks:
        plan[block] = PrepareInput(sequence_dim=1 if sp else None)
    for key, kind in linears.items():
        if kind in COLWISE_KINDS:
            prepared = key.rpartition(".")[0] in blocks
            gather = kind == "colwise_gather_output"
            plan[key] = ColwiseParallel(
                input="prepared" if prepared else "sequence" if sp else "replicated",
                output="replicated" if gather else "sharded",
                head_dim=None if gather else head_dims.get(key),
            )
        else:
            plan[key] = RowwiseParallel(
                output="sequence" if sp else "replicated",
                input="replicated" if kind == "rowwise_split_input" else "sharded",
            )
    if head is not None:
        plan[head] = head_style(loss_parallel, sp)
    if sp:
        if first_layer is None:
            raise ValueError("megatron_plan: sequence_parallel needs the first decoder layer")
        plan[first_layer] = ScatterInput(dim=1)
        plan.update({norm: SequenceParallel() for norm in sequence_norms})
    return plan


def head_style(loss_parallel: bool, sequence_parallel: bool) -> ColwiseParallel:
    """The output head: colwise over the (padded) vocabulary, logits split or gathered."""
    return ColwiseParallel(
        input="sequence" if sequence_parallel else "replicated",
        output="sharded" if loss_parallel else "replicated",
        padded=True,
    )


def reads_input_only(module: nn.Module, linears: Iterable[str]) -> bool:
    """Whether ``module``'s forward passes its input to the children ``linears`` and to
    nothing else (beyond ``.shape``, ``.size()``, ...), each of them reading only it.

    Then :class:`PrepareInput` on ``module`` may enter the tensor-parallel region once for
    all of them. Read from the source of the class's ``forward``; ``False`` where it cannot be
    told (no source, a forward set on the instance, the input renamed, stored or passed on).

    Example:
        >>> class Attention(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return self.q(x) * self.k(x) + x  # x also reaches the residual
        >>> reads_input_only(Attention(), ["q", "k"])
        False
    """
    if "forward" in vars(module):
        return False
    return _reads_input_only(type(module), frozenset(linears))


@functools.cache
def _reads_input_only(cls: type, linears: frozenset[str]) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        fn = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(fn, ast.FunctionDef):
        return False
    params = [*fn.args.posonlyargs, *fn.args.args]
    if len(params) < 2 or not linears:
        return False
    name = params[1].arg
    body, rest = _until_rebound(fn.body, name, linears)
    if body is None or any(_calls(n, linears) for stmt in rest for n in ast.walk(stmt)):
        return False  # the input is rebound otherwise, or a linear reads the new value
    allowed: set[int] = set()  # ids of the Name nodes that read the input harmlessly
    called: set[str] = set()
    nodes = [n for stmt in body for n in ast.walk(stmt)]
    for node in nodes:
        if isinstance(node, ast.Call) and _calls(node, linears):
            arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
            if not (isinstance(arg, ast.Name) and arg.id == name):
                return False  # a linear reads something other than the input
            allowed.add(id(arg))
            called.add(node.func.attr)  # type: ignore[attr-defined]
        elif _is_name(node, name, _SHAPE_ATTRIBUTES):
            allowed.add(id(node.value))  # type: ignore[attr-defined]
        elif isinstance(node, ast.Call) and _is_name(node.func, name, _SHAPE_METHODS):
            allowed.add(id(node.func.value))  # type: ignore[attr-defined]
    uses = [n for n in nodes if isinstance(n, ast.Name) and n.id == name]
    last = body[-1] if body else None
    if isinstance(last, ast.Assign):  # `name = self.linear(name)`, checked by _until_rebound
        allowed.update(id(t) for t in last.targets)
    return called == linears and all(id(n) in allowed for n in uses)


def _until_rebound(
    body: list[ast.stmt], name: str, linears: Collection[str]
) -> tuple[list[ast.stmt] | None, list[ast.stmt]]:
    """The statements up to the first that assigns ``name``, and the rest.

    The only assignment allowed is a top-level ``name = self.linear(name)`` (Phi's MLP):
    after it ``name`` holds the linear's output, no longer the input. ``(None, [])`` for
    any other assignment.
    """
    for i, stmt in enumerate(body):
        stores = [
            n
            for n in ast.walk(stmt)
            if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load)
        ]
        if not stores:
            continue
        value = stmt.value if isinstance(stmt, ast.Assign) else None
        rebound = (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and stores == [stmt.targets[0]]
            and isinstance(value, ast.Call)
            and _calls(value, linears)
        )
        return (body[: i + 1], body[i + 1 :]) if rebound else (None, [])
    return body, []


def _calls(node: ast.AST, linears: Collection[str]) -> bool:
    return isinstance(node, ast.Call) and _is_self_attribute(node.func, linears)


def _is_self_attribute(node: ast.expr, names: Collection[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in names
    )


def _is_name(node: ast.AST, name: str, attributes: Collection[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == name
        and node.attr in attributes
    )
