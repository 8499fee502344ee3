"""Simulated meshes: N ranks in one process, with real numerics or with shapes only.

Built on ``torch.distributed._local_tensor.LocalTensorMode`` and the fake process group: a
value on the simulated mesh holds one tensor per rank, and the c10d functional collectives
compute exactly what N real processes would, inside ``torch.func.grad`` too. The same user
code runs unchanged under ``torchrun``, where real gloo or NCCL runs are the ground truth.

Two ways to hold a simulation, as JAX users hold a mesh:

* ``with ff.simulated_mesh({"dp": 8}) as mesh:`` ends it with the block;
* ``mesh = ff.simulated_mesh({"dp": 8}, persistent=True)`` keeps it until
  :func:`end_simulation` (or the next persistent mesh), so that it lives across notebook
  cells.

``shapes_only=True`` simulates rank 0 of N on the fake process group with ``meta`` tensors:
no values and no memory, for checking specs, shapes and collective counts at any scale.
"""

from __future__ import annotations

import functools
import math
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .axes import _ENDED, _MeshMarks, checked_axes, coordinate_of
from .axes import check_alive as check_alive

# --------------------------------------------------------------------------- torch's simulation


def _local_tensor_module() -> Any:
    try:
        from torch.distributed import _local_tensor
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            f"simulated meshes need torch.distributed._local_tensor (torch >= 2.10); this is "
            f"torch {torch.__version__}. Upgrade torch, or run the same code on real processes "
            f"with `torchrun --nproc-per-node N` or ff.launch."
        ) from e
    return _local_tensor


def is_simulated() -> bool:
    """True inside :func:`simulated_mesh` (not a ``shapes_only`` one: that runs one rank).

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}):
        ...     ff.is_simulated()
        True
    """
    if not dist.is_available():
        return False
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # pragma: no cover
        return False
    return enabled_local_tensor_mode() is not None


def simulation_mode() -> Any:
    """The running simulation's ``LocalTensorMode`` (torch's), or ``None`` outside one."""
    if not is_simulated():
        return None
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode()


# --------------------------------------------------------------------------- simulations


class _Simulation:
    """One running simulation: its fake process group, its mode and its mesh."""

    def __init__(self, axes: dict[str, int], shapes_only: bool, persistent: bool) -> None:
        self.axes, self.shapes_only, self.persistent = axes, shapes_only, persistent
        self.mode: Any = None
        self.mesh: DeviceMesh | None = None
        self.restore_get_rank: Callable[[], None] | None = None

    def call(self) -> str:
        """How the simulation was asked for, for messages."""
        flags = [f"{k}=True" for k in ("persistent", "shapes_only") if getattr(self, k)]
        return f"ff.simulated_mesh({', '.join([repr(self.axes), *flags])})"

    def start(self) -> DeviceMesh:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        world = math.prod(self.axes.values())
        if self.shapes_only:
            mode: Any = _MetaAnswers()
        else:
            from ._local_mode import SimulationMode

            mode = SimulationMode(world)
        hook = sys.excepthook
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        # torch prefixes tracebacks with "[rank0]:" (once more per process group made): not
        # true of a simulation, whose one process is every rank.
        sys.excepthook = hook
        try:
            # Built before the mode starts: inside it, the mesh's own rank map would become a
            # per-rank tensor, and every later look at the mesh would run once per rank.
            self.mesh = init_device_mesh(
                "meta" if self.shapes_only else "cpu",
                tuple(self.axes.values()),
                mesh_dim_names=tuple(self.axes),
            )
            mode.__enter__()
        except BaseException:
            dist.destroy_process_group()
            raise
        self.mode = mode
        if self.shapes_only:
            _SHAPES_ONLY.mark(self.mesh, True)
        elif world > 1:  # shapes-only runs rank 0 alone, for which 0 is the right answer
            self.restore_get_rank = _guard_get_rank(self.call(), world)
        return self.mesh

    def end(self) -> None:
        if self.mode is not None:
            top = _current_mode(self.mode)
            if top is not self.mode:
                raise RuntimeError(
                    f"cannot end {self.call()}: another mode ({type(top).__name__}) was "
                    f"entered after it and is still active. Leave that mode first (end its "
                    f"`with` block), then call ff.end_simulation()."
                )
            self.mode.__exit__(None, None, None)
            self.mode = None
        if self.restore_get_rank is not None:
            self.restore_get_rank()
            self.restore_get_rank = None
        dist.destroy_process_group()
        if self.mesh is not None:
            _ENDED.mark(self.mesh, self.call())
            _forget_groups(self.mesh, self.call())


