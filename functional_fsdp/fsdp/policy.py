"""What the FSDP engine is told: the mixed-precision and gathering policy, and the units.

A :class:`Policy` is plain immutable data; :func:`find_units` turns a ``units=`` argument into
module paths. Both feed :func:`functional_fsdp.fsdp.layout.model_layout`.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..spec import P
from .float8_gather import Float8Gather
from .quantized_gather import QuantizedGather
from .quantized_reduce import QuantizedReduce


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Mixed-precision policy (the same knobs as FSDP2's ``MixedPrecisionPolicy``).

    Attributes:
        param_dtype: dtype of gathered parameters and of compute (``None``: keep the shard's).
            Shards are cast before the all-gather, so a bf16 gather moves half the bytes.
        reduce_dtype: dtype of gradient reduction (``None``: ``param_dtype``).
        output_dtype: dtype the module's floating outputs are cast to (``None``: unchanged).
        cast_forward_inputs: cast each unit's floating inputs to ``param_dtype``.

    Master shards always keep their own dtype (e.g. fp32); gradients arrive in it.

    Example:
        >>> import torch
        >>> bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> Policy(mixed_precision=bf16).mixed_precision.param_dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                continue
            named = _DTYPE_NAMES.get(dtype.lower()) if isinstance(dtype, str) else None
            raise TypeError(
                f"MixedPrecision({field}={dtype!r}): takes a floating-point torch.dtype, or None "
                f"to keep the shard's dtype; e.g. MixedPrecision({field}=torch.{named or 'bfloat16'})."
            )


# What people write for a dtype, and the torch.dtype they mean (for MixedPrecision's error).
_DTYPE_NAMES = {
    **{name: name for name in ("bfloat16", "float16", "float32", "float64", "half", "float")},
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "fp64": "float64",
}


@dataclass(frozen=True, init=False)
class Policy:
    """How units are gathered, freed and reduced.

    Attributes:
        reshard_after_forward: free gathered parameters after each unit's forward and gather
            them again in backward (ZeRO-3, the default); ``False`` keeps them until backward
            (FSDP's SHARD_GRAD_OP, often called ZeRO-2; the ZeRO paper's ZeRO-2 keeps
            parameters replicated, see ``TrainState.create(opt_specs=...)``), one all-gather
            per unit instead of two. A data axis name (``"gpu"`` on a ``{"node": n, "gpu":
            g}`` mesh) keeps a secondary shard after the forward, each parameter sharded
            over that axis only, so the backward gathers within it (ZeRO++'s hpZ, FSDP2's
            ``reshard_after_forward=g``); a dim split over that axis must have it major
            (the default specs do).
        prefetch: how many next units' all-gathers are issued ahead, in forward and backward.
        mixed_precision: see :class:`MixedPrecision`.
        activation_checkpointing: recompute each unit's activations in backward instead of
            keeping them (``torch.utils.checkpoint``; JAX's ``remat``): ``True`` for every
            unit, or a predicate on the unit name. (Saving training state to disk is
            :mod:`ff.checkpoint <functional_fsdp.checkpoint>`.) Formerly ``checkpoint=``,
            which still works with a ``DeprecationWarning``.
        grad_reduce: ``"mean"`` averages gradients over the data-parallel ranks (DDP/FSDP
            semantics: a per-rank mean loss gives the global-batch mean gradient); ``"sum"``
            adds them; ``"none"`` reduces nothing over the data axes, each rank keeping its
            own local gradient (for local gradient accumulation, like FSDP2's
            ``set_requires_gradient_sync(False)``: parameters must then be replicated over
            the data axes, e.g. gathered once for the step).
        offload: CPU offload (FSDP1's ``CPUOffload(offload_params=True)``, ZeRO-Offload):
            :meth:`FSDP.shard` places the shards in host memory (pinned when CUDA is present),
            so gradients and optimizer state live there too and the optimizer runs there;
            each unit's shards are copied to the mesh's device just before its all-gather
            and reduced gradients are copied back. Offload is a placement: shards that live
            off the mesh's device are copied this way under any policy.
        gather_quantization: send each unit's all-gather as blockwise int8
            (:class:`~functional_fsdp.QuantizedGather`, ZeRO++'s qwZ): about a quarter of
            fp32's bytes; or as float8 with a per-tensor scale from the global amax
            (:class:`~functional_fsdp.Float8Gather`, FSDP2 + torchao's): a quarter of
            fp32's bytes. The shards at rest stay exact. ``None``: exact gathers.
        grad_quantization: reduce gradients as blockwise int8 through an all-to-all
            (:class:`~functional_fsdp.QuantizedReduce`, ZeRO++'s qgZ, one hop) instead of
            the reduce-scatter. ``None``: exact reductions.

    Example:
        >>> Policy(reshard_after_forward=False, prefetch=2)  # SHARD_GRAD_OP, two units ahead
        Policy(reshard_after_forward=False, prefetch=2, mixed_precision=MixedPrecision(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True), activation_checkpointing=False, grad_reduce='mean', offload=False, gather_quantization=None, grad_quantization=None)
    """

    reshard_after_forward: bool | str
    prefetch: int
    mixed_precision: MixedPrecision
    activation_checkpointing: bool | Callable[[str], bool]
    grad_reduce: Literal["mean", "sum", "none"]
    offload: bool
    gather_quantization: QuantizedGather | Float8Gather | None
    grad_quantization: QuantizedReduce | None

    def __init__(
        self,
        *,
        reshard_after_forward: bool | str = True,
        prefetch: int = 1,
        mixed_precision: MixedPrecision = MixedPrecision(),
        activation_checkpointing: bool | Callable[[str], bool] = False,
        grad_reduce: Literal["mean", "sum", "none"] = "mean",
        offload: bool = False,
        gather_quantization: QuantizedGather | Float8Gather | None = None,
        grad_quantization: QuantizedReduce | None = None,
        checkpoint: bool | Callable[[str], bool] | None = None,
    ) -> None:
        if checkpoint is not None:  # the old name of activation_checkpointing
            warnings.warn(
                "Policy(checkpoint=...) is now Policy(activation_checkpointing=...) (the "
                "ff.checkpoint module saves training state; this recomputes activations).",
                DeprecationWarning,
                stacklevel=2,
            )
            if activation_checkpointing is not False:
                raise TypeError(
                    "Policy got both checkpoint= and activation_checkpointing=; pass only "
                    "activation_checkpointing= (checkpoint= is its deprecated name)."
                )
            activation_checkpointing = checkpoint
        for name, value in (
            ("reshard_after_forward", reshard_after_forward),
            ("prefetch", prefetch),
            ("mixed_precision", mixed_precision),
            ("activation_checkpointing", activation_checkpointing),
            ("grad_reduce", grad_reduce),
            ("offload", offload),
            ("gather_quantization", gather_quantization),
            ("grad_quantization", grad_quantization),
        ):
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def secondary_axis(self) -> str | None:
        """The axis named by ``reshard_after_forward`` (hpZ), else ``None``."""
        k = self.reshard_after_forward
        return k if isinstance(k, str) else None

    @property
    def checkpoint(self) -> bool | Callable[[str], bool]:
        """The old name of :attr:`activation_checkpointing` (read-only)."""
        return self.activation_checkpointing

    def __post_init__(self) -> None:
        if self.grad_reduce not in ("mean", "sum", "none"):
            raise ValueError(
                f"Policy(grad_reduce={self.grad_reduce!r}): use 'mean' (FSDP/DDP), 'sum' or "
                f"'none' (no reduction over the data axes)."
            )
        k = self.reshard_after_forward
        if not isinstance(k, (bool, str)) or k == "":
            raise TypeError(
                f"Policy(reshard_after_forward={k!r}): True (ZeRO-3), False (SHARD_GRAD_OP), "
                f"or the name of a data axis within a node, e.g. 'gpu' (hpZ: the backward "
                f"gathers over that axis only)."
            )
        g = self.grad_quantization
        if g is not None and not isinstance(g, QuantizedReduce):
            raise TypeError(
                f"Policy(grad_quantization={g!r}): pass ff.QuantizedReduce(block_size=...) "
                f"(int8 blocks reduced through an all-to-all), or None for exact reductions."
            )
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Policy(prefetch={self.prefetch!r}): use an int >= 0.")
        q = self.gather_quantization
        if q is not None and not isinstance(q, (QuantizedGather, Float8Gather)):
            raise TypeError(
                f"Policy(gather_quantization={q!r}): pass ff.QuantizedGather(block_size=...) "
                f"(blockwise int8 all-gathers), ff.Float8Gather() (float8 all-gathers with "
                f"torchao's per-tensor scales), or None for exact gathers."
            )


Forward = Callable[..., Any]
ModuleWrapper = Callable[[nn.Module, Forward], Forward]
"""``wrapper(module, forward) -> forward``: called per ``apply`` with the call's own copy of the
module (so attributes it sets last one call) and the forward to wrap."""
UnitsArg = type | str | Collection[type | str] | Callable[[str, nn.Module], bool] | None

_UNITS_HELP = (
    "units takes a module type (units=nn.TransformerEncoderLayer), a list, tuple or set of "
    "types and/or module paths and fnmatch patterns (units={Block} or units=['blocks.*']), "
    "or a predicate fn(path, module) -> bool"
)


def find_units(module: nn.Module, units: UnitsArg = None) -> list[str]:
    """Module paths of the units (outermost matches; the root is implicit).

    ``units`` may be a module type; a list, tuple or set of module types and/or module
    paths and fnmatch patterns (``"blocks.*"``), as FSDP1's ``transformer_layer_cls`` takes
    a set of classes; or a predicate ``fn(path, module) -> bool``. The default
    (:func:`default_units`) finds the repeated blocks wherever they are kept: one unit per
    transformer block.

    Raises:
        TypeError: if ``units`` or one of its items is none of those.
        ValueError: if a path or pattern matches no submodule.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> find_units(model, nn.Linear)
        ['0', '2']
        >>> find_units(model, {nn.Linear, nn.ReLU})
        ['0', '1', '2']
    """
    named = [(p, m) for p, m in module.named_modules() if p]
    if units is None:
        return default_units(module)
    if isinstance(units, type):
        _check_types_match(module, named, (units,), units)

        def match(path: str, m: nn.Module) -> bool:
            return isinstance(m, units)  # type: ignore[arg-type]

    elif isinstance(units, nn.Module):  # callable, but it would run its forward
        raise TypeError(
            f"units={type(units).__name__}(...) is a module instance; units takes its type: "
            f"units={type(units).__name__} (or {_UNITS_HELP})."
        )
    elif callable(units):
        match = units  # type: ignore[assignment]
    else:
        if isinstance(units, str):
            units = [units]
        if not isinstance(units, Collection):
            raise TypeError(f"units={units!r} ({type(units).__name__}): {_UNITS_HELP}.")
        items = list(units)
        bad = [u for u in items if not isinstance(u, (type, str))]
        if bad:
            raise TypeError(
                f"units={units!r}: {bad[0]!r} ({type(bad[0]).__name__}) is neither a module "
                f"type nor a module path; {_UNITS_HELP}."
            )
        types = tuple(u for u in items if isinstance(u, type))
        patterns = [u for u in items if isinstance(u, str)]
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(p, pat) for p, _ in named):
                raise ValueError(
                    f"unit pattern {pat!r} matches no submodule of {type(module).__name__}"
                    f"{_close_paths(pat, [p for p, _ in named])}; module paths look like "
                    f"{[p for p, _ in named[:6]]}. Pass module paths or fnmatch patterns of "
                    f"them (e.g. 'layers.*'), or a module type."
                )
        _check_types_match(module, named, types, units)

        def match(path: str, m: nn.Module) -> bool:
            return isinstance(m, types) or any(fnmatch.fnmatchcase(path, pat) for pat in patterns)

    chosen: list[str] = []
    for path, m in named:
        if match(path, m) and not any(path.startswith(c + ".") for c in chosen):
            chosen.append(path)
    return chosen


def _has_parameters(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _repeated(children: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """Names of the children with submodules and parameters whose class another one has."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # their children are the blocks
    blocks = [
        (n, c)
        for n, c in children
        if not isinstance(c, containers) and any(True for _ in c.children()) and _has_parameters(c)
    ]
    count: dict[type, int] = {}
    for _, c in blocks:
        count[type(c)] = count.get(type(c), 0) + 1
    return [n for n, c in blocks if count[type(c)] > 1]


def default_units(module: nn.Module) -> list[str]:
    """The default units: the repeated blocks, wherever the model keeps them (outermost).

    * every child with parameters of an ``nn.ModuleList`` or ``nn.Sequential``;
    * the repeated blocks of an ``nn.ModuleDict`` (children of one class, with submodules of
      their own: torchtitan keeps its layers so);
    * repeated blocks held as plain attributes (``self.block1``, ``self.block2``), where they
      hold no blocks found by the rules above.

    Example:
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc, self.out = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> model = nn.Module()
        >>> model.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        >>> model.head = nn.Linear(2, 1)
        >>> default_units(model)
        ['layers.0', 'layers.1']
    """
    found: list[str] = []
    plain: list[str] = []
    for path, m in module.named_modules():
        prefix = f"{path}." if path else ""
        children = list(m.named_children())
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            found += [prefix + n for n, c in children if _has_parameters(c)]
        elif isinstance(m, nn.ModuleDict):
            found += [prefix + n for n in _repeated(children)]
        else:
            plain += [prefix + n for n in _repeated(children)]
    inside = set(found)
    for p in plain:  # repeated attributes, unless they hold (or sit in) container blocks
        if not any(f.startswith(p + ".") or p.startswith(f + ".") for f in inside):
            found.append(p)
    order = {p: i for i, (p, _) in enumerate(module.named_modules())}
    chosen: list[str] = []
    for path in sorted(set(found), key=order.__getitem__):
        if not any(path.startswith(c + ".") for c in chosen):
            chosen.append(path)
    return chosen


def _check_types_match(
    module: nn.Module, named: list[tuple[str, nn.Module]], types: tuple[type, ...], units: Any
) -> None:
    """Raise, as for a pattern, if a unit type is the type of no submodule of ``module``.

    Without it a model would silently get fewer units than asked for; with no unit at all,
    one root unit: the whole model gathered at once.
    """
    for t in types:
        if any(isinstance(m, t) for _, m in named):
            continue
        present = list(dict.fromkeys(type(m).__name__ for _, m in named))
        shown = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "")
        alone = units is t or (isinstance(units, Collection) and len(units) == 1)
        effect = (
            "so the whole model would be one unit, gathered at once"
            if alone
            else "so it would choose nothing; leave it out"
        )
        raise ValueError(
            f"units={_units_repr(units)}: unit type {t.__name__} matches no submodule of "
            f"{type(module).__name__}, {effect}. Its submodules are of types [{shown}]. Pass "
            f"a type the model has (e.g. units={present[0] if present else 'Block'}), module "
            f"paths or fnmatch patterns (units=['layers.*']), units=None for one unit per "
            f"child of every nn.ModuleList/nn.Sequential, or units=[] for one unit on purpose."
        )


def _units_repr(units: Any) -> str:
    """``Linear`` or ``{Linear, 'blocks.*'}``: classes by name, as they are written in code."""

    def one(u: Any) -> str:
        return u.__name__ if isinstance(u, type) else repr(u)

    if isinstance(units, type):
        return one(units)
    inner = ", ".join(one(u) for u in units)
    if isinstance(units, (set, frozenset)):
        return "{" + inner + "}"
    return (
        f"({inner},)"
        if isinstance(units, tuple) and len(units) == 1
        else (f"({inner})" if isinstance(units, tuple) else f"[{inner}]")
    )


def _close_paths(pattern: str, paths: list[str]) -> str:
    """`` (close: ['blocks.*'])``: module paths, with indices as ``*``, close to ``pattern``."""
    import difflib
    import re

    generic = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", p) for p in paths))
    close = difflib.get_close_matches(pattern, generic, n=3, cutoff=0.5)
    return f" (close: {close})" if close else ""


def default_specs(
    mesh: DeviceMesh, data_axes: Sequence[str], major: str | None = None
) -> Callable[[str, torch.Tensor], P]:
    """Shard dim 0 over the data axes that shard (all but ``"replicate"``), ``major`` first
    (hpZ's axis, gathered last); scalars replicate."""
    shard_axes = tuple(a for a in data_axes if a != "replicate")
    if major in shard_axes:
        shard_axes = (major, *(a for a in shard_axes if a != major))

    def rule(path: str, t: torch.Tensor) -> P:
        return P(shard_axes) if t.ndim >= 1 and shard_axes else P()

    return rule


def trainable_names(module: nn.Module, trainable: Any, where: str = "fsdp") -> frozenset[str]:
    """The names of ``module``'s trainable parameters: those with ``requires_grad`` when
    ``trainable`` is ``None``, else the given names or those a predicate on the name accepts.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> sorted(trainable_names(model, lambda name: name.endswith("bias")))
        ['bias']
    """
    names = [n for n, _ in module.named_parameters()]
    if trainable is None:
        return frozenset(n for n, p in module.named_parameters() if p.requires_grad)
    if callable(trainable):
        return frozenset(n for n in names if trainable(n))
    unknown = sorted(set(trainable) - set(names))
    if unknown:
        raise ValueError(
            f"{where}(trainable=...) names {unknown[:5]}, which are not parameters of "
            f"{type(module).__name__} (names look like {names[:4]})."
        )
    return frozenset(trainable)
