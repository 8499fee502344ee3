"""Randomness as an explicit input, the JAX way: keys, ``fold_in``, and seeded scopes.

A *key* is a small tensor (two 32-bit words in an ``int64[2]``, like JAX's ``uint32[2]``)
that lives in :class:`~functional_fsdp.TrainState` and is saved with it. New keys are
derived with :func:`fold_in`, never by advancing a hidden state, so a key and the integers
folded into it determine every random draw. Model code stays unchanged: torch's dropout
reads the global generator, so :func:`seeded` sets that generator from a key for the
duration of a block and puts the caller's back afterwards.

``train_step`` draws micro-batch ``m`` of step ``s`` on data-parallel rank ``d`` from
``fold_in(fold_in(fold_in(key, s), d), m)``, where ``d`` numbers the data-parallel ranks
row-major over the data axes (model axes, tp, are not folded in: tensor-parallel ranks draw
the same numbers), except on sequence-parallel activations: there the tensor-parallel styles
switch to a second stream with the tp coordinates folded in (:func:`sequence_stream`), so
each tp rank draws its own part. See ``docs/randomness.md`` for the whole contract.

The private half of this module captures and restores generator states, on real processes
(the CPU generator, and the current CUDA device's where CUDA is in use) and on simulated
meshes (each simulated rank's own generator state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from .distributed.axes import _simulation_paused, axis_sizes, coordinate_of, local_coordinate
from .distributed.simulate import is_simulated, simulation_mode

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints that scatters every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _to_key(value: int) -> torch.Tensor:
    with _simulation_paused():  # one plain tensor, also inside a simulation
        return torch.tensor([value >> 32, value & 0xFFFFFFFF], dtype=torch.int64)


def _check_int(value: Any, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
            return int(value)
        raise TypeError(f"{where}: {what} must be an int, got {type(value).__name__} {value!r}.")
    return value


def rng_key(seed: int) -> torch.Tensor:
    """A random key from an integer seed: an ``int64[2]`` tensor on the CPU.

    Args:
        seed: any Python int (taken modulo 2**64).

    Raises:
        TypeError: if ``seed`` is not an int.

    Example:
        >>> import functional_fsdp as ff
        >>> k = ff.rng_key(0)
        >>> k.shape, k.dtype, bool((k == ff.rng_key(0)).all()), bool((k == ff.rng_key(1)).all())
        (torch.Size([2]), torch.int64, True, False)
    """
    return _to_key(_mix(_check_int(seed, "rng_key", "seed") & _MASK))


def key_bits(key: torch.Tensor, where: str = "key") -> int:
    """The 64 bits of ``key`` as a Python int (the same on every simulated rank).

    Raises:
        TypeError: if ``key`` is not an ``int64[2]`` tensor made by :func:`rng_key`.
    """
    if not isinstance(key, torch.Tensor) or key.shape != (2,) or key.dtype != torch.int64:
        got = (
            f"a {str(key.dtype).removeprefix('torch.')} tensor of shape {tuple(key.shape)}"
            if isinstance(key, torch.Tensor)
            else type(key).__name__
        )
        raise TypeError(
            f"{where}: a random key is the int64[2] tensor ff.rng_key(seed) returns, got "
            f"{got}. Make one with ff.rng_key(seed)."
        )
    per_rank = getattr(key, "_local_tensors", None)
    if per_rank is not None:  # a simulated value: every rank holds the same key
        words = {tuple(t.tolist()) for t in per_rank.values()}
        if len(words) != 1:
            raise ValueError(f"{where}: the key differs across simulated ranks: {sorted(words)}.")
        hi, lo = words.pop()
    else:
        with _simulation_paused():
            hi, lo = key.tolist()
    return ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced (:func:`functional_fsdp.jit`): a fake tensor with a
    shape and no values, from which no generator can be seeded."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def fold_in(key: torch.Tensor, data: int) -> torch.Tensor:
    """A new key from ``key`` and an integer (a step, a rank, a micro-batch index).

    Different integers give independent keys; ``key`` itself is not changed. As JAX's
    ``jax.random.fold_in``.

    Example:
        >>> import functional_fsdp as ff
        >>> k = ff.rng_key(0)
        >>> a, b = ff.fold_in(k, 1), ff.fold_in(k, 2)
        >>> bool((a == ff.fold_in(k, 1)).all()), bool((a == b).all())
        (True, False)
    """
    data = _check_int(data, "fold_in", "data")
    return _to_key(_fold(key_bits(key, "fold_in"), data))


def _fold(bits: int, data: int) -> int:
    return _mix(bits ^ _mix(data & _MASK))


def _seed_of(bits: int) -> int:
    return _mix(bits ^ 0x5EED) & ((1 << 63) - 1)


# --------------------------------------------------------------------------- generator states


def _local_mode() -> Any:
    mode = simulation_mode()
    return mode if mode is not None and mode._per_rank_rng_states else None


def _cuda_states() -> dict[int, torch.Tensor]:
    # Guarded: only a process that uses CUDA has a CUDA generator worth keeping.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        return {device: torch.cuda.get_rng_state(device)}
    return {}


def _set_cuda_states(states: dict[int, torch.Tensor]) -> None:
    for device, state in states.items():
        torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def _plain_ops() -> Iterator[None]:
    """Plain tensor ops, also inside ``torch.func`` transforms and simulations (where a copy
    of a generator state would otherwise run once per simulated rank)."""
    with torch._C._DisableFuncTorch(), torch._C._DisableTorchDispatch():
        yield


@dataclass
class _Streams:
    """The two streams of a :func:`seeded` block on a mesh with model (tp) axes: the common
    one (the same on every tp rank) and the sequence one (the tp coordinates folded in).
    One of them is in torch's generators; ``other`` holds the other's state."""

    other: Any  # the inactive stream's generator state (as _get_state gives it)
    sequence: bool  # the sequence stream is the active one


_streams: _Streams | None = None  # the innermost seeded block's, if it has two


def sequence_stream(active: bool) -> None:
    """Draw from the sequence stream (``True``) or the common one (``False``) from now on.

    Called by the tensor-parallel styles in forward where an activation enters the
    sequence-parallel region (a reduce-scatter or scatter along the sequence) and where it
    leaves it (the all-gather at a block's input), so that dropout on a sequence-sharded
    activation draws each tp rank's own part and dropout on a replicated one draws the same
    mask on every tp rank. Outside a :func:`seeded` block on a mesh with model axes there is
    one stream, and this does nothing. Idempotent.
    """
    streams = _streams
    if streams is None or streams.sequence == active:
        return
    mode = _local_mode()
    with _plain_ops():
        current = _get_state(mode)
        _set_state(streams.other, mode)
    streams.other, streams.sequence = current, active


def get_state() -> Any:
    """The generator state random ops read now: CPU (and the current CUDA device's), or on a
    simulated mesh every simulated rank's, and inside a :func:`seeded` block with two
    streams (see :func:`sequence_stream`) the other stream's and which one is active.
    Opaque; give it to :func:`set_state`."""
    mode = _local_mode()  # (before the simulation is paused)
    with _plain_ops():
        generators = _get_state(mode)
    streams = None if _streams is None else (_streams.other, _streams.sequence)
    return generators, streams


def _get_state(mode: Any) -> Any:
    cpu = torch.get_rng_state()
    if mode is None:
        return cpu, _cuda_states(), None
    ranks = {
        r: (c.clone(), {d: s.clone() for d, s in cuda.items()})
        for r, (c, cuda) in mode._per_rank_rng_states.items()
    }
    return cpu, _cuda_states(), ranks


def set_state(state: Any) -> None:
    """Restore a state from :func:`get_state` (both streams, and which one is active)."""
    generators, streams = state
    mode = _local_mode()
    with _plain_ops():
        _set_state(generators, mode)
    if _streams is not None and streams is not None:
        _streams.other, _streams.sequence = streams


def _set_state(state: Any, mode: Any) -> None:
    cpu, cuda, ranks = state
    torch.set_rng_state(cpu)
    _set_cuda_states(cuda)
    if ranks is not None and mode is not None:
        for r, (c, cuda_r) in ranks.items():
            mode._per_rank_rng_states[r] = (c.clone(), {d: s.clone() for d, s in cuda_r.items()})


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Run a block and put the generators back where they were (``torch.random.fork_rng``
    for the CPU, the current CUDA device and simulated ranks)."""
    saved = get_state()
    try:
        yield
    finally:
        set_state(saved)


def _seed_generators(seed: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    with _plain_ops():
        return _seed_generators_plain(seed)


def _seed_generators_plain(seed: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    torch.random.default_generator.manual_seed(seed)  # not torch.manual_seed: simulations patch it
    for device in _cuda_states():
        torch.cuda.default_generators[device].manual_seed(seed)
    return torch.get_rng_state(), _cuda_states()


def data_index(coord: dict[str, int], sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    """The data-parallel index of a mesh coordinate: row-major over ``axes``."""
    index = 0
    for a in axes:
        index = index * sizes[a] + coord[a]
    return index


@contextlib.contextmanager
def seeded(
    key: torch.Tensor, *, mesh: DeviceMesh | None = None, axes: tuple[str, ...] = ()
) -> Iterator[None]:
    """Draw from ``key`` inside the block; the caller's generators come back afterwards.

    Torch's global generators (CPU, and the current CUDA device's where CUDA is in use) are
    seeded from ``key``. With a ``mesh``, each rank first folds in its index over ``axes``
    (row-major; e.g. the data-parallel axes), so ranks that differ on those axes draw
    independent numbers and ranks that differ only on other axes draw the same ones. If the
    mesh has other (model) axes, the block also holds a second, *sequence* stream with the
    rank's index over those axes folded in too, which the tensor-parallel styles switch to
    on sequence-parallel activations (:func:`sequence_stream`). On a simulated mesh every
    simulated rank gets its own generators the same way.

    Args:
        key: from :func:`rng_key` or :func:`fold_in`.
        mesh: the mesh whose coordinates are folded in (``None``: every process the same).
        axes: the mesh axes whose coordinates are folded in.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> with ff.seeded(ff.rng_key(0)):
        ...     a = torch.rand(2)
        >>> with ff.seeded(ff.rng_key(0)):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """
    global _streams
    bits = key_bits(key, "seeded")
    saved, outer = get_state(), _streams
    try:
        mode = _local_mode()
        _streams = None
        if mesh is None:
            states = _seed_generators(_seed_of(bits))
            if mode is not None:
                with _plain_ops():
                    for r in mode._per_rank_rng_states:
                        mode._per_rank_rng_states[r] = (states[0].clone(), dict(states[1]))
        else:
            model_axes = tuple(a for a in axis_sizes(mesh) if a not in axes)
            if model_axes:  # the sequence stream first, then the common one on top
                _seed_mesh(bits, mesh, axes, model_axes, mode)
                with _plain_ops():
                    _streams = _Streams(_get_state(mode), sequence=False)
            _seed_mesh(bits, mesh, axes, None, mode)
        yield
    finally:
        _streams = outer
        set_state(saved)


_SEQUENCE = 0x5E9_0E4CE  # folded in before the model coordinates: the sequence stream


def _seed_mesh(
    bits: int,
    mesh: DeviceMesh,
    axes: tuple[str, ...],
    model_axes: tuple[str, ...] | None,
    mode: Any,
) -> None:
    """Seed each rank's generators from ``bits`` with its index over ``axes`` folded in, and
    (``model_axes`` given: the sequence stream) then its index over ``model_axes``."""
    sizes = axis_sizes(mesh)

    def seed(coord: dict[str, int]) -> int:
        b = _fold(bits, data_index(coord, sizes, axes))
        if model_axes is not None:
            b = _fold(_fold(b, _SEQUENCE), data_index(coord, sizes, model_axes))
        return _seed_of(b)

    if mode is None:
        _seed_generators(seed(local_coordinate(mesh)))
    else:
        for r in sorted(mode._per_rank_rng_states):
            mode._per_rank_rng_states[r] = _seed_generators(seed(coordinate_of(mesh, r)))


# --------------------------------------------------------------------------- global-batch draws

_SHAPE_ONLY = {  # random ops whose draws depend on their first argument's shape alone
    torch.ops.aten.bernoulli.p,
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.uniform_.default,
    torch.ops.aten.normal_.default,
    torch.ops.aten.exponential_.default,
    torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"),  # a keyword in Python
    torch.ops.aten.random_.to,
    torch.ops.aten.rand_like.default,
    torch.ops.aten.randn_like.default,
}


def _draws(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a seeded op draws: attention kernels do only with ``dropout_p > 0``."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
            return bool(value)
    return True


class GlobalBatchDraws(TorchDispatchMode):
    """Draw random tensors for the global batch and keep this rank's rows of them.

    Each random op whose first argument has the batch along dim 0 (dropout's masks, the
    ``*_like`` draws, in-place ``uniform_`` ...) runs on a tensor ``parts`` times as long
    along dim 0, and returns (or writes) rows ``[index * n, (index + 1) * n)``: with the
    same generator state on every rank, the data-parallel ranks together draw exactly what
    one process draws for the whole batch. Other random ops raise.
    """

    def __init__(self, parts: int, index: int) -> None:
        super().__init__()
        self.parts, self.index = parts, index

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        if func not in _SHAPE_ONLY:
            raise NotImplementedError(
                f"train_step(randomness='global_batch'): the random op {func} is not supported "
                f"(only ops whose draws depend on a tensor's shape alone, as dropout's "
                f"bernoulli). Use the default randomness='per_rank'."
            )
        x = args[0]
        if x.ndim == 0:
            raise NotImplementedError(
                "train_step(randomness='global_batch'): a random op on a 0-dim tensor has no "
                "batch dim to split. Use the default randomness='per_rank'."
            )
        n = x.shape[0]
        whole = torch.empty((n * self.parts, *x.shape[1:]), dtype=x.dtype, device=x.device)
        out = func(whole, *args[1:], **kwargs)
        mine = out.narrow(0, self.index * n, n)
        if func._schema.name.endswith("_"):  # in place: write this rank's rows into x
            return x.copy_(mine)
        return mine.contiguous()


@contextlib.contextmanager
def global_batch_draws(mesh: DeviceMesh, axes: tuple[str, ...]) -> Iterator[None]:
    """:class:`GlobalBatchDraws` for this rank's data-parallel index over ``axes``."""
    if is_simulated():
        raise ValueError(
            "train_step(randomness='global_batch') runs on real processes only, not on a "
            "simulated mesh (its ranks share one dispatch). Use randomness='per_rank'."
        )
    sizes = axis_sizes(mesh)
    parts = 1
    for a in axes:
        parts *= sizes[a]
    index = data_index(local_coordinate(mesh), sizes, axes)
    with GlobalBatchDraws(parts, index):
        yield