def _library_paths() -> tuple[str, ...]:
    """Where installed packages and the standard library live (their code is not the user's)."""
    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)})


def _called_by_library(frame: Any) -> bool:
    """True when ``frame`` runs code of torch, of this library or of an installed package.

    Those ask for the rank to pick a rank-0 printer or a device, where 0 is a fine answer
    for a simulation's one process; the user's own code (a script, a notebook cell, a module
    of theirs) asks it to pick data, where 0 for every rank is silently wrong.
    """
    module = frame.f_globals.get("__name__") or ""
    if module.split(".")[0] in ("torch", "functional_fsdp"):
        return True
    return frame.f_code.co_filename.startswith(_library_paths())


def _guard_get_rank(call: str, world: int) -> Callable[[], None]:
    """Make ``torch.distributed.get_rank()`` refuse the user's code while ``call`` runs.

    On a simulation, torch answers 0 for every rank, and code that picks its share of the data
    with it (``batch.chunk(n)[dist.get_rank()]``) silently trains every rank on rank 0's
    share. Torch's own calls, this library's and installed packages' go through. Returns the
    function that puts torch's ``get_rank`` back.
    """
    original = dist.get_rank

    @functools.wraps(original)
    def get_rank(group: Any = None) -> int:
        if _called_by_library(sys._getframe(1)):
            return original(group)
        raise RuntimeError(
            f"torch.distributed.get_rank() inside {call}: this one process is all {world} "
            f"simulated ranks, so no single rank number is right (torch would answer 0 for "
            f"every rank, and every rank would take rank 0's data). For this rank's share of "
            f"a global batch use ff.local_batch(global_batch, sharded_model) (or "
            f"ff.local_batch(global_batch, mesh)), which is right here and under torchrun; "
            f"ff.rank_values(x) shows a value's per-rank tensors; and code that prints on rank "
            f"0 only can print unconditionally in a simulation."
        )

    dist.get_rank = get_rank

    def restore() -> None:
        if dist.get_rank is get_rank:
            dist.get_rank = original

    return restore


def _current_mode(mode: Any) -> Any:
    """The innermost active mode of ``mode``'s kind (dispatch or function mode)."""
    if isinstance(mode, torch.overrides.TorchFunctionMode):
        from torch.overrides import _get_current_function_mode

        return _get_current_function_mode()
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


