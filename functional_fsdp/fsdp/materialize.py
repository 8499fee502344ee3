"""Deferred initialisation: sharded parameters for a module built on the meta device.

``init_sharded(sm)`` creates the parameters of ``sm.module`` (built under
``torch.device("meta")``) one unit at a time: it materialises the unit's tensors on a private
copy of the module, runs the modules' initialisation, keeps this rank's blocks and frees the
unit before the next one. No rank ever holds more than one unit's full parameters (plus its
own shards).

The values are those eager construction would have produced with the same seed, bitwise, on
any mesh. Eager construction initialises at the end of each module's ``__init__``, children
before parents, and draws from one random stream; this module replays that sequence of
*init steps* (a module's ``reset_parameters()``, a Hugging Face model's ``post_init``, the
``init_fn`` passes) in two sweeps:

1. a dry sweep in eager order, one unit materialised at a time, records the generator state
   before every step (and which tensors each step writes);
2. a sweep unit by unit sets the generator to the recorded state before each of the unit's
   steps, then shards the unit and frees it.

Every rank runs both sweeps in full with the same seed, so the stream is consumed identically
everywhere and the result never depends on the mesh. Afterwards the generator is left where
eager construction leaves it.

Memory: each sweep holds one unit's full tensors at a time (the dry sweep frees a unit before
materialising the next), and the replay cuts each tensor's block as soon as its unit is done
and drops the full tensor, so the peak per rank is the shards so far plus the largest unit.
The second sweep costs compute (about twice an eager construction's), not memory.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import swap_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from .._partition import mark_frozen
from ..distributed import agreement
from ..distributed.axes import _simulation_paused, axis_sizes
from ..distributed.simulate import is_simulated
from ..resharding import shard
from ..sharded import Sharded
from ..spec import P, format_mesh

InitFn = Callable[[nn.Module], Any]


class Sharding(Protocol):
    """What :func:`init_sharded` reads of a module's sharding: an :class:`FSDP
    <functional_fsdp.FSDP>` description. Named by what it needs, so that this module imports
    nothing of ``fsdp/api.py``, which uses it for ``FSDP.shard()`` of a meta module."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def mesh(self) -> DeviceMesh: ...

    @property
    def units(self) -> tuple[str, ...]: ...

    @property
    def trainable(self) -> frozenset[str]: ...

    def param_specs(self) -> dict[str, P]: ...


# --------------------------------------------------------------------------- init steps


@dataclass(frozen=True)
class _Step:
    """One call eager construction makes: ``run(modules)`` on the private copy's modules."""

    path: str  # the module it initialises (canonical path)
    what: str  # for error messages, e.g. "Linear.reset_parameters()"
    run: Callable[[dict[str, nn.Module]], None]


def _own_reset(m: nn.Module) -> Callable[[nn.Module], Any] | None:
    """The method torch modules call at the end of ``__init__`` to fill their tensors."""
    if isinstance(m, nn.MultiheadAttention):
        return type(m)._reset_parameters
    return getattr(type(m), "reset_parameters", None)


def _hf_pretrained(m: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(m, transformers.PreTrainedModel)


def _apply_order(path: str, m: nn.Module, canon: dict[int, str]) -> Iterator[tuple[str, nn.Module]]:
    """``nn.Module.apply``'s visiting order: children (recursively) before the module."""
    for child in m.children():
        yield from _apply_order(canon[id(child)], child, canon)
    yield path, m


def _hf_post_init(path: str, m: nn.Module, canon: dict[int, str]) -> Iterator[_Step]:
    """``PreTrainedModel.initialize_weights`` (``smart_apply``): each module is initialised by
    the ``_initialize_weights`` of the innermost pretrained model around it."""
    custom = bool(m.is_custom_code())  # type: ignore[operator]

    def visit(p: str, mod: nn.Module, owner: str) -> Iterator[_Step]:
        for child in mod.children():
            cp = canon[id(child)]
            yield from visit(cp, child, cp if _hf_pretrained(child) else owner)

        def run(modules: dict[str, nn.Module], p: str = p, owner: str = owner) -> None:
            from transformers.initialization import guard_torch_init_functions

            with guard_torch_init_functions():
                modules[owner]._initialize_weights(modules[p], custom)  # type: ignore[operator]

        yield _Step(p, f"{type(m).__name__}._initialize_weights({type(mod).__name__})", run)

    yield from visit(path, m, path)


def init_steps(module: nn.Module, init_fn: InitFn | Sequence[InitFn] | None = None) -> list[_Step]:
    """The initialisation calls eager construction of ``module`` makes, in order.

    At the end of each module's ``__init__`` (children before parents): its
    ``reset_parameters()``, and for a Hugging Face ``PreTrainedModel`` its ``post_init``
    weight initialisation. Then each ``init_fn`` pass, in ``nn.Module.apply`` order.
    """
    canon: dict[int, str] = {}
    for p, m in module.named_modules():
        canon.setdefault(id(m), p)
    steps: list[_Step] = []
    done: set[int] = set()

    def construct(path: str, m: nn.Module) -> None:
        if id(m) in done:  # a module registered twice was constructed once
            return
        done.add(id(m))
        for child in m.children():
            construct(canon[id(child)], child)
        reset = _own_reset(m)
        if reset is not None:
            steps.append(
                _Step(
                    path,
                    f"{type(m).__name__}.{reset.__name__}()",
                    lambda ms, p=path, r=reset: r(ms[p]),
                )
            )
        if _hf_pretrained(m):
            steps.extend(_hf_post_init(path, m, canon))

    construct("", module)
    passes = [] if init_fn is None else [init_fn] if callable(init_fn) else list(init_fn)
    for fn in passes:
        name = getattr(fn, "__qualname__", repr(fn))
        for path, m in _apply_order("", module, canon):
            steps.append(
                _Step(
                    path, f"init_fn {name}({type(m).__name__})", lambda ms, p=path, f=fn: f(ms[p])
                )
            )
    return steps


# --------------------------------------------------------------------------- the private copy


def _unit_of(path: str, units: Sequence[str]) -> str:
    best = ""
    for u in units:
        if (path == u or path.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


@dataclass
class _Tensor:
    """A parameter or buffer of the private copy, under its first name."""

    key: str
    kind: str  # "parameter" or "buffer"
    locations: list[tuple[nn.Module, str, str]]  # (module, attribute, dotted name)
    units: set[str]
    source: torch.Tensor  # the user's tensor (meta, or a real value to copy)
    value: torch.Tensor | None = None  # the materialised tensor while live
    discard: bool = False  # an HF tied alias, untied for init and dropped afterwards

    @property
    def current(self) -> torch.Tensor:
        module, attr, _ = self.locations[0]
        return getattr(module, attr)


class _PrivateCopy:
    """A deep copy of the module whose tensors stay on meta until a unit needs them."""

    def __init__(self, module: nn.Module, units: Sequence[str], device: torch.device) -> None:
        self.device = device
        memo: dict[int, Any] = {}
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type != "meta":  # never copy real data: a meta stand-in, filled on demand
                stand = torch.empty_like(t, device="meta")
                if isinstance(t, nn.Parameter):
                    stand = nn.Parameter(stand, requires_grad=t.requires_grad)
                stand.__dict__.update(t.__dict__)
                memo[id(t)] = stand
        self.root = copy.deepcopy(module, memo)
        self.modules = dict(self.root.named_modules())
        user = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self.source_of: dict[str, str] = {}
        for m in [module, *(x for _, x in module.named_modules() if x is not module)]:
            if _hf_pretrained(m):
                self._untie_hf(m, module)
        self.tensors: dict[str, _Tensor] = {}  # by first name
        self.at: dict[str, _Tensor] = {}  # by every name
        by_id: dict[int, _Tensor] = {}
        named = [
            *(("parameter", n, t) for n, t in self.root.named_parameters(remove_duplicate=False)),
            *(("buffer", n, t) for n, t in self.root.named_buffers(remove_duplicate=False)),
        ]
        for kind, name, t in named:
            mpath, _, attr = name.rpartition(".")
            entry = by_id.get(id(t))
            if entry is None:
                src = user.get(name)
                if src is None or self.source_of.get(name) is not None:
                    src = torch.empty_like(t, device="meta")  # an untied HF alias
                entry = by_id[id(t)] = self.tensors[name] = _Tensor(name, kind, [], set(), src)
                entry.discard = name in self.source_of
            entry.locations.append((self.modules[mpath], attr, name))
            self.at[name] = entry
            entry.units.add(_unit_of(mpath, units))

    def _untie_hf(self, user_model: nn.Module, user_root: nn.Module) -> None:
        """HF ties weights after initialising them: give each tied alias its own tensor here."""
        prefix = next(p for p, m in user_root.named_modules() if m is user_model)
        prefix = prefix + "." if prefix else ""
        for target, src in (getattr(user_model, "all_tied_weights_keys", None) or {}).items():
            t_name, s_name = prefix + target, prefix + src
            mpath, _, attr = t_name.rpartition(".")
            owner = self.modules.get(mpath)
            current = getattr(owner, attr, None) if owner is not None else None
            if not isinstance(current, nn.Parameter) or t_name in self.source_of:
                continue
            fresh = nn.Parameter(torch.empty_like(current, device="meta"), current.requires_grad)
            owner._parameters[attr] = fresh  # type: ignore[union-attr]
            self.source_of[t_name] = s_name

    def materialise(self, entry: _Tensor) -> None:
        if entry.value is not None:
            return
        src = entry.source
        if src.device.type == "meta":
            value = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        else:
            value = src.detach().to(self.device, copy=True)
        current = entry.current
        real: torch.Tensor = (
            nn.Parameter(value, current.requires_grad)
            if isinstance(current, nn.Parameter)
            else value
        )
        real.__dict__.update(current.__dict__)  # swap_tensors swaps __dict__ too
        swap_tensors(current, real)  # every tied location sees it
        entry.value = value

    def free(self, entry: _Tensor) -> torch.Tensor:
        """Put the tensor back on meta; returns its value (a tensor the copy no longer holds)."""
        current = entry.current
        value = current.detach()
        stand: torch.Tensor = torch.empty_like(current, device="meta")
        if isinstance(current, nn.Parameter):
            stand = nn.Parameter(stand, current.requires_grad)
        stand.__dict__.update(current.__dict__)
        swap_tensors(current, stand)
        entry.value = None
        return value

    def storage_keys(self, unit_entries: Sequence[_Tensor]) -> dict[int, _Tensor]:
        return {
            e.current.untyped_storage().data_ptr(): e
            for e in unit_entries
            if e.value is not None and e.current.numel()
        }


class _Writes(TorchDispatchMode):
    """Records the storages that ops write; refuses writes to meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()
        self.meta_write: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(v, torch.Tensor):
                if v.device.type == "meta":
                    self.meta_write = f"{func} on a meta tensor of shape {tuple(v.shape)}"
                    return v
                self.storages.add(v.untyped_storage().data_ptr())
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- generator state


def _rng_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def _set_rng_state(state: tuple[torch.Tensor, ...], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _check_generators_agree(mesh: DeviceMesh, state: tuple[torch.Tensor, ...]) -> None:
    """Raise unless every rank starts an initialisation that draws random numbers from the
    same generator state: each rank keeps its own blocks, so ranks seeded differently would
    put together a model that no seed gives (and replicated values that differ by rank)."""
    if is_simulated() or mesh.size() == 1 or torch.compiler.is_compiling():
        return  # one process: one generator
    named = [(f"generator {i}", t, "") for i, t in enumerate(state)]
    if agreement.differences(mesh, named, "init_sharded") is None:
        return
    raise ValueError(
        f"init_sharded: the ranks of {format_mesh(axis_sizes(mesh))} start from different "
        f"random-number generator states, and this model's initialisation draws random "
        f"numbers: each rank would keep its blocks of a different model (and replicated "
        f"values would differ between ranks). Seed every rank the same before calling it: "
        f"torch.manual_seed(seed), one seed on every rank."
    )


def _same_state(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@contextlib.contextmanager
def _real_tensors() -> Iterator[None]:
    """On a simulated mesh, build plain tensors (one value, drawn from the global generator)."""
    if not is_simulated():
        yield
        return
    with _simulation_paused():
        yield


# --------------------------------------------------------------------------- the two sweeps


@dataclass
class _Sweep:
    copy: _PrivateCopy
    steps: list[_Step]
    units: Sequence[str]
    states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    wrote: list[set[str]] = field(default_factory=list)  # per step: keys it wrote

    def entries(self, unit: str) -> list[_Tensor]:
        return [e for e in self.copy.tensors.values() if unit in e.units]

    def run_step(self, i: int, live: Sequence[_Tensor]) -> set[str]:
        step = self.steps[i]
        before = {id(e): (e.current, e.current.untyped_storage().data_ptr()) for e in live}
        keys = self.copy.storage_keys(live)
        writes = _Writes()
        with writes, torch.no_grad():
            step.run(self.copy.modules)
        if writes.meta_write is not None:
            raise ValueError(
                f"init_sharded: {step.what} at module {step.path!r} wrote to a tensor of another "
                f"unit ({writes.meta_write}). Initialisation is done one unit at a time, so a "
                f"module's init may only write its own parameters and buffers and those of its "
                f"submodules in the same unit (unit: {_unit_of(step.path, self.units)!r}). Move "
                f"that init into the submodule's reset_parameters(), or pass an init_fn that "
                f"initialises each module's own tensors (recurse=False)."
            )
        wrote = {keys[s].key for s in writes.storages if s in keys}
        for e in live:
            obj, ptr = before[id(e)]
            now = e.current
            if now is not obj or now.untyped_storage().data_ptr() != ptr:  # replaced
                wrote.add(e.key)
        return wrote

    def dry(self) -> None:
        """Eager order, one unit live at a time: record states and writes."""
        live_unit: str | None = None
        live: list[_Tensor] = []
        for i, step in enumerate(self.steps):
            unit = _unit_of(step.path, self.units)
            if unit != live_unit:
                for e in live:
                    self.copy.free(e)
                live_unit, live = unit, self.entries(unit)
                for e in live:
                    self.copy.materialise(e)
            self.states.append(_rng_state(self.copy.device))
            self.wrote.append(self.run_step(i, live))
        for e in live:
            self.copy.free(e)
        self.states.append(_rng_state(self.copy.device))


def _check_initialised(sweep: _Sweep, module: nn.Module) -> None:
    written = set().union(*sweep.wrote) if sweep.wrote else set()
    for key, e in sweep.copy.tensors.items():
        if e.discard or key in written or e.source.device.type != "meta":
            continue
        mpath, _, attr = key.rpartition(".")
        owner = sweep.copy.modules[mpath]
        kind = type(owner).__name__
        what = (
            f"{kind} has no reset_parameters()"
            if _own_reset(owner) is None
            else f"{kind}.reset_parameters() does not write it"
        )
        raise ValueError(
            f"init_sharded: {e.kind} {key!r} (shape {tuple(e.source.shape)}, "
            f"{e.source.dtype}) of {type(module).__name__} is on the meta device and nothing "
            f"initialises it: {what} and no init_fn wrote it. "
            + _init_advice(module, mpath, owner, attr, e.kind)
        )


def _writes(method: Any, attr: str, target: str) -> bool:
    """Whether ``method``'s source assigns ``{target}.{attr}`` (or registers it, or writes
    it in place)."""
    try:
        src = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    a = re.escape(attr)
    return bool(
        re.search(
            rf"{target}\.{a}\s*=(?!=)|{target}\.register_buffer\(\s*['\"]{a}['\"]"
            rf"|{target}\.{a}\.\w+_\(|\w+_\({target}\.{a}\b",
            src,
        )
    )


def _no_arguments(method: Any) -> bool:
    """Whether an unbound ``method`` can be called with ``self`` alone."""
    try:
        params = list(inspect.signature(method).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in params
    )


def _init_advice(module: nn.Module, path: str, owner: nn.Module, attr: str, kind: str) -> str:
    """How to initialise ``owner.attr``: a call of the model's own initialisation code that
    writes it (a method of the owner, or the root's ``_init_weights(module)``), or, when the
    model has none, where to put that code. Never a placeholder value."""
    cls = type(owner).__name__
    own = [
        name
        for klass in type(owner).__mro__
        if klass not in (nn.Module, object) and issubclass(klass, nn.Module)
        for name, fn in vars(klass).items()
        if callable(fn)
        and name not in ("__init__", "forward")
        and _no_arguments(fn)
        and _writes(fn, attr, "self")
    ]
    if own:
        name = own[0]
        return (
            f"{cls}.{name}() writes it: call it as the initialisation, "
            f"init_fn=lambda m: m.{name}() if isinstance(m, {cls}) else None."
        )
    root = getattr(type(module), "_init_weights", None)
    if callable(root) and not _hf_pretrained(module):
        try:
            target = list(inspect.signature(root).parameters)[1]
        except (TypeError, ValueError, IndexError):
            target = None
        if target is not None and _writes(root, attr, re.escape(target)):
            return (
                f"{type(module).__name__}._init_weights({target}) writes it: pass "
                f"init_fn=model._init_weights."
            )
    where = f"{path!r} ({cls})" if path else cls
    if kind == "buffer":
        return (
            f"Its value is computed when {cls} is constructed, and construction on the meta "
            f"device computed nothing. Put that computation in a {cls}.reset_parameters() "
            f"(init_sharded calls it for {where}, as torch does for its own layers), or build "
            f"{cls} on a real device inside the meta model (its buffer is then copied as it "
            f"is)."
        )
    return (
        f"Give {cls} a reset_parameters() that fills its own tensors as its __init__ does, "
        f"or pass init_fn=fn where fn(module) calls the model's own initialisation of {where}."
    )


def _check_tie_order(sweep: _Sweep, order: list[str]) -> None:
    """A tensor shared by several units must be written unit by unit in replay order."""
    rank = {u: i for i, u in enumerate(order)}
    last: dict[str, int] = {}
    for step, keys in zip(sweep.steps, sweep.wrote):
        r = rank[_unit_of(step.path, sweep.units)]
        for k in keys:
            if len(sweep.copy.tensors[k].units) > 1 and r < last.get(k, -1):
                raise ValueError(
                    f"init_sharded: the tied tensor {k!r} is shared by units "
                    f"{sorted(sweep.copy.tensors[k].units)} and initialised from them in "
                    f"alternation ({step.what} at {step.path!r} comes after a later unit's "
                    f"init), so it cannot be initialised one unit at a time. Put the modules "
                    f"sharing it in one unit (units=...)."
                )
            last[k] = max(last.get(k, -1), r)


def init_sharded(
    sm: Sharding,
    *,
    init_fn: InitFn | Sequence[InitFn] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, Sharded], dict[str, torch.Tensor]]:
    """Create the sharded parameters (and the buffers) of a module built on the meta device.

    One unit at a time, every rank materialises the unit's full tensors on a private copy of
    ``sm.module`` (the module itself is never touched), initialises them, keeps its own blocks
    (``sm.param_specs()``) and frees the unit. Peak memory per rank is about the shards plus
    the largest unit.

    The values equal, bitwise, the parameters of the same model built eagerly with the same
    seed, on every mesh: the initialisation eager construction runs is replayed in its order
    and with its generator states (children before parents, as each ``__init__`` ends):

    * every module's own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, norms,
      ``nn.MultiheadAttention``'s ``_reset_parameters()``, or a custom module's);
    * for a Hugging Face ``PreTrainedModel``, its ``post_init`` weight initialisation
      (``_init_weights`` over its modules, ``_is_hf_initialized`` flags honoured) and its
      weight tying afterwards (a tied alias's own draws are discarded, as in eager
      construction), so ``LlamaForCausalLM(config)`` and the like need no ``init_fn``;
    * then ``init_fn``: what the model's ``__init__`` applies at its end with
      ``self.apply(fn)``; a sequence runs as several such passes. ``functional_fsdp.models.GPT``
      ends with ``self.apply(self._init)``, so pass ``init_fn=GPT._init``.

    So plain torch models and HF models give eager values with no ``init_fn``; a model whose
    ``__init__`` draws random numbers in another way needs an ``init_fn`` that does the same.
    Generator states are replayed per step, so the generator is left where eager
    construction leaves it (on a simulated mesh, draws come from the process's generator).
    Every rank runs the whole initialisation twice (about twice an eager construction's
    compute, but one unit's memory at a time), which is what makes the values independent of
    the mesh. Init code may write a module's own tensors and those of its submodules in the
    same unit; writing another unit's tensor raises.

    Buffers come back full (never sharded): persistent ones such as running statistics and
    non-persistent ones computed in ``__init__`` (an HF rotary ``inv_freq`` is recomputed by
    ``_init_weights``). A buffer that is on meta and that no step writes raises, naming it.

    Args:
        sm: the module's sharding (``ff.fsdp(meta_module, mesh, ...)``).
        init_fn: ``fn(module)`` pass(es) run after construction, in ``nn.Module.apply`` order.
        device: where to materialise (default: the mesh's device, the current CUDA device on
            a CUDA mesh).

    Returns:
        ``(params, buffers)``: ``{name: Sharded}`` exactly as ``sm.shard()`` would give for
        the eagerly built module (tied parameters once, under their first name), and
        ``{name: tensor}`` for every buffer, for ``sm.apply(params, ..., buffers=buffers)``.

    Raises:
        ValueError: a tensor on meta that nothing initialises (a module with no
            ``reset_parameters()`` and no ``init_fn``), init code writing another unit's
            tensor, or init code whose random draws differ between the two sweeps.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> from functional_fsdp.fsdp.materialize import init_sharded
        >>> _ = torch.manual_seed(0)
        >>> eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> _ = torch.manual_seed(0)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> with ff.simulated_mesh({"dp": 2}) as mesh:
        ...     params, buffers = init_sharded(ff.fsdp(model, mesh))
        ...     torch.equal(ff.rank_values(ff.gather(params)["0.weight"])[0], eager[0].weight)
        True
    """
    module = sm.module
    if device is None:
        kind = sm.mesh.device_type
        device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else kind
    device = torch.device(device)
    steps = init_steps(module, init_fn)
    specs = sm.param_specs()
    with _real_tensors():
        start = _rng_state(device)
        dry = _Sweep(_PrivateCopy(module, sm.units, device), steps, sm.units)
        try:
            dry.dry()
        finally:
            _set_rng_state(start, device)
        _check_initialised(dry, module)
        if dry.states and not _same_state(start, dry.states[-1]):
            _check_generators_agree(sm.mesh, start)
        order = list(dict.fromkeys([_unit_of(s.path, sm.units) for s in steps]))
        order += [u for u in ["", *sm.units] if u not in order]
        _check_tie_order(dry, order)
        # The replay: a fresh copy (HF marks modules initialised), one unit at a time.
        replay = _Sweep(_PrivateCopy(module, sm.units, device), steps, sm.units)
    private = replay.copy
    wanted = {private.at[private.source_of.get(k, k)].key: k for k in specs}
    remaining = {k: set(e.units) for k, e in private.tensors.items()}
    by_unit: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        by_unit.setdefault(_unit_of(s.path, sm.units), []).append(i)
    params: dict[str, Sharded] = {}
    buffers: dict[str, torch.Tensor] = {}
    try:
        for unit in order:
            done: list[tuple[str, torch.Tensor]] = []
            with _real_tensors():
                live = replay.entries(unit)
                for e in live:
                    private.materialise(e)
                for i in by_unit.get(unit, []):
                    _set_rng_state(dry.states[i], device)
                    replay.run_step(i, live)
                    if not _same_state(_rng_state(device), dry.states[i + 1]):
                        raise ValueError(
                            f"init_sharded: {steps[i].what} at module {steps[i].path!r} drew "
                            f"different random numbers in its two runs; its draws must depend "
                            f"only on shapes (not on values or on state outside the module)."
                        )
                for e in live:
                    remaining[e.key].discard(unit)
                    if remaining[e.key]:
                        continue  # tied with a unit still to come: stays live
                    value = private.free(e)
                    if e.kind == "buffer":
                        buffers[e.key] = value
                    elif e.key in wanted:
                        done.append((wanted[e.key], value))
                    del value
            # One tensor at a time: its block is cut and the full tensor dropped before the
            # next, so the unit's full tensors and its new shards never all coexist.
            while done:
                name, value = done.pop()
                params[name] = shard(value, sm.mesh, specs[name], check=False)
                del value
    finally:
        with _real_tensors():
            _set_rng_state(dry.states[-1], device)
    names = [n for n, _ in module.named_buffers()]
    return mark_frozen({k: params[k] for k in specs}, sm), {n: buffers[n] for n in names}
