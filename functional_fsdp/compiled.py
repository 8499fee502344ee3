"""A compiled step: :func:`jit` traces a pure function once per input signature into one
graph, compiles it, and replays it.

A ``train_step`` is a pure function of ``(state, batch)``, so the whole step (forward,
backward, the collectives of every unit, clipping, the optimizer update, the schedule,
``apply_if_finite``) can be traced into one FX graph and compiled once, as ``jax.jit`` does:

* **Tracing** runs the function once on fake tensors (``make_fx``): no numbers are computed
  and no collective is sent, but every tensor operation the function performs, the c10d
  functional collectives included, becomes a node of the graph. Python runs once, at trace
  time: its control flow, this library's bookkeeping (units, buckets, prefetch) and the
  module copies cost nothing when the graph is replayed.
* **Per-step values are tensors.** A Python ``int`` or ``float`` among the arguments (the
  step count of a :class:`~functional_fsdp.TrainState`, an optimizer's count, a learning
  rate recorded in its state) is traced as a 0-dim int64 or float64 tensor, as ``jax.jit``
  traces Python scalars, so learning-rate schedules, Adam's bias correction and
  ``apply_if_finite``'s counters are computed inside the graph and one compilation serves
  every step. Every other non-tensor leaf (strings, bools, layouts, the mesh) is static: a
  new value traces again.
* **Compiling** hands the graph to inductor (``backend="inductor"``), which fuses the
  optimizer's elementwise work with the gradient computation and keeps the collectives as
  asynchronous kernels. ``backend="eager"`` replays the traced graph op by op (no compiler:
  useful to see what a trace gives before paying for a compile).
* **Collectives stay overlapped.** Each all-gather and reduce-scatter is issued where the
  eager step issues it (a unit's gather is prefetched before the previous unit computes), and
  its wait is moved to just before the first use of its result. Inductor keeps that order
  (its own reordering passes are off: each held memory the eager step does not). On gloo a
  gather is one op of the graph that broadcasts each rank's row in place, as the eager step
  does, instead of gloo's all-gather, which holds its output twice while in flight.
* **Donation.** A step built with ``train_step(..., donate=True)`` updates the state's buffers
  in place; traced, those in-place updates are part of the graph (inductor writes the new
  values into the donated buffers) and the input state is dead afterwards, as in eager.
* **One source of truth for communication.** The collectives of a compiled step are those of
  its graph: :meth:`Jitted.comms` reads them off the graph, and each call records them into
  the enclosing :func:`~functional_fsdp.count_comms` blocks exactly as the eager step does.

What a trace cannot take raises :class:`TraceError` naming it and the fix, never a silent
fallback: reading a tensor's value in Python (``.item()``, ``if loss > 0:``, ``int(t)``),
random numbers (dropout: a compiled step would not replay them from the state's key), and a
simulated mesh (its ranks share one process through a dispatch mode that cannot be traced).
Python side effects (appending to a list, printing) run once, at trace time, as under
``jax.jit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Literal

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from ._fx import writes_in_place
from ._tree import NAMESPACE
from .distributed import accounting
from .distributed.accounting import CommCounter, CommRecord
from .distributed.axes import axis_sizes
from .distributed.collectives import GLOO_ALL_GATHER
from .distributed.simulate import is_simulated
from .sharded import Sharded
from .train import TrainState

Backend = Literal["inductor", "eager"]
BACKENDS: tuple[str, ...] = ("inductor", "eager")

_C10D = "_c10d_functional"
_WAIT = "wait_tensor"


class TraceError(TypeError):
    """A function given to :func:`jit` does something a traced step cannot.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> f = ff.jit(lambda x: x * 2 if x.sum() > 0 else x, backend="eager")
        >>> f(torch.ones(2))
        Traceback (most recent call last):
        ...
        functional_fsdp.compiled.TraceError: ff.jit: the function reads a tensor's value in Python ...
    """


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compilation of a :class:`Jitted` function: its graph and what it needs to replay.

    Attributes:
        graph: the traced FX graph (flat tensors in, flat tensors out), after the wait pass.
        run: the compiled callable (inductor's, or the graph itself with ``"eager"``).
        out_def: the output's tree structure; ``constants`` are its non-tensor leaves.
        records: the collectives of one call, as :func:`count_comms` records them.
        donated: positions of the arguments (TrainStates) the function donates.
        trace_seconds, compile_seconds: wall time of the trace and of the compile.
    """

    graph: torch.fx.GraphModule
    run: Callable[..., Any]
    out_def: Any
    constants: dict[int, Any]
    records: tuple[CommRecord, ...]
    donated: tuple[int, ...]
    trace_seconds: float
    compile_seconds: float