class _MetaAnswers(torch.overrides.TorchFunctionMode):
    """Shapes-only simulation: answer data-dependent questions about ``meta`` tensors.

    A ``meta`` tensor has no values, so ``bool(t)`` and ``t.item()`` have no answer; model
    code asks them in checks such as "are there padded or packed sequences"
    (``transformers`` masks). They take the branch of a true condition (``True``, zero), as
    :func:`functional_fsdp.plan` does: those checks hold for a plain batch.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in _DATA_DEPENDENT and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            t = args[0]
            return True if func is torch.Tensor.__bool__ else (0.0 if t.is_floating_point() else 0)
        return func(*args, **(kwargs or {}))


_DATA_DEPENDENT = (torch.Tensor.__bool__, torch.Tensor.item)


def _forget_groups(mesh: DeviceMesh, call: str) -> None:
    """Point an ended mesh at process-group names that never resolve.

    Group names restart with each process group, so a later simulation's groups would
    otherwise answer to the old mesh's names, and its values would silently run there.
    """
    for m in (mesh, *getattr(mesh, "_flatten_mapping", {}).values()):
        names = getattr(m, "_dim_group_names", None)
        if isinstance(names, list):
            m._dim_group_names = [f"{_ENDED_GROUP}{call}" for _ in names]
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


_ENDED_GROUP = "functional_fsdp: group of an ended simulation, "

_ACTIVE: list[_Simulation] = []  # at most one: the default process group is global


_SHAPES_ONLY = _MeshMarks()


def _start(axes: dict[str, int], shapes_only: bool, persistent: bool) -> _Simulation:
    if _ACTIVE:
        running = _ACTIVE[0]
        if not (persistent and running.persistent):
            raise RuntimeError(
                f"{_Simulation(axes, shapes_only, persistent).call()} cannot start while "
                f"{running.call()} is running (one simulation at a time). "
                + (
                    "End it with ff.end_simulation() first, or keep using its mesh."
                    if running.persistent
                    else "Start it after that `with` block ends."
                )
            )
        end_simulation()  # re-running a notebook cell replaces its persistent mesh
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_mesh() needs to create its own (fake) process group, but one already "
            "exists. Use the real mesh (make_mesh) here, or call "
            "torch.distributed.destroy_process_group() first."
        )
    sim = _Simulation(axes, shapes_only, persistent)
    sim.start()
    _ACTIVE.append(sim)
    return sim


def _end(sim: _Simulation) -> None:
    sim.end()
    _ACTIVE.remove(sim)


class SimulatedMeshContext:
    """What ``ff.simulated_mesh(axes)`` returns: a context manager whose block is the simulation.

    It is not a mesh itself. Write ``with ff.simulated_mesh({"dp": 8}) as mesh:`` for a
    simulation that ends with the block, or ``mesh = ff.simulated_mesh({"dp": 8},
    persistent=True)`` for one that lives across notebook cells.

    Example:
        >>> import functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     ff.axis_sizes(mesh)
        {'dp': 2}
    """

    def __init__(self, axes: dict[str, int], shapes_only: bool) -> None:
        self._axes = axes
        self._shapes_only = shapes_only
        self._running: list[_Simulation] = []

    def __enter__(self) -> DeviceMesh:
        sim = _start(self._axes, self._shapes_only, persistent=False)
        self._running.append(sim)
        assert sim.mesh is not None
        return sim.mesh

    def __exit__(self, *exc: object) -> None:
        _end(self._running.pop())

    def __repr__(self) -> str:
        return f"SimulatedMeshContext({self._axes})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"ff.simulated_mesh({self._axes}) is a context manager, not a mesh (it has no "
            f"{name!r}). Write `with ff.simulated_mesh({self._axes}) as mesh:` and use `mesh` "
            f"inside the block, or `mesh = ff.simulated_mesh({self._axes}, persistent=True)` "
            f"for a mesh that lives across notebook cells (end it with ff.end_simulation())."
        )


@overload
def simulated_mesh(
    axes: Mapping[str, int], *, persistent: Literal[False] = False, shapes_only: bool = False
) -> SimulatedMeshContext: ...


@overload
def simulated_mesh(
    axes: Mapping[str, int], *, persistent: Literal[True], shapes_only: bool = False
) -> DeviceMesh: ...


def simulated_mesh(
    axes: Mapping[str, int], *, persistent: bool = False, shapes_only: bool = False
) -> SimulatedMeshContext | DeviceMesh:
    """Simulate a mesh of ``prod(axes.values())`` ranks in this process.

    In a simulation every tensor that differs between ranks is a ``LocalTensor`` holding
    one value per rank, and collectives run for all ranks at once. Use :func:`rank_values`
    to look at the per-rank values. A process group must not already exist.

    Args:
        axes: axis name to size, major to minor, e.g. ``{"dp": 2, "tp": 4}``.
        persistent: start the simulation now and return its mesh; it lasts until
            :func:`end_simulation` or the next ``persistent=True`` call (which replaces it,
            so a notebook cell can be run again). Without it, the result is a context
            manager: ``with ff.simulated_mesh(axes) as mesh:``.
        shapes_only: simulate rank 0 of the mesh with ``meta`` tensors and the fake process
            group: nothing is computed and no memory is used, but specs, shapes, the plan and
            every collective (``ff.count_comms``) are those of a real run. ``shard`` gives
            ``meta`` blocks; pass inputs on the ``meta`` device too.

    Returns:
        A context manager yielding the ``DeviceMesh``, or with ``persistent=True`` the
        ``DeviceMesh`` itself.

    Raises:
        TypeError: if ``axes`` is not a mapping of string names to int sizes.
        ValueError: if there is no axis or a size is below 1.
        RuntimeError: if another simulation or a real process group is running.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 4}) as mesh:
        ...     x = ff.shard(torch.arange(10.0), mesh, ff.P("dp"))
        ...     [tuple(t.tolist()) for t in ff.rank_values(x.local)]
        [(0.0, 1.0, 2.0), (3.0, 4.0, 5.0), (6.0, 7.0, 8.0), (9.0, 0.0, 0.0)]
        >>> mesh = ff.simulated_mesh({"dp": 2}, persistent=True)  # lives across cells
        >>> ff.rank_values(ff.shard(torch.arange(4.0), mesh, ff.P("dp")).local)[1].tolist()
        [2.0, 3.0]
        >>> ff.end_simulation()
    """
    checked = checked_axes(axes, "simulated_mesh", example_size="8")
    _local_tensor_module()
    if persistent:
        mesh = _start(checked, shapes_only, persistent=True).mesh
        assert mesh is not None
        return mesh
    return SimulatedMeshContext(checked, shapes_only)


def end_simulation() -> None:
    """End the running persistent simulation (``simulated_mesh(..., persistent=True)``).

    Values made on its mesh cannot be used afterwards (they raise an error saying so). Does
    nothing when no persistent simulation runs.

    Example:
        >>> import functional_fsdp as ff
        >>> mesh = ff.simulated_mesh({"dp": 2}, persistent=True)
        >>> ff.end_simulation()
        >>> ff.is_simulated()
        False
    """
    for sim in list(_ACTIVE):
        if sim.persistent:
            _end(sim)


def is_shapes_only(mesh: DeviceMesh) -> bool:
    """True for the mesh of a ``simulated_mesh(..., shapes_only=True)``."""
    return bool(_SHAPES_ONLY.get(mesh))


# --------------------------------------------------------------------------- per-rank values


def per_coordinate(mesh: DeviceMesh, fn: Callable[[dict[str, int]], torch.Tensor]) -> torch.Tensor:
    """Build this rank's tensor from its mesh coordinate: ``fn({"dp": i, ...})``.

    On real processes it calls ``fn`` once with this rank's coordinate; on a simulated mesh it
    calls it for every rank and returns a ``LocalTensor``.
    """
    if is_simulated():
        lt = _local_tensor_module()
        # Build the per-rank tensor outside any torch.func transform: one made inside it is
        # not a valid input to later ops (it holds the transform's wrappers per rank).
        with torch._C._DisableFuncTorch():
            try:
                return lt.rank_map(lambda r: fn(coordinate_of(mesh, r)))
            except ValueError:  # a rank outside the mesh: perhaps its simulation has ended
                check_alive(mesh, "a per-rank value")
                raise
    try:
        rank = dist.get_rank()
    except ValueError:  # no process group: perhaps the mesh's simulation has ended
        check_alive(mesh, "a per-rank value")
        raise
    return fn(coordinate_of(mesh, rank))


def on_rank(t: Any, rank: int) -> Any:
    """The value ``t`` has on ``rank``: itself unless it is a simulated per-rank tensor."""
    local_tensors = getattr(t, "_local_tensors", None)
    return local_tensors[rank] if local_tensors is not None else t


def check_made_outside(
    named: Iterable[tuple[str, torch.Tensor]], mesh: DeviceMesh, where: str, what: str
) -> None:
    """Refuse tensors that hold one value per rank of another simulation.

    A tensor created while a simulation runs (a model built after
    ``ff.simulated_mesh(..., persistent=True)``) holds one tensor per simulated rank and
    belongs to that simulation; another simulation of a different size cannot run it. Tensors
    made outside any simulation are plain and every simulation (and real process) can use them.

    Example:
        >>> import torch
        >>> with simulated_mesh({"dp": 2}) as mesh:
        ...     check_made_outside([("w", torch.zeros(2))], mesh, "ff.fsdp", "parameter")
    """
    world = math.prod(int(s) for s in mesh.shape)
    for name, t in named:
        parts = getattr(t, "_local_tensors", None)
        if parts is None or len(parts) == world:
            continue
        raise ValueError(
            f"{where}: {what} {name!r} (shape {tuple(t.shape)}) holds one tensor per rank of "
            f"a {len(parts)}-rank simulation: it was created while an earlier "
            f"ff.simulated_mesh ran, and cannot run on this {world}-rank mesh. Build the model "
            f"before the simulation starts (outside ff.simulated_mesh: `model = ...` above "
            f"`mesh = ff.simulated_mesh(..., persistent=True)`); tensors made outside any "
            f"simulation are plain, and every simulation and real process can use them."
        )


def rank_values(t: torch.Tensor) -> list[torch.Tensor]:
    """The per-rank values of a tensor on a simulated mesh, in rank order.

    Outside a simulation (or for a value that is the same on every rank) it returns ``[t]``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     x = ff.shard(torch.tensor([1.0, 2.0]), mesh, ff.P("dp")).local
        ...     [t.tolist() for t in ff.rank_values(x)]
        [[1.0], [2.0]]
    """
    local_tensors = getattr(t, "_local_tensors", None)
    if local_tensors is None:
        return [t]
    return [local_tensors[r] for r in sorted(local_tensors)]
