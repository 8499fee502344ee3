"""``ff.plan``: what one training step costs per device, from shapes alone.

The planner prices a configuration with the same pure data the engine runs on: the specs are
resolved as :func:`functional_fsdp.fsdp` resolves them, laid out with
:meth:`Layout.make <functional_fsdp.Layout.make>` on the mesh's axis sizes, and grouped into
units and all-gather rounds by :func:`functional_fsdp.fsdp.layout.model_layout`. No process group,
no mesh and no real memory: the model may live on ``meta``.

Figures (per rank; every rank holds a block of the same padded shape):

* **at rest**: parameter, gradient and optimizer-state bytes, padding included. Optimizer
  state is measured by running the optimizer's ``init`` on ``meta`` shards.
* **gathered parameters**: the largest unit, and the peak of gathered-parameter bytes with
  prefetch, as :func:`functional_fsdp.track_memory` counts them (the root unit stays
  gathered; with ``reshard_after_forward`` the peak is the root plus the largest window of
  ``1 + prefetch`` consecutive units, without it every unit).
* **activations**: storages saved for backward by one forward on ``meta`` on this rank's
  share of the batch (see :mod:`._activations`), per unit, with the policy's checkpointing,
  without any and with every unit checkpointed. Where an axis splits the sequence (context
  parallelism), the share is a rank's chunks of each sequence and the forward runs inside
  that split, so the keys and values each attention layer gathers (and keeps for backward)
  are counted.
* **the optimizer's exchange of whole matrices** (Muon's owners): recorded from the same
  step (which matrices, their layouts and dtypes) and priced for every rank by
  :func:`functional_fsdp.optim.muon.exchange_memory`; the peak adds the largest.
* **communication**: every collective one ``train_step`` issues, by kind and mesh axis, in
  the bytes :class:`functional_fsdp.CommRecord` counts (ring bytes sent per rank). These are
  not worked out by the planner: it runs the real step (``ff.fsdp``, ``ff.train_step`` with the
  optimizer) on a shapes-only simulated mesh of the same axis sizes and takes what
  :func:`functional_fsdp.count_comms` records (see :mod:`._run`), so the plan cannot drift
  from the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import optree
import torch
from torch import nn

from .._tree import NAMESPACE
from ..cp.attention import COMM_LABEL
from ..distributed.axes import data_axes_of, sequence_axis_of
from ..formats import replicated_bytes, storage_view
from ..fsdp.float8_gather import Float8Gather
from ..fsdp.layout import ModelLayout, UnitLayout, gather_dtype, model_layout
from ..fsdp.policy import Policy, UnitsArg, default_specs, find_units, trainable_names
from ..optim._muon_exchange import COMM_LABEL as MUON_LABEL
from ..optim._muon_exchange import exchange_memory, recording_exchanges
from ..optim.masters import MasterWeightsState, _widens
from ..optim.transforms import GradientTransformation, adamw, sgd
from ..resharding import Specs, resolve_specs
from ..spec import Layout, P, format_mesh
from ..tp.styles import Style
from . import _activations, _run

GiB = 1024**3
OptimizerArg = GradientTransformation | Literal["adamw", "adam", "sgd", "momentum"] | None
BatchArg = tuple[int, ...] | torch.Tensor | tuple[Any, ...] | Mapping[str, Any] | None


@dataclass(frozen=True)
class CommFigure:
    """Collectives of one kind over one mesh axis in a training step, per rank.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        axis: the mesh axis.
        count: how many.
        bytes: ring bytes one rank sends (as :class:`functional_fsdp.CommRecord` counts).
        source: ``"fsdp"`` (parameter gathers and gradient reductions), ``"tp"``
            (tensor-parallel activations), ``"cp"`` (context-parallel attention: the keys,
            values, positions and padding it gathers over the sequence axis, and the
            reduce-scatters of their gradients) or ``"step"`` (loss, global norm, ZeRO-1
            gather).

    Example:
        >>> CommFigure("all_gather", "dp", 3, 4096, "fsdp")
        CommFigure(kind='all_gather', axis='dp', count=3, bytes=4096, source='fsdp')
    """

    kind: str
    axis: str
    count: int
    bytes: int
    source: str


@dataclass(frozen=True)
class UnitFigure:
    """One unit's figures, per rank.

    Attributes:
        name: module path (``""``: the root unit, ``"<loss>"``: the loss).
        params: parameter elements (global, unpadded).
        gathered_bytes: its gathered (padded) parameters in the gather dtype.
        activation_bytes: saved for backward by its forward (``None`` without a batch).
        checkpoint_bytes: what it keeps when checkpointed: its inputs.
        checkpointed: whether the policy checkpoints it.

    Example:
        >>> UnitFigure("blocks.0", 1024, 4096, 8192, 512, False).activation_bytes
        8192
    """

    name: str
    params: int
    gathered_bytes: int
    activation_bytes: int | None
    checkpoint_bytes: int | None
    checkpointed: bool


@dataclass(frozen=True)
class PlanReport:
    """What one training step costs per device, priced from shapes (see :func:`plan`).

    All byte figures are per rank. Render with :meth:`table` (rich), in Jupyter (HTML), or
    take :meth:`to_dict`.

    Attributes:
        name: a label (the strategy's name for :func:`compare_strategies`).
        mesh: ``{axis: size}``.
        data_axes: the axes that split the batch.
        sequence_axis: the data axis that splits each sequence instead of the batch
            (context parallelism), or ``None``.
        params: parameter elements of the model (tied ones once).
        trainable: trainable parameter elements.
        param_bytes: parameter shards at rest, padding included, and what a quantized base's
            layers hold whole on every rank (code tables; a 4-bit base is priced as
            :func:`~functional_fsdp.fsdp` stores it: packed blocks with their scales).
        padding_bytes: the padding part of ``param_bytes`` (beyond an exact share of each
            tensor over the axes that split it, rounded to a byte).
        grad_bytes: gradients of the trainable parameters, in their at-rest layout (ZeRO-2:
            the optimizer shards; ZeRO-1: full, as they are summed before the reduction).
        opt_state_bytes: optimizer state (in the ``opt_specs`` layout for ZeRO-1/2), fp32
            masters of :func:`~functional_fsdp.master_weights` included.
        largest_unit: the unit with the most gathered bytes (``""``: the root unit).
        largest_unit_bytes: its gathered bytes.
        root_bytes: the root unit's gathered bytes (it stays gathered for the step).
        gathered_peak_bytes: peak of gathered-parameter bytes with prefetch (under hpZ,
            ``Policy(reshard_after_forward=axis)``, every unit's secondary shard too).
        activation_bytes: activations kept for backward under the policy's checkpointing
            (``None`` when no batch was given).
        activation_bytes_no_checkpoint: the same without checkpointing.
        activation_bytes_checkpoint: the same with every unit checkpointed.
        recompute_bytes: the largest activations of one checkpointed unit, alive while it is
            recomputed in backward (0 when nothing is checkpointed).
        comms: the step's collectives (see :class:`CommFigure`).
        units: per-unit figures, the root unit first.
        seconds: how long planning took.
        owner_bytes: per rank (in the mesh's row-major order), the most bytes the
            optimizer's exchange of whole matrices holds at once (Muon: the matrices a rank
            owns, whole, and the buffers of its two all-to-alls; see
            :func:`functional_fsdp.optim.muon.exchange_memory`); empty for optimizers
            without one. Owners differ by rank, so this one figure differs by rank: the
            peak counts the largest (:attr:`owner_peak_bytes`, on :attr:`owner_peak_rank`).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> report = ff.plan(torch.nn.Linear(1000, 1001), {"dp": 8}, optimizer="adamw")
        >>> report.param_bytes  # 126 of the 1001 rows (padded), and 126 of the bias
        504504
        >>> report.padding_bytes, report.opt_state_bytes  # AdamW: mu and nu
        (3504, 1009008)
        >>> report.by_kind_and_axis()[("reduce_scatter", "dp")]  # one unit: one reduce-scatter
        (1, 3531528)
    """

    name: str
    mesh: dict[str, int]
    data_axes: tuple[str, ...]
    sequence_axis: str | None
    params: int
    trainable: int
    param_bytes: int
    padding_bytes: int
    grad_bytes: int
    opt_state_bytes: int
    largest_unit: str
    largest_unit_bytes: int
    root_bytes: int
    gathered_peak_bytes: int
    activation_bytes: int | None
    activation_bytes_no_checkpoint: int | None
    activation_bytes_checkpoint: int | None
    recompute_bytes: int
    comms: tuple[CommFigure, ...]
    units: tuple[UnitFigure, ...] = field(repr=False)
    seconds: float = field(default=0.0, compare=False)
    owner_bytes: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        """Ranks in the mesh."""
        return math.prod(self.mesh.values())

    @property
    def owner_peak_bytes(self) -> int:
        """The largest of :attr:`owner_bytes` (0 without an exchange)."""
        return max(self.owner_bytes, default=0)

    @property
    def owner_peak_rank(self) -> int:
        """The rank that holds :attr:`owner_peak_bytes` (the lowest of equals; 0 without an
        exchange)."""
        peak = self.owner_peak_bytes
        return next((r for r, b in enumerate(self.owner_bytes) if b == peak), 0)

    @property
    def at_rest_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.param_bytes + self.grad_bytes + self.opt_state_bytes

    @property
    def peak_bytes(self) -> int:
        """An upper estimate of the step's peak: at rest + gathered peak + activations (+ the
        recompute of one checkpointed unit) + the optimizer's exchange of whole matrices on
        the rank where it is largest (:attr:`owner_peak_bytes`). It adds figures whose peaks
        need not coincide, and leaves out transient buffers (the reduce-scatter inputs of one
        unit, the optimizer's element-wise temporaries, the allocator's fragmentation)."""
        return (
            self.at_rest_bytes
            + self.gathered_peak_bytes
            + (self.activation_bytes or 0)
            + self.recompute_bytes
            + self.owner_peak_bytes
        )

    def fits(self, gib: float) -> bool:
        """Whether :attr:`peak_bytes` fits in ``gib`` GiB per device.

        Example:
            >>> import torch, functional_fsdp as ff
            >>> report = ff.plan(torch.nn.Linear(1024, 1024), {"dp": 8})
            >>> report.fits(1.0), report.fits(0.001)
            (True, False)
        """
        return self.peak_bytes <= gib * GiB

    def comm_bytes(self, kind: str | None = None, axis: str | None = None) -> int:
        """Bytes sent per rank per step, optionally of one kind and/or over one axis."""
        return sum(
            c.bytes
            for c in self.comms
            if (kind is None or c.kind == kind) and (axis is None or c.axis == axis)
        )

    def by_kind_and_axis(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(kind, axis): (count, bytes)}``, comparable with
        :meth:`functional_fsdp.CommCounter.by_kind_and_axis` of a measured step."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for c in self.comms:
            n, b = out.get((c.kind, c.axis), (0, 0))
            out[(c.kind, c.axis)] = (n + c.count, b + c.bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (ints, strings, lists, dicts), e.g. for JSON."""
        return {
            "name": self.name,
            "mesh": dict(self.mesh),
            "data_axes": list(self.data_axes),
            "sequence_axis": self.sequence_axis,
            "params": self.params,
            "trainable": self.trainable,
            "param_bytes": self.param_bytes,
            "padding_bytes": self.padding_bytes,
            "grad_bytes": self.grad_bytes,
            "opt_state_bytes": self.opt_state_bytes,
            "largest_unit": self.largest_unit,
            "largest_unit_bytes": self.largest_unit_bytes,
            "root_bytes": self.root_bytes,
            "gathered_peak_bytes": self.gathered_peak_bytes,
            "activation_bytes": self.activation_bytes,
            "activation_bytes_no_checkpoint": self.activation_bytes_no_checkpoint,
            "activation_bytes_checkpoint": self.activation_bytes_checkpoint,
            "recompute_bytes": self.recompute_bytes,
            "owner_bytes": list(self.owner_bytes),
            "owner_peak_rank": self.owner_peak_rank,
            "peak_bytes": self.peak_bytes,
            "comms": [vars(c) | {} for c in self.comms],
            "units": [vars(u) | {} for u in self.units],
        }

    def table(self) -> Any:
        """A ``rich`` renderable: memory per device, then communication per axis."""
        from ._render import report_table

        return report_table(self)

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from ._render import to_html

        return to_html(self.table())

    def summary(self) -> str:
        """The table as plain text, as wide as the terminal (``COLUMNS``, or 80 through a pipe)."""
        from ._render import to_text

        return to_text(self.table())


# --------------------------------------------------------------------------- helpers


class _ShapeMesh:
    """Axis names and sizes where code reads only those from a mesh (no process group)."""

    def __init__(self, sizes: Mapping[str, int]):
        self.mesh_dim_names = tuple(sizes)
        self.shape = tuple(sizes.values())


def _sizes_of(mesh: Any) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        sizes = {str(a): s for a, s in mesh.items()}
    elif hasattr(mesh, "mesh_dim_names"):
        from ..distributed.mesh import axis_sizes

        sizes = axis_sizes(mesh)
    else:
        raise TypeError(
            f"ff.plan takes the mesh as {{axis: size}}, e.g. {{'dp': 8}} or {{'dp': 4, 'tp': 2}} "
            f"(or a DeviceMesh), got {type(mesh).__name__}."
        )
    for a, s in sizes.items():
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(
                f"ff.plan: mesh axis {a!r} has size {s!r} in {sizes}; sizes are positive ints."
            )
    return sizes


def _optimizer(opt: OptimizerArg) -> GradientTransformation | None:
    if opt is None or isinstance(opt, GradientTransformation):
        return opt
    makers: dict[str, Callable[[], GradientTransformation]] = {
        "adamw": lambda: adamw(1e-3),
        "adam": lambda: adamw(1e-3, weight_decay=0.0),
        "sgd": lambda: sgd(1e-3),
        "momentum": lambda: sgd(1e-3, momentum=0.9),
    }
    if opt not in makers:
        raise ValueError(
            f"ff.plan(optimizer={opt!r}): use a GradientTransformation (e.g. ff.adamw(3e-4)), "
            f"one of {sorted(makers)}, or None for no optimizer state."
        )
    return makers[opt]()


def _state_bytes(
    optimizer: GradientTransformation | None, shards: dict[str, torch.Tensor]
) -> tuple[int, torch.dtype | None, dict[str, torch.dtype]]:
    """The bytes of ``optimizer``'s state on ``shards`` (``meta``), the dtype its
    :func:`~functional_fsdp.master_weights` state keeps the parameters in (else ``None``)
    and the dtypes of its masters (``{name: dtype}``, else empty)."""
    if optimizer is None or not shards:
        return 0, None, {}
    state = optimizer.init(shards)
    nbytes = sum(
        t.numel() * t.element_size()
        for t in optree.tree_leaves(state, namespace=NAMESPACE)
        if isinstance(t, torch.Tensor)
    )
    if not isinstance(state, MasterWeightsState) or not isinstance(state.master, dict):
        return nbytes, None, {}
    masters = {n: t.dtype for n, t in state.master.items() if isinstance(t, torch.Tensor)}
    return nbytes, state.param_dtype, masters


def _grad_dtypes(
    rest: Mapping[str, torch.dtype],
    kept: torch.dtype | None,
    masters: Mapping[str, torch.dtype],
    reduce: torch.dtype | None,
    zero1: bool,
    accumulate: int,
) -> dict[str, torch.dtype]:
    """The dtype each gradient is held in, as ``train_step`` holds it: the parameter's; under
    :func:`~functional_fsdp.master_weights`, the master's where they are reduced in a wider
    dtype than the parameters' (ZeRO-1's full gradients excepted: they are reduced once,
    onto the masters) and for a sum over micro-batches."""
    out = dict(rest)
    if kept is None:
        return out
    wider = reduce is not None and reduce != kept and _widens(kept, reduce)
    for n, master in masters.items():
        if (wider and not zero1) or accumulate > 1:
            out[n] = master
    return out


def _local_batch(
    batch: BatchArg,
    n: int,
    sizes: Mapping[str, int],
    data_axes: tuple[str, ...],
    seq_axis: str | None = None,
):
    """``(args, kwargs)`` on ``meta``: this rank's share of the global batch, as
    :func:`functional_fsdp.local_batch` takes it: dim 0 split ``n`` ways (the data ranks
    other than ``seq_axis``'s, times the micro-batches), and dim 1 of every tensor of 2 or
    more dims over ``seq_axis`` (context parallelism: two chunks of the sequence per rank)."""
    if batch is None:
        return None
    if isinstance(batch, tuple) and all(isinstance(s, int) for s in batch):
        batch = (torch.zeros(batch, dtype=torch.long, device="meta"),)
    elif isinstance(batch, torch.Tensor):
        batch = (batch,)
    if isinstance(batch, Mapping):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        raise TypeError(
            f"ff.plan(batch=...): give the global batch as a shape of token ids (e.g. (8, "
            f"1024)), a tensor, a tuple of positional inputs or a dict of keyword inputs; got "
            f"{type(batch).__name__}."
        )

    cp = sizes[seq_axis] if seq_axis is not None else 1
    splits = f"; {seq_axis!r} splits the sequence" if cp > 1 else ""

    def local(path: tuple[Any, ...], x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(
                f"ff.plan: a global batch of shape {tuple(x.shape)} does not split over the "
                f"{n} data-parallel ranks of {format_mesh(sizes)} (data axes {data_axes}"
                f"{splits}); use a batch size that is a multiple of {n}."
            )
        shape = [x.shape[0] // n, *x.shape[1:]]
        if cp > 1 and x.ndim >= 2:
            if x.shape[1] % (2 * cp):
                multiple = 2 * cp
                key = f"batch[{path[-1]!r}]" if path[0] == 1 else f"batch[{path[-1]}]"
                raise ValueError(
                    f"ff.plan: {key} of shape {tuple(x.shape)} has a sequence of "
                    f"{x.shape[1]} tokens (dim 1), which does not split into 2·cp = "
                    f"{multiple} equal chunks over the {seq_axis!r} axis of "
                    f"{format_mesh(sizes)}; plan with sequences of "
                    f"{-(-x.shape[1] // multiple) * multiple} tokens (a multiple of "
                    f"{multiple}), as the step takes them once padded with "
                    f"ff.cp.pad_sequence(batch, {multiple})."
                )
            shape[1] //= cp
        return torch.empty(shape, dtype=x.dtype, device="meta")

    return optree.tree_map_with_path(local, (args, kwargs), none_is_leaf=True)


def _stand_in_batch(
    model: nn.Module, rows: int, tokens: int = 1
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """This rank's share of a batch of ``rows`` rows for a step run without a batch: the
    FSDP and step collectives do not depend on the batch. Token ids of ``tokens`` tokens (2
    where a sequence split needs a chunk on each side) for a model that starts with an
    embedding, features for one that starts with a linear layer."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return (torch.zeros(rows, tokens, dtype=torch.long, device="meta"),), {}
        if isinstance(m, nn.Linear):
            x = torch.zeros(rows, m.in_features, dtype=m.weight.dtype, device="meta")
            return (x,), {}
    raise ValueError(
        f"ff.plan: without batch=, the communication is counted on a stand-in batch, which "
        f"the planner makes for models that start with an nn.Embedding or nn.Linear; this "
        f"{type(model).__name__} does not. Pass batch= (e.g. a tuple of its inputs on meta)."
    )


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# --------------------------------------------------------------------------- plan


def plan(
    model: nn.Module,
    mesh: Mapping[str, int] | Any,
    *,
    batch: BatchArg = None,
    specs: Specs | None = None,
    units: UnitsArg = None,
    policy: Policy | None = None,
    data_axes: Sequence[str] | None = None,
    sequence_axis: str | bool | None = True,
    trainable: Sequence[str] | Callable[[str], bool] | None = None,
    tp_plan: Mapping[str, Style] | None = None,
    tp_axis: str = "tp",
    optimizer: OptimizerArg = "adamw",
    opt_specs: Specs | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | Literal["lm"] | None = "lm",
    accumulate: int = 1,
    accumulate_mode: Literal["reduce_each", "local"] = "reduce_each",
    name: str = "",
    _memo: dict[Any, Any] | None = None,
) -> PlanReport:
    """Price one training step of ``model`` on a mesh, per device, from shapes alone.

    Takes the arguments of :func:`functional_fsdp.fsdp` (and of
    :func:`functional_fsdp.tensor_parallel` and :func:`functional_fsdp.train_step` where
    they matter) and returns a :class:`PlanReport`. Nothing is allocated and no process is
    started: build big models on ``meta`` (``with torch.device("meta"): model = ...``).

    The communication figures are counted, not derived: one real ``ff.train_step(loss,
    optimizer, model=ff.fsdp(model, mesh, ...))`` runs on
    ``ff.simulated_mesh(mesh, shapes_only=True)`` (rank 0 on ``meta`` tensors: nothing is
    allocated) inside :func:`functional_fsdp.count_comms`, with this rank's share of
    ``batch`` and ``loss = loss_fn(model output)``; whatever the step issues (the loss
    all-reduce, a clip's and the metrics' norms, ZeRO's gathers, a loss's own collectives) is
    in the plan. A model with more than 3 identical blocks (a ``ModuleList`` of units of one
    type, shapes, specs, trainability and checkpointing) runs as 2 and 3 blocks and is
    extrapolated, which is exact: every figure is affine in the number of such blocks
    (``tests/test_planner.py`` checks the extrapolation against the full step). Without a
    batch, the step runs on a stand-in batch of one token (or one feature row) per rank and
    the tensor-parallel traffic, which scales with the batch, is left out. The step needs
    its own (fake) process group, so ``plan`` raises inside a job that already has one:
    plan before ``init_process_group``, or with ``python -m functional_fsdp.planner``.

    Args:
        model: the module (any device; ``meta`` for big ones). Never modified.
        mesh: ``{axis: size}``, e.g. ``{"dp": 1024}`` or ``{"dp": 128, "tp": 8}``.
        batch: the global batch: a shape of token ids (``(batch, seq)``), a tensor, a tuple
            of positional inputs or a dict of keyword inputs (values on ``meta`` are fine).
            Dim 0 is split over the data axes. ``None``: no activation figures.
        specs: as for :func:`functional_fsdp.fsdp`.
        units: as for :func:`functional_fsdp.fsdp`.
        policy: as for :func:`functional_fsdp.fsdp`.
        data_axes: as for :func:`functional_fsdp.fsdp`.
        sequence_axis: as for :func:`functional_fsdp.fsdp`: the data axis that splits each
            sequence (dim 1 of every batch tensor of 2 or more dims), by default ``"cp"``
            where the mesh has it (context parallelism, :mod:`functional_fsdp.cp`). The
            activations are then those of a rank's tokens, with the keys and values its
            attention gathers; the gathers and their gradients' reduce-scatters are
            counted as they are issued, under the source ``"cp"``.
        trainable: as for :func:`functional_fsdp.fsdp`.
        tp_plan: a tensor-parallel plan (``{pattern: Style}``) over ``tp_axis``; the specs are
            then those of :func:`functional_fsdp.tensor_parallel` unless ``specs`` is given.
        optimizer: a ``GradientTransformation``, ``"adamw"``, ``"adam"``, ``"sgd"``,
            ``"momentum"`` or ``None``; its state is measured by running its ``init``.
        opt_specs: the optimizer layout (as for ``TrainState.create``): with parameters
            replicated over the data axes and ``P("dp")`` here, ZeRO-2 (or ZeRO-1 with
            ``accumulate_mode="local"``): gradients reduce-scattered to the shards, updated
            parameters all-gathered. With :func:`~functional_fsdp.master_weights` as the
            ``optimizer``, trainable parameters and gradients are priced in its
            ``param_dtype`` and its fp32 masters with the optimizer state.
        loss_fn: ``loss_fn(output) -> scalar`` run after the forward for its activations;
            ``"lm"`` (default): next-token cross entropy on the logits in float32; ``None``:
            no loss.
        accumulate: micro-batches per step: the batch is split further and, with
            ``accumulate_mode="reduce_each"``, the FSDP collectives repeat per micro-batch.
        accumulate_mode: as for ``train_step``; it matters for ZeRO layouts: ``"local"``
            (ZeRO-1) keeps full gradients and reduce-scatters once per step.
        name: a label for tables and comparisons.

    Raises:
        ValueError: a spec that does not fit its parameter, a batch that does not split over
            the data ranks, an unknown axis, or a TP style the planner does not model.
        RuntimeError: a process group exists already (see above).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from functional_fsdp.models import GPT, GPTConfig
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(n_layer=2, n_embd=64))
        >>> report = ff.plan(model, {"dp": 4}, batch=(8, 64))
        >>> report.param_bytes * 4 >= 4 * sum(p.numel() for p in model.parameters())
        True
        >>> report.by_kind_and_axis()[("all_gather", "dp")][0]  # root + 2 blocks, twice
        6
    """
    # _memo (private: compare_strategies) is shared by plans of one model (see _remember): what
    # depends only on the same inputs (a unit layout, the optimizer state of the same shards,
    # a forward trace on the same compute shapes) is worked out once.
    memo = {} if _memo is None else _memo
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"ff.plan takes an nn.Module, got {type(model).__name__}: build the model (on "
            f"'meta' for big ones) and pass it, e.g. ff.plan(model, {{'dp': 8}})."
        )
    model = storage_view(model)  # a quantized base as ff.fsdp stores it (formats/)
    sizes = _sizes_of(mesh)
    _run.check_no_process_group()
    mesh_str = format_mesh(sizes)
    if tp_plan is not None and tp_axis not in sizes:
        raise ValueError(
            f"ff.plan(tp_plan=...): the mesh {mesh_str} has no tensor-parallel axis "
            f"{tp_axis!r}; add one, e.g. {{'dp': 4, {tp_axis!r}: 2}}, or pass tp_axis=."
        )
    data_axes = data_axes_of(sizes, data_axes, "ff.plan", model_axes=(tp_axis,))
    seq_axis = sequence_axis_of(sizes, data_axes, sequence_axis, "ff.plan")
    split = (dict(sizes), seq_axis) if seq_axis is not None and sizes[seq_axis] > 1 else None
    if accumulate < 1:
        raise ValueError(f"ff.plan: accumulate must be >= 1, got {accumulate}")
    policy = policy or Policy()
    mp = policy.mixed_precision
    shape_mesh = _ShapeMesh(sizes)
    styles: dict[str, Style] = {}
    user_specs = specs
    if tp_plan is not None:
        from ..tp.plan import tensor_parallel

        tp = tensor_parallel(model, shape_mesh, tp_plan, axis=tp_axis, verify=False)  # type: ignore[arg-type]
        styles = tp.styles
        if specs is None:
            specs = tp.specs
    if specs is None:
        specs = default_specs(shape_mesh, data_axes, policy.secondary_axis)  # type: ignore[arg-type]
    unit_paths = tuple(find_units(model, units))
    module_params = dict(model.named_parameters())
    paths = optree.tree_paths(module_params, none_is_leaf=True)  # type: ignore[arg-type]
    resolved = dict(zip((p[0] for p in paths), resolve_specs(module_params, specs)))
    param_specs = {n: resolved[n] or P() for n in module_params}
    the_plan: ModelLayout = _remember(
        memo,
        ("plan", tuple(sizes.items()), tuple(param_specs.items()), unit_paths, data_axes),
        lambda: model_layout(model, sizes, param_specs, unit_paths, data_axes, mp.param_dtype),
        mp.param_dtype,
    )
    train = _trainable(model, trainable)

    # ---- at rest
    layouts: dict[str, Layout] = {}
    dtypes: dict[str, torch.dtype] = {}
    for up in the_plan.units.values():
        for n, lay, dt in zip(up.names, up.layouts, up.dtypes):
            layouts[n], dtypes[n] = lay, dt
    opt = _optimizer(optimizer)
    opt_layouts = dict(layouts)
    if opt_specs is not None:
        tr = {n: module_params[n] for n in layouts if n in train}
        tpaths = optree.tree_paths(tr, none_is_leaf=True)  # type: ignore[arg-type]
        ospecs = dict(zip((p[0] for p in tpaths), resolve_specs(tr, opt_specs)))
        opt_layouts = {n: Layout.make(layouts[n].global_shape, ospecs[n] or P(), sizes) for n in tr}
    shards = {
        n: torch.empty(opt_layouts[n].local_shape, dtype=dtypes[n], device="meta")
        for n in layouts
        if n in train
    }
    opt_state_bytes, kept, master_dtypes = _remember(  # master_weights' dtypes, off its state
        memo,
        ("opt", id(opt), tuple((n, tuple(t.shape), t.dtype) for n, t in shards.items())),
        lambda: _state_bytes(opt, shards),
    )
    rest = {
        n: kept if kept is not None and n in train and dt.is_floating_point else dt
        for n, dt in dtypes.items()
    }
    param_bytes = sum(layouts[n].local_numel * rest[n].itemsize for n in layouts)
    total_elems = sum(_numel(lay.global_shape) for lay in layouts.values())
    # Padding: what a rank holds beyond its share of the distinct values (replicas included).
    exact = sum(
        _numel(layouts[n].global_shape)
        * rest[n].itemsize
        / math.prod(sizes[a] for a in layouts[n].spec.axes)
        for n in layouts
    )
    padding = param_bytes - round(exact)
    param_bytes += replicated_bytes(model)  # a quantized base's code tables, on every rank
    data_set = set(data_axes)
    zero = (
        opt_specs is not None
        and any(n in train for n in layouts)
        and all(not data_set & set(layouts[n].spec.axes) for n in layouts if n in train)
        and any(data_set & set(opt_layouts[n].spec.axes) for n in layouts if n in train)
    )
    zero1 = zero and accumulate_mode == "local"
    grad_layouts = opt_layouts if zero and not zero1 else layouts
    grad_dtypes = _grad_dtypes(
        rest, kept, master_dtypes, mp.reduce_dtype or mp.param_dtype, zero1, accumulate
    )
    grad_bytes = sum(
        grad_layouts[n].local_numel * grad_dtypes[n].itemsize for n in layouts if n in train
    )

    # ---- gathered parameters
    root = the_plan.units.get("")
    root_bytes = root.gathered_bytes if root is not None else 0
    order = [the_plan.units[u].gathered_bytes for u in the_plan.order]
    if policy.reshard_after_forward:
        w = policy.prefetch + 1
        window = max((sum(order[i : i + w]) for i in range(len(order))), default=0)
    else:
        window = sum(order)
    gathered_peak = root_bytes + window
    if policy.secondary_axis is not None:  # hpZ: every unit's secondary shard, the root's too
        gathered_peak += sum(
            _secondary_bytes(up, policy.secondary_axis, policy) for up in the_plan.units.values()
        )
    largest = max(the_plan.units.values(), key=lambda u: u.gathered_bytes)

    # ---- activations
    trace = None
    n_data = math.prod(sizes[a] for a in data_axes if a != seq_axis)  # rows split this way
    local = _local_batch(batch, n_data * accumulate, sizes, data_axes, seq_axis)
    loss = _activations.lm_loss if loss_fn == "lm" else loss_fn
    if local is not None:
        params = _compute_params(the_plan, sizes, data_axes, mp.param_dtype, train)
        cast = mp.param_dtype if mp.cast_forward_inputs else None
        key = None
        if not styles:  # a TP trace depends on the styles too: not shared
            key = ("trace", the_plan.order, _shapes(params), _shapes(local), id(loss), cast)
            key += (None if split is None else (tuple(split[0].items()), split[1]),)
        trace = _remember(
            memo,
            key,
            lambda: _activations.trace_forward(
                model,
                params,
                the_plan.order,
                local[0],
                local[1],
                loss,  # type: ignore[arg-type]
                styles,
                sizes.get(tp_axis, 1),
                cast,
                split,
            ),
        )
    ckpt = policy.activation_checkpointing

    def checkpointed(u: str) -> bool:
        if u == "" or u == "<loss>":
            return False
        return bool(ckpt(u)) if callable(ckpt) else bool(ckpt)

    act = act_none = act_all = None
    recompute = 0
    unit_figs = []
    if trace is not None:
        run_units = [u for u in the_plan.order if u in trace.saved]

        def total(ck: Callable[[str], bool]) -> int:
            kept: dict[Any, int] = {}
            for u, saved in trace.saved.items():
                kept.update(trace.inputs.get(u, {}) if u in run_units and ck(u) else saved)
            return sum(kept.values())

        act = total(checkpointed)
        act_none = total(lambda u: False)
        act_all = total(lambda u: True)
        recompute = max(
            (sum(trace.saved[u].values()) for u in run_units if checkpointed(u)), default=0
        )
    for u in ["", *the_plan.order, *(["<loss>"] if trace and "<loss>" in trace.saved else [])]:
        up = the_plan.units.get(u)
        if u == "" and up is None and trace is None:
            continue
        saved = trace.saved.get(u) if trace is not None else None
        inputs = trace.inputs.get(u) if trace is not None else None
        unit_figs.append(
            UnitFigure(
                name=u,
                params=sum(_numel(lay.global_shape) for lay in up.layouts) if up else 0,
                gathered_bytes=up.gathered_bytes if up else 0,
                activation_bytes=sum(saved.values()) if saved is not None else None,
                checkpoint_bytes=sum(inputs.values()) if inputs is not None else None,
                checkpointed=checkpointed(u) if u in the_plan.order else False,
            )
        )

    # ---- communication: one real train_step, counted on a shapes-only mesh (see ._run)
    if batch is not None:
        run_batch = _local_batch(batch, n_data, sizes, data_axes, seq_axis)
    else:
        run_batch = _stand_in_batch(model, accumulate, 1 if split is None else 2)

    def source(kind: str, axis: str, nbytes: int, label: str | None) -> str:
        """Who issued a collective: context-parallel attention (its keys and values, and
        their gradients: labelled so by the attention), the step (a scalar all-reduce: the
        loss, the norm; ZeRO's gradient reduce-scatter and parameter all-gather), tensor
        parallelism (another axis) or FSDP."""
        if label == COMM_LABEL:
            return "cp"
        if label == MUON_LABEL:  # a split matrix's all-reduces, over every axis (tp too)
            return "step"
        # The step's all-reduces carry a few scalars: the loss (with a count for a (sum,
        # count) loss, in float64), the norm with its count of non-finite tensors; a ring
        # sends under twice the payload. Gradient buckets are far larger.
        if kind == "all_reduce" and nbytes < 64:
            return "step"
        if kind == "all_to_all":  # the optimizer's: Muon's matrices to their owners and back
            return "step"
        if axis not in data_set:
            return "tp"
        if (zero and kind == "all_gather") or (zero1 and kind == "reduce_scatter"):
            return "step"
        return "fsdp"

    engine = dict(specs=user_specs, units=units, policy=policy, data_axes=data_axes)
    engine["sequence_axis"] = seq_axis
    engine["trainable"] = trainable
    stepping = dict(optimizer=opt, opt_specs=opt_specs, accumulate=accumulate)
    stepping["accumulate_mode"] = accumulate_mode

    exchanges: list[Any] = []  # the last counted step's (Muon's) exchanges of whole matrices

    def count(m: nn.Module) -> _run.Counts:
        with recording_exchanges() as book:
            counts = _run.count_step(
                m, sizes, run_batch, engine, (tp_plan, tp_axis), stepping, loss, source
            )
        exchanges[:] = book
        return counts

    blocks = _run.repeated_blocks(
        model,
        unit_paths,
        lambda n: (param_specs.get(n), n in train, styles.get(n.rpartition(".")[0])),
        checkpointed,
    )
    if blocks is None:
        counts = count(model)
    else:
        path, n_blocks = blocks
        runs = [count(_run.shortened(model, path, keep)) for keep in _run.SHORT]
        if any(k[0] == "all_to_all" for r in runs for k in r):
            # An optimizer that sends whole matrices to owners balanced over the model
            # (Muon) is not affine in the number of blocks: count the whole model.
            counts = count(model)
        else:
            counts = _run.extrapolate(runs, n_blocks)
    if batch is None:  # tensor- and context-parallel traffic scale with the batch
        counts = {k: v for k, v in counts.items() if k[2] not in ("tp", "cp")}
    owner_bytes = _owner_bytes(exchanges, math.prod(sizes.values()))
    comms = tuple(CommFigure(k, a, n, b, src) for (k, a, src), (n, b) in sorted(counts.items()))

    return PlanReport(
        name=name,
        mesh=dict(sizes),
        data_axes=data_axes,
        sequence_axis=seq_axis,
        params=total_elems,
        trainable=sum(_numel(layouts[n].global_shape) for n in layouts if n in train),
        param_bytes=param_bytes,
        padding_bytes=max(padding, 0),
        grad_bytes=grad_bytes,
        opt_state_bytes=opt_state_bytes,
        largest_unit=largest.name,
        largest_unit_bytes=largest.gathered_bytes,
        root_bytes=root_bytes,
        gathered_peak_bytes=gathered_peak,
        activation_bytes=act,
        activation_bytes_no_checkpoint=act_none,
        activation_bytes_checkpoint=act_all,
        recompute_bytes=recompute,
        comms=comms,
        units=tuple(unit_figs),
        seconds=time.perf_counter() - start,
        owner_bytes=owner_bytes,
    )


def _owner_bytes(exchanges: Sequence[tuple[dict[str, int], list[Any]]], n: int) -> tuple[int, ...]:
    """Per rank, the most bytes the step's exchanges of whole matrices hold at once (they run
    one after another; each frees its buffers, and only the blocks it returns outlive it,
    which the step's updates hold anyway: the largest exchange counts)."""
    if not exchanges:
        return ()
    per = [exchange_memory(matrices, axes) for axes, matrices in exchanges]
    return tuple(max(p[r] for p in per) for r in range(n))


def _remember(memo: dict[Any, Any], key: Any, make: Callable[[], Any], *more: Any) -> Any:
    """``make()``, remembered in ``memo`` under ``key`` (and ``more``); ``key=None``: not
    remembered. Plans of one model share a memo (:func:`compare_strategies`): the values
    are read, never changed, so sharing them is safe."""
    if key is None:
        return make()
    key = (*key, *more)
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _shapes(tree: Any) -> tuple[Any, ...]:
    """A hashable signature of a tree of tensors: its structure, and each leaf's shape,
    dtype and ``requires_grad`` (other leaves by ``repr``); tied tensors by position."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    first: dict[int, int] = {}
    sig = [str(spec)]
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), x.dtype, x.requires_grad, first.setdefault(id(x), i)))
        else:
            sig.append(repr(x))
    return tuple(sig)


def _secondary_bytes(up: UnitLayout, axis: str, policy: Policy) -> int:
    """The bytes hpZ (``Policy(reshard_after_forward=axis)``) keeps of unit ``up`` from its
    forward to its backward: each parameter as it was before its gather round over
    ``axis`` (the output of its previous round, padded; a cast or offloaded copy of its
    shard when that round is its first; nothing when it is the shard itself), and each
    other gathered parameter whole (the forward does not free it).

    Example:
        >>> from torch import nn
        >>> from functional_fsdp.fsdp.layout import model_layout
        >>> up = model_layout(
        ...     nn.Linear(4, 8), {"node": 2, "gpu": 2}, {"weight": P(("gpu", "node")),
        ...     "bias": P(("gpu", "node"))}, [], ("node", "gpu"), None
        ... ).units[""]
        >>> up.gathered_bytes, _secondary_bytes(up, "gpu", Policy())  # half of the float32s
        (160, 80)
    """
    held: dict[int, int] = {}  # per parameter: the bytes of its value after the last round
    kept: dict[int, int] = {}
    float8 = isinstance(policy.gather_quantization, Float8Gather)
    for rnd in up.rounds:
        for p in rnd.pieces:
            if rnd.axis == axis:
                copied = policy.offload or not (
                    (float8 and rnd.first) or up.dtypes[p.index] == rnd.dtype
                )
                local = math.prod(p.local_shape) * rnd.dtype.itemsize if copied else 0
                kept[p.index] = held.get(p.index, local)
            held[p.index] = math.prod(p.padded_shape(rnd.size)) * rnd.dtype.itemsize
    return sum(kept.get(i, b) for i, b in held.items())


def _trainable(model: nn.Module, trainable: Any) -> frozenset[str]:
    return trainable_names(model, trainable, where="ff.plan")


def _compute_params(
    the_plan: ModelLayout,
    sizes: Mapping[str, int],
    data_axes: tuple[str, ...],
    param_dtype: torch.dtype | None,
    train: frozenset[str],
) -> dict[str, torch.Tensor]:
    """``{alias: meta tensor}`` in the shape a rank computes with: gathered over the data
    axes, still split over the model axes (tensor parallelism)."""
    out: dict[str, torch.Tensor] = {}
    for up in the_plan.units.values():
        for n, aliases, lay, dt in zip(up.names, up.aliases, up.layouts, up.dtypes):
            spec = lay.spec
            for a in data_axes:
                if a in spec.axes:
                    spec = spec.without(a)
            shape = Layout.make(lay.global_shape, spec, sizes).local_shape
            t = torch.empty(shape, dtype=gather_dtype(dt, param_dtype), device="meta")
            t.requires_grad_(n in train and t.is_floating_point())
            for alias in aliases:
                out[alias] = t
    return out