class Jitted:
    """A function compiled per input signature by :func:`jit`; call it like the function.

    Attributes:
        compilations: how many times it traced and compiled (one per new input signature).
        backend: ``"inductor"`` or ``"eager"``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> double = ff.jit(lambda x: {"y": x * 2}, backend="eager")
        >>> double(torch.ones(2))["y"].tolist(), double.compilations
        ([2.0, 2.0], 1)
        >>> len(double.lower(torch.ones(2)).graph.graph.nodes)  # x, mul, output
        3
    """

    def __init__(self, fn: Callable[..., Any], backend: Backend) -> None:
        self.fn, self.backend = fn, backend
        self._cache: dict[Any, Compiled] = {}
        self.compilations = 0

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"ff.jit({name}, backend={self.backend!r}, compilations={self.compilations})"

    # ----------------------------------------------------------------- calling

    def __call__(self, *args: Any) -> Any:
        tensors, static, treedef = _flatten_args(args)
        compiled = self._lookup(tensors, static, treedef)
        outs = compiled.run(*tensors)
        for counter in accounting.active_counters():
            counter.records.extend(compiled.records)
        for i in compiled.donated:  # dead now, as after an eager donating step
            state = args[i]
            state._donated_at = state._step
        return _unflatten_out(compiled, list(outs))

    def lower(self, *args: Any) -> Compiled:
        """The compilation for these arguments (traced and compiled on first sight)."""
        return self._lookup(*_flatten_args(args))

    def _lookup(self, tensors: list[torch.Tensor], static: list[Any], treedef: Any) -> Compiled:
        key = _signature(tensors, static, treedef)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = self._compile(tensors, static, treedef)
            self.compilations += 1
        return compiled

    def comms(self, *args: Any) -> CommCounter:
        """The collectives one call with these arguments issues, read off its graph.

        Example:
            >>> import torch, functional_fsdp as ff
            >>> ff.jit(lambda x: x + 1, backend="eager").comms(torch.ones(2)).count()
            0
        """
        return graph_comms(self.lower(*args).graph, _meshes(args))

    # ----------------------------------------------------------------- compiling

    def _compile(self, tensors: list[torch.Tensor], static: list[Any], treedef: Any) -> Compiled:
        from torch.fx.experimental.proxy_tensor import make_fx

        if is_simulated():
            raise TraceError(
                "ff.jit: a simulated mesh runs every rank in one process through a dispatch "
                "mode that cannot be traced into one graph. Run the compiled step on real "
                "processes (torchrun, or ff.launch), or call the step without ff.jit here."
            )
        out_info: dict[str, Any] = {}
        positions = [i for i, x in enumerate(static) if x is _TENSOR]

        def flat(*flat_tensors: torch.Tensor) -> list[torch.Tensor]:
            leaves = list(static)
            for p, t in zip(positions, flat_tensors):
                leaves[p] = t
            call_args = optree.tree_unflatten(treedef, leaves)
            out = self.fn(*call_args)
            out_leaves, out_def = optree.tree_flatten(out, namespace=NAMESPACE, none_is_leaf=True)
            out_info["def"] = out_def
            out_info["constants"] = {
                i: x for i, x in enumerate(out_leaves) if not isinstance(x, torch.Tensor)
            }
            out_info["donated"] = tuple(
                i
                for i, a in enumerate(call_args)
                if isinstance(a, TrainState) and a._donated_at is not None
            )
            return [x for x in out_leaves if isinstance(x, torch.Tensor)]

        start = time.perf_counter()
        with accounting.isolated() as counter, _compiling():
            try:
                graph = make_fx(
                    flat, tracing_mode="fake", _allow_non_fake_inputs=True, record_stack_traces=True
                )(*tensors)
            except Exception as error:  # re-raised, named where it is one a trace refuses
                raise _trace_error(error) from error
        _refuse_random_ops(graph)
        sink_waits(graph)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        run = _backend(self.backend, graph, tensors)
        return Compiled(
            graph=graph,
            run=run,
            out_def=out_info["def"],
            constants=out_info["constants"],
            records=tuple(counter.records),
            donated=out_info["donated"],
            trace_seconds=traced,
            compile_seconds=time.perf_counter() - start,
        )


