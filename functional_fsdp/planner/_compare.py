"""Strategies side by side: DDP, ZeRO-1/2/3, SHARD_GRAD_OP, HSDP and FSDP+TP priced by
:func:`plan`, next to the ZeRO paper's own accounting where it applies.

The ZeRO paper (Rajbhandari et al., 2020, Table 1) prices mixed-precision Adam per device as
(2 + 2 + K)Ψ for DDP, 2Ψ + 2Ψ + KΨ/N for ZeRO-1, 2Ψ + (2 + K)Ψ/N for ZeRO-2 and
(2 + 2 + K)Ψ/N for ZeRO-3, with K = 12 (fp32 masters, momentum and variance) and Ψ
parameters: 120 / 31.4 / 16.6 / 1.9 GB for Ψ = 7.5B on N = 64.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..fsdp.float8_gather import Float8Gather
from ..fsdp.policy import MixedPrecision, Policy, UnitsArg
from ..fsdp.quantized_gather import QuantizedGather
from ..fsdp.quantized_reduce import QuantizedReduce
from ..optim.masters import master_weights as wrap_masters
from ..spec import P
from ..tp.styles import Style
from ._charts import plot_memory
from ._plan import BatchArg, OptimizerArg, PlanReport, _optimizer, plan
from ._render import comparison_table, have_matplotlib, text_chart, to_html, to_text

STRATEGIES = ("ddp", "zero1", "zero2", "shard_grad_op", "zero3", "hsdp", "fsdp+tp")
# Priced only when named: ZeRO-3 with fewer bytes on the wire.
FEWER_BYTES = ("zero++", "zero3+float8")
NAMES = STRATEGIES + FEWER_BYTES  # every name compare_strategies takes

# The ZeRO paper's bytes per parameter per device: (replicated, divided by N), K = 12.
PAPER_K = 12
_PAPER = {
    "ddp": (2 + 2 + PAPER_K, 0),
    "zero1": (2 + 2, PAPER_K),
    "zero2": (2, 2 + PAPER_K),
    "zero3": (0, 2 + 2 + PAPER_K),
}


def paper_bytes(strategy: str, params: int, world_size: int) -> float | None:
    """The ZeRO paper's per-device bytes for ``strategy`` (mixed-precision Adam, K = 12).

    Example:
        >>> [round(paper_bytes(s, 7_500_000_000, 64) / 1e9, 1) for s in ("ddp", "zero1", "zero2", "zero3")]
        [120.0, 31.4, 16.6, 1.9]
    """
    if strategy not in _PAPER:
        return None
    replicated, divided = _PAPER[strategy]
    return params * (replicated + divided / world_size)


@dataclass(frozen=True)
class Comparison:
    """Several :class:`PlanReport` side by side (strategies, or one strategy on several meshes).

    Attributes:
        reports: the reports, in order.
        paper: ``{strategy: bytes}``, the ZeRO paper's figure per device for the strategies
            it prices (for mixed-precision Adam with fp32 masters; empty otherwise).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        >>> cmp = ff.compare_strategies(model, 8, strategies=("ddp", "zero3"))
        >>> [r.name for r in cmp.reports], cmp.fits(0.001)  # 1 MiB per device
        (['ddp', 'zero3'], ['zero3'])
    """

    reports: tuple[PlanReport, ...]
    paper: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, name: str) -> PlanReport:
        for r in self.reports:
            if r.name == name:
                return r
        raise KeyError(f"no report named {name!r}; the names are {[r.name for r in self.reports]}")

    def fits(self, gib: float) -> list[str]:
        """Names of the reports whose peak estimate fits in ``gib`` GiB per device."""
        return [r.name for r in self.reports if r.fits(gib)]

    def table(self, gib: float | None = None) -> Any:
        """A ``rich`` table: memory parts, peak and traffic per report."""
        return comparison_table(self.reports, gib, self.paper)

    def plot(self, gib: float | None = None, ax: Any = None) -> Any:
        """Stacked bars of memory per device, with a line at ``gib``: :func:`ff.plot_memory
        <functional_fsdp.plot_memory>` of these reports (a matplotlib ``Axes``).

        Without matplotlib, returns the same chart as text (see :meth:`text_chart`).
        """
        if not have_matplotlib():
            return text_chart(self.reports, gib)
        return plot_memory(self, gib=gib, ax=ax)

    def text_chart(self, gib: float | None = None) -> str:
        """The chart as text: one bar per report."""
        return text_chart(self.reports, gib)

    def to_dict(self) -> list[dict[str, Any]]:
        """Each report's :meth:`PlanReport.to_dict`."""
        return [r.to_dict() for r in self.reports]

    def summary(self, gib: float | None = None) -> str:
        """The table as plain text, as wide as the terminal (``COLUMNS``, or 80 through a pipe)."""
        return to_text(self.table(gib))

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return to_html(self.table())