def jit(
    fn: Callable[..., Any] | None = None, *, backend: Backend = "inductor"
) -> Jitted | Callable[[Callable[..., Any]], Jitted]:
    """Compile a pure function of pytrees (a ``train_step``) into one graph per signature.

    The first call with a new input signature (tree structure, each tensor's shape, dtype
    and device, every static leaf's value) traces the function on fake tensors and compiles
    the graph; later calls with the same signature replay it. See the module docstring for
    what is traced, what is static, and what a trace refuses.

    Args:
        fn: a pure function of pytrees of tensors, :class:`~functional_fsdp.Sharded` values
            and :class:`~functional_fsdp.TrainState` (e.g. ``ff.train_step(...)``'s step),
            returning a pytree. Used as a decorator without ``fn``.
        backend: ``"inductor"`` (compile with ``torch.compile``'s compiler: fused kernels)
            or ``"eager"`` (replay the traced graph op by op, nothing compiled).

    Returns:
        A :class:`Jitted` callable with the same arguments and results as ``fn``; Python
        ints and floats among the arguments come back as 0-dim tensors (e.g.
        ``state.step``).

    Raises:
        ValueError: for an unknown backend.
        TraceError: (at the first call) if ``fn`` reads tensor values in Python, draws
            random numbers, or runs on a simulated mesh.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> opt = ff.adamw(1e-2)
        >>> step = ff.train_step(lambda p, b: (p["w"] * b).pow(2).mean(), opt, batch="local")
        >>> fast = ff.jit(step, backend="eager")  # "inductor" (the default) compiles too
        >>> state = ff.TrainState.create({"w": torch.ones(3)}, opt)
        >>> for _ in range(3):
        ...     state, metrics = fast(state, torch.arange(3.0))
        >>> int(state.step), fast.compilations
        (3, 1)
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"ff.jit: backend must be 'inductor' (compile the traced step) or 'eager' (replay "
            f"the traced graph op by op), got {backend!r}."
        )
    if fn is None:
        return lambda f: Jitted(f, backend)
    if not callable(fn):
        raise TypeError(
            f"ff.jit takes a function (e.g. the step ff.train_step returns), got "
            f"{type(fn).__name__}."
        )
    return Jitted(fn, backend)


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while tracing, as under ``torch.export``'s
    tracing: libraries (``transformers``' masks, this library's own checks) then skip the
    Python-side checks of tensor values that a trace cannot take."""
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = flag


# --------------------------------------------------------------------------- flattening