def compare_strategies(
    model: nn.Module,
    world_size: int,
    *,
    batch: BatchArg = None,
    strategies: Sequence[str] = STRATEGIES,
    tp_plan: Mapping[str, Style] | None = None,
    tp: int = 8,
    hsdp_shard: int = 8,
    cp: int = 1,
    units: UnitsArg = None,
    mixed_precision: MixedPrecision | None = None,
    checkpoint: bool | Callable[[str], bool] = False,
    prefetch: int = 1,
    optimizer: OptimizerArg | Mapping[str, OptimizerArg] = "adamw",
    master_weights: bool | None = None,
    loss_fn: Any = "lm",
) -> Comparison:
    """Price the standard strategies for ``model`` on ``world_size`` devices with :func:`plan`.

    * ``"ddp"``: ``{"dp": N}``, ``specs=P()``.
    * ``"zero1"`` (the ZeRO paper's): as DDP, optimizer state ``P("dp")`` (``opt_specs``),
      full gradients reduce-scattered once per step (``accumulate_mode="local"``).
    * ``"zero2"`` (the ZeRO paper's): as ZeRO-1, each unit's gradients reduce-scattered in
      the backward and freed (``accumulate_mode="reduce_each"``).
    * ``"shard_grad_op"`` (FSDP's, often called ZeRO-2): ``{"dp": N}``,
      ``Policy(reshard_after_forward=False)``: parameters sharded at rest, gathered once in
      forward and kept until backward.
    * ``"zero3"``: ``{"dp": N}``, the default (full sharding).
    * ``"hsdp"``: ``{"replicate": N / hsdp_shard, "shard": hsdp_shard}``.
    * ``"fsdp+tp"``: ``{"dp": N / tp, "tp": tp}`` with ``tp_plan`` (skipped without one).

    Named only, beside the exact ones (:data:`FEWER_BYTES`):

    * ``"zero++"``: ZeRO++'s three on ``{"node": N / hsdp_shard, "gpu": hsdp_shard}``: int8
      weight all-gathers (:class:`~functional_fsdp.QuantizedGather`), a secondary shard within
      the node (``reshard_after_forward="gpu"``) and int8 gradients reduced within the node,
      then across (:class:`~functional_fsdp.QuantizedReduce`).
    * ``"zero3+float8"``: ZeRO-3 with float8 all-gathers (:class:`~functional_fsdp.Float8Gather`,
      FSDP2 + torchao's).

    With ``cp > 1`` every mesh gets a ``"cp"`` axis of that size after its data axes (e.g.
    ``{"dp": N / cp, "cp": cp}``; ZeRO's optimizer state ``P(("dp", "cp"))``), which splits
    each sequence (context parallelism, :mod:`functional_fsdp.cp`): the model's attention
    must be :func:`functional_fsdp.cp.attention` (a transformers model built with
    ``attn_implementation=ff.cp.register_attention()``).

    Args:
        model: the module (on ``meta`` for big ones).
        world_size: devices.
        batch: the global batch (see :func:`plan`); ``None``: no activation figures.
        strategies: which of the names above, in order (the default: the exact ones,
            :data:`STRATEGIES`).
        tp_plan: the tensor-parallel plan for ``"fsdp+tp"``.
        tp: tensor-parallel size for ``"fsdp+tp"``.
        hsdp_shard: size of the sharding axis for ``"hsdp"`` (e.g. GPUs per node).
        cp: size of the context-parallel axis (``1``: none).
        units: the units, shared by all strategies.
        mixed_precision: the policy's mixed precision, shared by all strategies.
        checkpoint: the policy's activation checkpointing, shared by all strategies.
        prefetch: the policy's prefetch depth, shared by all strategies.
        optimizer: as for :func:`plan`; or ``{label: optimizer}`` to price every strategy
            with each (e.g. ``{"adamw": "adamw", "muon": ff.contrib.muon(0.02)}``): the
            reports are then named ``"{strategy}/{label}"``, each strategy's optimizers
            next to each other.
        master_weights: keep parameters in ``mixed_precision.param_dtype`` and fp32 masters
            in the optimizer state (:func:`~functional_fsdp.master_weights`). ``None``: when
            ``mixed_precision`` has a ``param_dtype``. With Adam this is the paper's setup, and
            :attr:`Comparison.paper` holds its figures.
        loss_fn: as for :func:`plan`.

    Raises:
        ValueError: an unknown strategy, a size that does not divide ``world_size``
            (``hsdp_shard`` and ``tp`` must divide ``world_size / cp``), or an empty mapping
            of optimizers.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
        >>> cmp = ff.compare_strategies(model, 4, strategies=("ddp", "zero2", "shard_grad_op"))
        >>> [r.param_bytes for r in cmp.reports]
        [66560, 66560, 16640]
        >>> sgd_too = ff.compare_strategies(
        ...     model, 4, strategies=("zero3",), optimizer={"adamw": "adamw", "sgd": "sgd"}
        ... )
        >>> [(r.name, r.opt_state_bytes) for r in sgd_too.reports]
        [('zero3/adamw', 33280), ('zero3/sgd', 0)]
    """
    unknown = [s for s in strategies if s not in NAMES]
    if unknown:
        raise ValueError(
            f"compare_strategies: unknown strategy {unknown[0]!r}; choose from {NAMES}."
        )
    base = dict(
        mixed_precision=mixed_precision or MixedPrecision(),
        activation_checkpointing=checkpoint,
        prefetch=prefetch,
    )
    param_dtype = base["mixed_precision"].param_dtype
    if master_weights is None:
        master_weights = param_dtype is not None
    labelled = isinstance(optimizer, Mapping)
    given = dict(optimizer) if isinstance(optimizer, Mapping) else {"": optimizer}
    if not given:
        raise ValueError(
            "compare_strategies(optimizer={}): give at least one optimizer, e.g. "
            "{'adamw': 'adamw', 'muon': ff.contrib.muon(0.02)}."
        )
    opts: dict[str, Any] = {}
    for label, arg in given.items():
        opt = _optimizer(arg)
        if master_weights and opt is not None:
            opt = wrap_masters(opt, param_dtype=param_dtype or torch.float32)
        opts[label] = opt
    common: dict[str, Any] = dict(batch=batch, units=units, loss_fn=loss_fn)
    memo: dict[Any, Any] = {}  # unit plans, optimizer state and traces the strategies share
    _check_divides("cp", cp, world_size)
    n = world_size // cp  # ranks per position of the sequence
    per_cp = "world_size" if cp == 1 else f"world_size/cp={world_size}/{cp}"
    seq = {"cp": cp} if cp > 1 else {}
    data = {"dp": n, **seq}
    zero_specs = P(("dp", "cp")) if cp > 1 else P("dp")
    reports = []
    paper: dict[str, float] = {}
    for s in strategies:
        if s == "ddp":
            kw: dict[str, Any] = dict(mesh=data, specs=P())
        elif s == "zero1":
            kw = dict(mesh=data, specs=P(), opt_specs=zero_specs, accumulate_mode="local")
        elif s == "zero2":
            kw = dict(mesh=data, specs=P(), opt_specs=zero_specs)
        elif s == "shard_grad_op":
            kw = dict(mesh=data, policy=Policy(reshard_after_forward=False, **base))
        elif s == "zero3":
            kw = dict(mesh=data)
        elif s == "hsdp":
            _check_divides("hsdp_shard", hsdp_shard, n, per_cp)
            kw = dict(mesh={"replicate": n // hsdp_shard, "shard": hsdp_shard, **seq})
        elif s == "zero++":
            _check_divides("hsdp_shard", hsdp_shard, n, per_cp)
            fewer = dict(
                reshard_after_forward="gpu",
                gather_quantization=QuantizedGather(),
                grad_quantization=QuantizedReduce(),
            )
            kw = dict(
                mesh={"node": n // hsdp_shard, "gpu": hsdp_shard, **seq},
                policy=Policy(**fewer, **base),
            )
        elif s == "zero3+float8":
            kw = dict(mesh=data, policy=Policy(gather_quantization=Float8Gather(), **base))
        else:
            if tp_plan is None:
                continue
            _check_divides("tp", tp, n, per_cp)
            kw = dict(mesh={"dp": n // tp, **seq, "tp": tp}, tp_plan=tp_plan)
        kw.setdefault("policy", Policy(**base))
        mesh = kw.pop("mesh")
        for label, opt in opts.items():
            name = f"{s}/{label}" if labelled else s
            reports.append(plan(model, mesh, name=name, optimizer=opt, _memo=memo, **common, **kw))
            adam = isinstance(given[label], str) and given[label] in ("adam", "adamw")
            if master_weights and adam and param_dtype is not None and param_dtype.itemsize == 2:
                figure = paper_bytes(s, reports[-1].params, world_size)
                if figure is not None:
                    paper[name] = figure
    return Comparison(tuple(reports), paper)


def _check_divides(name: str, size: int, total: int, what: str = "world_size") -> None:
    if size < 1 or total % size:
        raise ValueError(
            f"compare_strategies: {name}={size} does not divide {what}={total}; pick a "
            f"{name} that divides it."
        )