class _TensorSlot:
    """Marks a tensor position among the static leaves of a signature."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


def _flatten_args(args: tuple[Any, ...]) -> tuple[list[torch.Tensor], list[Any], Any]:
    """The tensors of ``args`` (Python ints and floats among them as 0-dim int64 and float64
    tensors), the static leaves (``_TENSOR`` where a tensor goes) and the tree structure."""
    leaves, treedef = optree.tree_flatten(args, namespace=NAMESPACE, none_is_leaf=True)
    tensors, static = [], []
    for x in leaves:
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            x = torch.tensor(x, dtype=torch.int64 if isinstance(x, int) else torch.float64)
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            static.append(_TENSOR)
        else:
            static.append(x)
    return tensors, static, treedef


def _signature(tensors: list[torch.Tensor], static: list[Any], treedef: Any) -> Any:
    described = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in tensors)
    try:
        return treedef, described, tuple(static)
    except TypeError:  # pragma: no cover - unhashable static leaves: one entry by identity
        return treedef, described, tuple(id(x) for x in static)


def _unflatten_out(compiled: Compiled, outs: list[torch.Tensor]) -> Any:
    it = iter(outs)
    leaves = [
        compiled.constants[i] if i in compiled.constants else next(it)
        for i in range(compiled.out_def.num_leaves)
    ]
    return optree.tree_unflatten(compiled.out_def, leaves)


def _meshes(args: tuple[Any, ...]) -> list[DeviceMesh]:
    found: dict[int, DeviceMesh] = {}
    is_sharded = lambda v: isinstance(v, Sharded)  # noqa: E731
    for x in optree.tree_leaves(args, namespace=NAMESPACE, is_leaf=is_sharded):
        if isinstance(x, Sharded):
            found.setdefault(id(x.mesh), x.mesh)
    return list(found.values())


# --------------------------------------------------------------------------- the graph


def _is_c10d(node: torch.fx.Node, name: str | None = None) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != _C10D:
        return False
    return name is None or target._schema.name.split("::")[-1] == name


def sink_waits(graph: torch.fx.GraphModule) -> int:
    """Move every collective's wait down to just before the first use of its result.

    A traced c10d functional collective is followed by its ``wait_tensor`` at once; the
    eager step instead waits where the result is needed, so compute issued in between
    overlaps the communication. Views of the result (a reshape into rows, a split) are no
    use: they move down with the wait, to the first operation that reads the data. A wait
    never moves past an in-place write (a donated buffer's update could overwrite what a
    collective in flight still reads). Returns the number of waits moved.
    """
    moved = 0
    nodes = list(graph.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    writes = [i for i, n in enumerate(nodes) if writes_in_place(n)]
    for node in nodes:
        if not _is_c10d(node, _WAIT) or not node.users:
            continue
        views, readers = _views_and_readers(node)
        target = min(readers, key=lambda u: order[u])
        here = order[node]
        barrier = next((i for i in writes if i > here), None)
        if barrier is not None and barrier < order[target]:
            target = nodes[barrier]
        if target is not node.next:
            for n in sorted([node, *views], key=lambda n: order[n]):
                if order[n] < order[target]:
                    target.prepend(n)
            moved += 1
    if moved:
        graph.graph.lint()
        graph.recompile()
    return moved


def _views_and_readers(node: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The views taken of ``node``'s result (transitively), and the nodes that read it."""
    views: dict[torch.fx.Node, None] = {}
    readers: dict[torch.fx.Node, None] = {}
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user in views or user in readers:
            continue
        if _is_view(user) and all(a is node or a in views for a in user.all_input_nodes):
            views[user] = None
            stack.extend(user.users)
        else:
            readers[user] = None
    return list(views), list(readers)


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` only takes a view of its input (no kernel runs): a view op, or an
    item of a view op's list of views."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def graph_comms(graph: torch.fx.GraphModule, meshes: list[DeviceMesh]) -> CommCounter:
    """The collectives of a traced graph as :func:`count_comms` records them.

    The all-to-all that the library issues for a reduce-scatter on gloo (which has none of
    its own) counts as the reduce-scatter it is.
    """
    axes: dict[str, tuple[str, int]] = {}
    for mesh in meshes:
        for axis, size in axis_sizes(mesh).items():
            if size > 1:
                axes[mesh.get_group(axis).group_name] = (axis, size)
    counter = CommCounter()
    for node in graph.graph.nodes:
        if node.target is GLOO_ALL_GATHER:  # the in-place gather of a gloo group
            _, n, group = node.args
            value = node.meta["val"]
            axis = axes[group][0] if group in axes else str(group)  # type: ignore[index]
            size = value.numel() * value.element_size()
            accounting.record("all_gather", axis, n, size, value.dtype, (counter,))  # type: ignore[arg-type]
            continue
        if not _is_c10d(node) or _is_c10d(node, _WAIT):
            continue
        name = node.target._schema.name.split("::")[-1]  # type: ignore[union-attr]
        value = node.args[0].meta["val"]  # type: ignore[union-attr]
        group = node.args[-1]
        axis, n = axes[group] if group in axes else (str(group), _group_size(name, node))
        size = value.numel() * value.element_size()
        kind, buffer = {
            "all_gather_into_tensor": ("all_gather", size * n),
            "reduce_scatter_tensor": ("reduce_scatter", size),
            "all_to_all_single": ("reduce_scatter", size),
            "all_reduce": ("all_reduce", size),
        }.get(name, (name, size))
        accounting.record(kind, axis, n, buffer, value.dtype, (counter,))
    return counter


def _group_size(name: str, node: torch.fx.Node) -> int:
    """The group size a collective node states (for a group of no mesh found in the inputs)."""
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return int(node.args[-2])  # type: ignore[arg-type]
    if name == "all_to_all_single":
        return len(node.args[1])  # type: ignore[arg-type]
    raise ValueError(
        f"ff.jit: the graph's {name} runs over process group {node.args[-1]!r}, which is no "
        f"axis of the meshes of the arguments' Sharded values; pass values on that mesh."
    )


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a seeded op, unless its probability argument
    (``p``, ``dropout_p``) is 0 (dropout of nothing, attention without dropout)."""
    target = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(
        target, "tags", ()
    ):
        return False
    schema = target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name in ("p", "dropout_p"):
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
            if value is None:
                value = arg.default_value
            return value != 0
    return True


def _refuse_random_ops(graph: torch.fx.GraphModule) -> None:
    for node in graph.graph.nodes:
        if _draws(node):
            raise TraceError(
                f"ff.jit: the step draws random numbers ({node.target} at "
                f"{_user_line(node.meta.get('stack_trace', ''))}), e.g. dropout. A compiled "
                f"step cannot replay them from the state's key (and a recomputed unit would "
                f"draw other masks than its forward), so it refuses them. Set the dropout "
                f"probabilities to 0 (config.*dropout*, nn.Dropout(p=0)) or put the model in "
                f"eval mode, or run the step without ff.jit."
            )


def _backend(backend: str, graph: torch.fx.GraphModule, tensors: list[torch.Tensor]) -> Any:
    if backend == "eager":
        return graph
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ._inductor_passes import EarlyMatmuls

    options: dict[str, Any] = {
        # Keep the trace's order: it is the eager step's, with each unit gathered ahead of its
        # use, each packing next to its gather and each wait already moved down to the first
        # use of its result (sink_waits). Inductor's reordering passes each held memory the
        # eager step does not (a 4-layer GPT at width 128, 2 gloo ranks, ff.tensor_peak):
        # - its peak-memory pass moves each collective down to its wait (the prefetch undone);
        # - its compute/communication pass schedules everything that waits on no collective
        #   first: every unit's packing, the backward's regathers included, at the top of
        #   the step (21.5 MiB against the eager step's 19.2);
        # - its locality pass moves each producer down to its consumer: a unit's weight
        #   gradients then come after its input gradients, so the activations they read
        #   stay alive through the unit's whole backward (21.0 MiB).
        "reorder_for_peak_memory": False,
        "reorder_for_compute_comm_overlap": False,
        "reorder_for_locality": False,
        # A whole step inlines long pointwise chains (gradient unpacking, clipping, the
        # optimizer's scalars) into the optimizer's loops; on the CPU that made one kernel
        # slower than all the step's matrix products (a 12 MiB GPT: 1.2-1.4x the eager step).
        # Materializing expressions of more than 4 ops keeps each loop simple (0.98x there,
        # and faster at the smaller widths too).
        "realize_opcount_threshold": 4,
        # A tied head's gradient matmul runs where its inputs are ready (_inductor_passes).
        "post_grad_custom_post_pass": EarlyMatmuls(),
    }
    if any(t.is_cuda for t in tensors):
        # On an H100 with torch 2.11, inductor's loop reordering during fusion asserted on a
        # GPT step's graph (scheduler.reorder_loops_by_dep_pair); without it the step
        # compiled and followed eager. Not seen on the CPU; torch 2.13 not run on a GPU.
        options["loop_ordering_after_fusion"] = False
    # Fake inputs from a mode with a shape environment (static shapes): what inductor's
    # caches key on, so a second run of the same program loads the compiled graph.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = [mode.from_tensor(t, static_shapes=True) for t in tensors]
    with torch._inductor.config.patch(options):
        return compile_fx(graph, fake)


# --------------------------------------------------------------------------- errors


def _user_line(stack: str) -> str:
    """The innermost frame of ``stack`` (a formatted traceback) outside torch and this
    library: where the user's code did it."""
    library = os.path.dirname(os.path.abspath(__file__))
    return _innermost(stack, (library, os.path.dirname(torch.__file__))) or (
        _innermost(stack, ()) or "an unknown place"
    )


def _innermost(stack: str, outside: tuple[str, ...]) -> str | None:
    """The innermost frame of ``stack`` whose file is under none of the ``outside`` folders."""
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File ")]
    for frame in reversed(frames):
        path = frame.split('"')[1] if '"' in frame else ""
        if not path.startswith(outside):
            return frame
    return None


def _frames(error: BaseException) -> Iterator[str]:
    for frame in traceback.extract_tb(error.__traceback__):
        yield f'File "{frame.filename}", line {frame.lineno}, in {frame.name}'


def _trace_error(error: Exception) -> Exception:
    """``error`` raised while tracing, named when it is one a trace cannot take."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    data_dependent = isinstance(error, DataDependentOutputException) or type(error).__name__ in (
        "GuardOnDataDependentSymNode",
        "DataDependentOutputException",
    )
    if not data_dependent:
        return error
    stack = "\n".join(_frames(error))
    where = _user_line(stack)
    reader = _innermost(stack, (os.path.dirname(torch.__file__),))
    if reader is not None and reader != where:  # read inside the library, reached from there
        where = f"{reader}, reached from {where}"
    return TraceError(
        f"ff.jit: the function reads a tensor's value in Python at {where} (.item(), int(t), "
        f"float(t), `if t:` or printing a tensor). A traced step has no values, only shapes, "
        f"so its Python cannot branch on them. Compute with tensors instead (torch.where, "
        f"masking), move that code outside the function you jit, or call it without ff.jit."
    )
