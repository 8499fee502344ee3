"""The catalogue of bad inputs: each case, the error it raises, and the wording it must hold.

One list serves three uses: ``tests/test_catalogue.py`` runs every case in-process (on a
simulated 2-rank mesh, or without a process group for checkpoints), :func:`run_real` runs
the cases marked ``real`` on 2 gloo processes (the same code, real collectives), and
``python -m tests._catalogue_workers`` prints the table for the docs.

A case's ``match`` is a list of fragments that must appear in the message, in order: what is
wrong (key path, shape, spec, mesh) and how to fix it.

The bad inputs found by issue 23's probes are cases here: a value that differs between
ranks (``shard_differs_between_ranks``), global shapes that differ between ranks
(``gather_shapes_differ_between_ranks``, ``reshard_shapes_differ_between_ranks``) and a
unit type that matches nothing (``units_type_matches_nothing``). Its fourth, a torchrun
restart of a gloo group without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, is not here on
purpose: it was fixed, not refused, so there is no error and no wording to pin. A case
would only show that nothing is raised; ``tests/test_reliability.py::
test_torchrun_restart_of_a_gloo_group_needs_no_environment_variable`` runs the real
``torchrun --max-restarts=1`` job instead and checks that the restarted attempt forms its
group and runs a collective.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import functional_fsdp as ff
from functional_fsdp.checkpoint import CheckpointError
from functional_fsdp.train import DonatedStateError

from ._reliability_workers import _unprivileged

P = ff.P


# --------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Ctx:
    """Where a case runs: a ``{"dp": 2}`` mesh (simulated or real, ``None`` for checkpoint
    cases in-process) and a directory that every rank sees."""

    mesh: DeviceMesh | None
    tmp: Path
    real: bool

    def barrier(self) -> None:
        if self.real:
            dist.barrier()

    def on_rank0(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on one process (file setup), then wait for it on every rank."""
        if not self.real or dist.get_rank() == 0:
            fn()
        self.barrier()

    def tree(self, **shapes: tuple[int, ...]) -> dict[str, Any]:
        """Deterministic tensors of these shapes; ``Sharded`` over dp on a real mesh."""
        gen = torch.Generator().manual_seed(0)
        tree = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        return ff.shard(tree, self.mesh, P("dp")) if self.real else tree

    def reversed_mesh(self) -> DeviceMesh:
        """A mesh of the same sizes with the ranks in the other order."""
        return DeviceMesh("cpu", torch.tensor([1, 0]), mesh_dim_names=("dp",))


@dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
        id: a short name (the test id).
        input: the bad input, as the table shows it.
        error: the exception type it must raise.
        match: fragments the message must contain, in this order.
        run: ``run(ctx)`` makes the call that must raise.
        where: ``"mesh"`` runs on a simulated ``{"dp": 2}`` mesh in-process; ``"plain"``
            without a process group (checkpoints); ``"real"`` only on real processes (ranks
            that hold different things: a simulation runs one program for every rank).
        real: also run on 2 real gloo processes.
        real_match: the fragments on real processes, where they differ from ``match``.
    """

    id: str
    input: str
    error: type[BaseException]
    match: tuple[str, ...]
    run: Callable[[Ctx], Any]
    where: str = "mesh"
    real: bool = False
    real_match: tuple[str, ...] | None = None

    @property
    def pattern(self) -> str:
        return ".*".join(re.escape(m) for m in self.match)

    @property
    def real_pattern(self) -> str:
        return ".*".join(re.escape(m) for m in (self.real_match or self.match))


def outcome(case: Case, ctx: Ctx) -> tuple[str, str, bool]:
    """``(exception type name, message, isinstance of case.error)``; ``("none", ...)`` if the
    call returned."""
    try:
        got = case.run(ctx)
    except Exception as e:
        return type(e).__name__, str(e), isinstance(e, case.error)
    return "none", f"returned {got!r:.200}", False


def mlp(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


class _WithSteps(nn.Module):
    """A module with an integer parameter (a counter kept with the weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Masked(nn.Module):
    """A module with a bool parameter (a pruning mask kept with the weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.mask = nn.Parameter(torch.ones(2, 4, dtype=torch.bool), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.lin.weight * self.mask, self.lin.bias)


class _Complex(nn.Module):
    """A module with a complex weight (a learned filter)."""

    def __init__(self) -> None:
        super().__init__()
        self.filt = nn.Parameter(torch.ones(2, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.complex64) @ self.filt.T).abs()


def tiny_llama(**overrides: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    from ._hf import tiny_llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def _step(ctx: Ctx, per_example: bool = False, **kwargs: Any) -> tuple[Any, Any]:
    """A train step of an MLP regression on ctx.mesh, and its state."""
    sm = ff.fsdp(mlp(), ctx.mesh)

    def loss(p: Any, b: Any) -> torch.Tensor:
        errors = (sm.apply(p, b[0]) - b[1]).pow(2)
        return errors.mean(dim=1) if per_example else errors.mean()

    opt = ff.sgd(0.1)
    return ff.train_step(loss, opt, model=sm, **kwargs), ff.TrainState.create(sm.shard(), opt)


def _zero_step(ctx: Ctx, create_specs: Any, step_specs: Any) -> Any:
    """ZeRO on an MLP: replicated params, a state created with ``create_specs``, a step built
    with ``train_step(opt_specs=step_specs)``; runs one step."""
    sm = ff.fsdp(mlp(), ctx.mesh, specs=P())
    opt = ff.adamw(0.1, weight_decay=0.01)
    step = ff.train_step(
        lambda p, b: (sm.apply(p, b[0]) - b[1]).pow(2).mean(), opt, model=sm, opt_specs=step_specs
    )
    state = ff.TrainState.create(sm.shard(), opt, opt_specs=create_specs)
    return step(state, _batch(4))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


@contextlib.contextmanager
def _disk_full_after(budget: int) -> Iterator[None]:
    """Make DCP's file writes fail with ENOSPC after ``budget`` bytes per file.

    A tmpfs of a few KiB would be the real thing, but mounting one needs root; this fails
    the same ``write`` call a full disk fails.
    """
    from torch.distributed.checkpoint import filesystem

    class Full(io.FileIO):
        def write(self, b: Any) -> int:
            n = memoryview(b).nbytes
            if self.tell() + n > budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
            return super().write(b)

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[io.IOBase]:
        with Full(os.fspath(path), mode.replace("b", "")) as f:
            yield f

    original = filesystem.FileSystem.create_stream
    filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = original  # type: ignore[method-assign]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    a, b = ff.gather(a), ff.gather(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_previous_survives(ctx: Ctx, path: Path, before: dict[str, Any]) -> None:
    """After a failed save: the previous checkpoint at ``path`` loads, bitwise."""
    after = ff.checkpoint.load(path, before)
    if not _same(after, before):
        raise AssertionError(f"the previous checkpoint at {path} changed")


# --------------------------------------------------------------------------- cases


def _mesh_world(ctx: Ctx) -> Any:
    return ff.make_mesh({"dp": 2, "tp": 2})


def _shard_meta(ctx: Ctx) -> Any:
    return ff.shard({"w": torch.empty(4, 3, device="meta")}, ctx.mesh, P("dp"))


def _gather_mixed_devices(ctx: Ctx) -> Any:
    w = ff.shard({"a": torch.ones(4), "b": torch.ones(6, 2)}, ctx.mesh, P("dp"))
    w["b"] = w["b"].replace(torch.empty_like(w["b"].local, device="meta"))
    return ff.gather(w)


def _gather_meta(ctx: Ctx) -> Any:
    w = ff.shard({"w": torch.ones(6, 2)}, ctx.mesh, P("dp"))
    return ff.gather(ff.tree_map(lambda t: torch.empty_like(t, device="meta"), w))


def _gather_two_meshes(ctx: Ctx) -> Any:
    other = ctx.reversed_mesh()
    return ff.gather(
        {
            "a": ff.shard(torch.ones(4), ctx.mesh, P("dp")),
            "b": ff.shard(torch.ones(4), other, P("dp")),
        }
    )


def _gather_changed_local(ctx: Ctx) -> Any:
    w = ff.shard({"w": torch.ones(7, 2)}, ctx.mesh, P("dp"))
    return ff.gather(ff.tree_map(lambda t: t[:1], w))


def _apply_with(
    ctx: Ctx, params_of: Callable[[Any], Any], make: Callable[[], nn.Module] = mlp
) -> Any:
    torch.manual_seed(0)
    sm = ff.fsdp(make(), ctx.mesh)
    return sm.apply(params_of(sm), torch.ones(2, 8))


class _Counts(nn.Module):
    """Counts its calls in a buffer, written in place by the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def _train_step_writing(ctx: Ctx, make: Callable[[], nn.Module]) -> Any:
    """A train_step on ``make()``; raises unless the model's buffers are what they were."""
    torch.manual_seed(0)
    model = make()
    before = {k: b.clone() for k, b in model.named_buffers()}
    sm = ff.fsdp(model, ctx.mesh)
    step = ff.train_step(lambda p, x: sm.apply(p, x).square().mean(), ff.sgd(0.1), model=sm)
    try:
        return step(ff.TrainState.create(sm.shard(), ff.sgd(0.1)), torch.ones(4, 8))
    finally:
        for k, b in model.named_buffers():
            torch.testing.assert_close(b, before[k], rtol=0, atol=0)


def _other_mesh_params(ctx: Ctx, mesh: DeviceMesh) -> Any:
    sm = ff.fsdp(mlp(), ctx.mesh)
    return sm.apply(ff.fsdp(mlp(), mesh).shard(), torch.ones(2, 8))


def _apply_complex_grad(ctx: Ctx) -> Any:
    sm = ff.fsdp(_Complex(), ctx.mesh)
    return torch.func.grad(lambda p: sm.apply(p, torch.ones(2, 4)).sum())(sm.shard())


def _hf_other_config(ctx: Ctx) -> Any:
    sm = ff.fsdp(tiny_llama(), ctx.mesh)
    other = ff.fsdp(tiny_llama(intermediate_size=48), ctx.mesh)
    ids = torch.zeros(2, 5, dtype=torch.long)
    return sm.apply(other.shard(), input_ids=ids)


def _step_with_batch(ctx: Ctx, n: int, **kwargs: Any) -> Any:
    step, state = _step(ctx, **kwargs)
    return step(state, _batch(n))


def _func_engine_on_a_hook(ctx: Ctx) -> Any:
    """``engine="func"`` on a module whose forward hook calls ``requires_grad_``."""
    model = mlp()

    def make_inputs_require_grad(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.requires_grad_(True)

    model[0].register_forward_hook(make_inputs_require_grad)
    sm = ff.fsdp(model, ctx.mesh)
    opt = ff.sgd(0.1)
    step = ff.train_step(
        lambda p, b: (sm.apply(p, b[0]) - b[1]).pow(2).mean(), opt, model=sm, engine="func"
    )
    return step(ff.TrainState.create(sm.shard(), opt), _batch(4))


def _train_bool_leaf(ctx: Ctx) -> Any:
    sm = ff.fsdp(_Masked(), ctx.mesh)
    params, opt = sm.shard(), ff.sgd(0.1)
    state = ff.TrainState(params, opt.init(params), 0)  # built by hand, past create's check
    step = ff.train_step(lambda p, b: sm.apply(p, b).sum(), opt, batch="local")
    return step(state, torch.ones(2, 4))


def _lora_state_without_trainable(ctx: Ctx) -> Any:
    from ._trainable_workers import lora_llama

    model, _ = lora_llama()
    return ff.TrainState.create(ff.fsdp(model, ctx.mesh).shard(), ff.adamw(1e-3, weight_decay=0.01))


def _per_rank_global_batch(ctx: Ctx) -> Any:
    """batch='global' (the default) with each rank's own data, as a DDP loop loads it."""
    step, state = _step(ctx)
    x, y = _batch(4)
    x = x + dist.get_rank()  # rank 1's inputs differ; the targets agree
    state, _ = step(state, (x, y))  # the first call compares the ranks' batches
    return state


def _step_after_simulation(ctx: Ctx) -> Any:
    with ff.simulated_mesh({"dp": 2}) as mesh:
        sm = ff.fsdp(mlp(), mesh)
        opt = ff.sgd(0.1)
        step = ff.train_step(lambda p, b: sm.apply(p, b).sum(), opt, model=sm)
        state = ff.TrainState.create(sm.shard(), opt)
    return step(state, torch.ones(2, 8))


def _get_rank_in_simulation(ctx: Ctx) -> Any:
    batch = torch.arange(4)
    return batch.chunk(2)[dist.get_rank()]  # as the README once wrote it


def _loss_not_scalar(ctx: Ctx) -> Any:
    step, state = _step(ctx, per_example=True)
    return step(state, _batch(4))


def _donated_reuse(ctx: Ctx) -> Any:
    step, state = _step(ctx, donate=True)
    step(state, _batch(4))
    return step(state, _batch(4))


def _rank_or_simulated(ctx: Ctx) -> torch.Generator:
    """A generator that draws other numbers on every rank: seeded by the rank on a real
    process; inside a simulation every simulated rank draws from it in turn."""
    return torch.Generator().manual_seed(dist.get_rank() if ctx.real else 0)


def _shard_differs(ctx: Ctx) -> Any:
    w = torch.randn(4, 3, generator=_rank_or_simulated(ctx))  # each rank seeded differently
    return ff.shard({"w": w, "b": torch.zeros(3)}, ctx.mesh, P("dp"))


def _other_shape_per_rank(ctx: Ctx) -> Any:
    """``{'w': Sharded}`` of shape (4, 6) on rank 0 and (6, 4) on rank 1: equal blocks."""
    shape = (4, 6) if dist.get_rank() == 0 else (6, 4)
    return ff.shard({"w": torch.arange(24.0).reshape(shape)}, ctx.mesh, P("dp"), check=False)


def _ckpt_missing(ctx: Ctx) -> Any:
    return ff.checkpoint.load(ctx.tmp / "missing" / "step_5", ctx.tree(w=(4, 3)))


def _ckpt_read_only(ctx: Ctx) -> Any:
    root = ctx.tmp / "read_only"
    path = root / "ckpt"
    before = ctx.tree(w=(4, 3))
    ctx.on_rank0(lambda: (root.mkdir(), root.chmod(0o755)))
    ff.checkpoint.save(path, before)
    ctx.on_rank0(lambda: root.chmod(0o555))
    try:
        with _unprivileged():
            ff.checkpoint.save(path, ctx.tree(w=(4, 3)))
    except CheckpointError:
        _check_previous_survives(ctx, path, before)
        raise
    finally:
        ctx.on_rank0(lambda: root.chmod(0o755))


def _ckpt_disk_full(ctx: Ctx) -> Any:
    path = ctx.tmp / "full" / "ckpt"
    before = ctx.tree(w=(64, 16))
    ff.checkpoint.save(path, before)
    try:
        with _disk_full_after(1024):
            ff.checkpoint.save(path, ff.tree_map(lambda t: t + 1, before))
    except CheckpointError:
        _check_previous_survives(ctx, path, before)
        leftovers = sorted(p.name for p in path.parent.iterdir())
        if leftovers != ["ckpt"]:
            raise AssertionError(f"a failed save left {leftovers}") from None
        raise


def _ckpt_other_model(ctx: Ctx) -> Any:
    path = ctx.tmp / "other" / "ckpt"
    ff.checkpoint.save(path, ctx.tree(**{"embed": (10, 4), "head.w": (4, 4), "head.b": (4,)}))
    wider = ctx.tree(**{"embed": (10, 6), "head.w": (6, 6), "head.b": (6,), "norm": (6,)})
    return ff.checkpoint.load(path, wider)


def _ckpt_other_llama(ctx: Ctx) -> Any:
    def state(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}

    path = ctx.tmp / "llama" / "ckpt"
    ff.checkpoint.save(path, state(tiny_llama()))
    return ff.checkpoint.load(path, state(tiny_llama(num_hidden_layers=3, hidden_size=48)))


def _ckpt_not_a_checkpoint(ctx: Ctx) -> Any:
    target = ctx.tmp / "notes"

    def make() -> None:
        target.mkdir()
        (target / "train.py").write_text("print('precious')\n")
        (target / "data.csv").write_text("1,2\n")

    ctx.on_rank0(make)
    try:
        return ff.checkpoint.save(target, ctx.tree(w=(4, 3)))
    finally:
        kept = sorted(p.name for p in target.iterdir())
        if kept != ["data.csv", "train.py"]:
            raise AssertionError(f"the user's files were touched: {kept}")


def _ckpt_file(ctx: Ctx) -> Any:
    target = ctx.tmp / "results.txt"
    ctx.on_rank0(lambda: target.write_text("keep me\n"))
    return ff.checkpoint.save(target, ctx.tree(w=(4, 3)))


def _ckpt_truncated(ctx: Ctx) -> Any:
    path = ctx.tmp / "truncated" / "ckpt"
    ff.checkpoint.save(path, ctx.tree(w=(4, 3)))
    meta = path / ".metadata"
    ctx.on_rank0(lambda: os.truncate(meta, meta.stat().st_size // 2))
    return ff.checkpoint.load(path, ctx.tree(w=(4, 3)))


CASES: list[Case] = [
    # ---- meshes
    Case(
        "mesh_size_zero",
        "make_mesh({'dp': 0})",
        ValueError,
        (
            "make_mesh({'dp': 0}): mesh axis sizes must be positive integers, but 'dp' has size 0",
            "Give every axis a size >= 1",
        ),
        lambda ctx: ff.make_mesh({"dp": 0}),
        real=True,
    ),
    Case(
        "mesh_size_negative",
        "make_mesh({'dp': 2, 'tp': -1})",
        ValueError,
        ("mesh axis sizes must be positive integers, but 'tp' has size -1",),
        lambda ctx: ff.make_mesh({"dp": 2, "tp": -1}),
    ),
    Case(
        "mesh_size_float",
        "make_mesh({'dp': 1.7})",
        TypeError,
        (
            "mesh axis 'dp' has size 1.7 (float); sizes must be integers, e.g. {'dp': 2}",
            "never rounded",
        ),
        lambda ctx: ff.make_mesh({"dp": 1.7}),
        real=True,
    ),
    Case(
        "mesh_size_str",
        "make_mesh({'dp': 'two'})",
        TypeError,
        ("mesh axis 'dp' has size 'two' (str); sizes must be integers",),
        lambda ctx: ff.make_mesh({"dp": "two"}),
    ),
    Case(
        "mesh_size_bool",
        "make_mesh({'dp': True, 'tp': 2})",
        TypeError,
        ("mesh axis 'dp' has size True (bool); sizes must be integers",),
        lambda ctx: ff.make_mesh({"dp": True, "tp": 2}),
    ),
    Case(
        "mesh_list",
        "make_mesh(['dp'])",
        TypeError,
        (
            "make_mesh takes a dict {axis name: size}, got ['dp'] (list)",
            "make_mesh({'dp': <size>})",
        ),
        lambda ctx: ff.make_mesh(["dp"]),
    ),
    Case(
        "mesh_name_not_str",
        "make_mesh({1: 2})",
        TypeError,
        ("mesh axis names must be strings, but 1 is not (int)", "e.g. {'dp': 2}"),
        lambda ctx: ff.make_mesh({1: 2}),
    ),
    Case(
        "mesh_empty",
        "make_mesh({})",
        ValueError,
        ("make_mesh({}) has no axes", "make_mesh({'dp': world_size})"),
        lambda ctx: ff.make_mesh({}),
    ),
    Case(
        "mesh_world_size",
        "make_mesh({'dp': 2, 'tp': 2}) on 2 ranks",
        ValueError,
        ("needs 4 ranks, but the world size is 2", "torchrun --nproc-per-node 4"),
        _mesh_world,
        real=True,
    ),
    Case(
        "axis_size_typo",
        "axis_size(mesh, 'pd')",
        ValueError,
        ("axis_size: the mesh Mesh(dp=2) has no axis 'pd' (did you mean 'dp'?)",),
        lambda ctx: ff.axis_size(ctx.mesh, "pd"),
        real=True,
    ),
    # ---- specs
    Case(
        "spec_axis_twice",
        "P('dp', 'dp')",
        ValueError,
        ("P('dp', 'dp') uses mesh axis 'dp' twice (in dims 0 and 1)", "write a tuple"),
        lambda ctx: P("dp", "dp"),
    ),
    Case(
        "spec_entry_not_a_name",
        "P(0)",
        TypeError,
        ("P entry 0 is 0 (int)", "e.g. P('dp', None)"),
        lambda ctx: P(0),  # type: ignore[arg-type]
    ),
    Case(
        "spec_axis_typo",
        "shard({'w': (4, 3)}, mesh, P('pd'))",
        ValueError,
        (
            "cannot lay out ['w'] (shape (4, 3)) with P('pd') on Mesh(dp=2)",
            "which the mesh does not have (its axes are ('dp',)); use one of those names "
            "(did you mean 'dp'?)",
        ),
        lambda ctx: ff.shard({"w": torch.ones(4, 3)}, ctx.mesh, P("pd")),
        real=True,
    ),
    Case(
        "spec_scalar",
        "shard({'step': tensor(3.)}, mesh, P('dp'))",
        ValueError,
        (
            "cannot lay out ['step'] (shape ()) with P('dp')",
            "the tensor is 0-dim (a scalar has no dims to split); use P() to replicate it",
        ),
        lambda ctx: ff.shard({"step": torch.tensor(3.0)}, ctx.mesh, P("dp")),
    ),
    Case(
        "spec_too_long",
        "shard({'b': (3,)}, mesh, P('dp', None))",
        ValueError,
        (
            "cannot lay out ['b'] (shape (3,)) with P('dp', None)",
            "has 2 entries but the tensor has only 1 dims; give at most one entry per dim",
        ),
        lambda ctx: ff.shard({"b": torch.ones(3)}, ctx.mesh, P("dp", None)),
    ),
    Case(
        "specs_tree_mismatch",
        "shard({'enc': {'w', 'b'}}, mesh, {'enc': {'w': P('dp')}})",
        ValueError,
        (
            "the specs do not match the tree at ['enc']: the tree has a dict with keys "
            "['b', 'w'], but the specs have a dict with keys ['w']",
            "or a prefix of it",
        ),
        lambda ctx: ff.shard(
            {"enc": {"w": torch.ones(4, 3), "b": torch.ones(3)}},
            ctx.mesh,
            {"enc": {"w": P("dp")}},
        ),
    ),
    Case(
        "spec_tuple_in_tree",
        "shard({'w': (4, 3)}, mesh, {'w': ('dp', None)})",
        ValueError,
        (
            "at ['w']: the tree has a tensor of shape (4, 3), but the specs have a tuple of 2",
            "write P('dp', None)",
        ),
        lambda ctx: ff.shard({"w": torch.ones(4, 3)}, ctx.mesh, {"w": ("dp", None)}),
    ),
    Case(
        "spec_string",
        "shard({'w': (4, 3)}, mesh, {'w': 'dp'})",
        TypeError,
        ("the spec for ['w'] (shape (4, 3)) is 'dp' (str); specs must be P objects",),
        lambda ctx: ff.shard({"w": torch.ones(4, 3)}, ctx.mesh, {"w": "dp"}),
    ),
    Case(
        "shard_arguments_swapped",
        "shard(tree, P('dp'), mesh)",
        TypeError,
        (
            "shard(tree, mesh, specs) takes a DeviceMesh with named axes, got P('dp') (P) "
            "(the arguments look swapped)",
            "ff.make_mesh",
        ),
        lambda ctx: ff.shard({"w": torch.ones(4)}, P("dp"), ctx.mesh),
    ),
    # ---- values
    Case(
        "shard_already_sharded",
        "shard(shard(w, mesh, P('dp')), mesh, P())",
        TypeError,
        ("['w'] is already Sharded (P('dp')); use ff.reshard(tree, specs)",),
        lambda ctx: ff.shard(ff.shard({"w": torch.ones(4)}, ctx.mesh, P("dp")), ctx.mesh, P()),
    ),
    Case(
        "shard_differs_between_ranks",
        "shard({'w': randn(4, 3)}, mesh, P('dp')) with each rank seeded differently",
        ValueError,
        (
            "shard(): ['w'] (float32 (4, 3), P('dp')) differs between the simulated ranks of "
            "Mesh(dp=2):\n  rank 0: checksum ",
            "\n  rank 1: checksum ",
            "gathering would return blocks that no rank had",
            "Create the values outside simulated_mesh()",
            "pass ff.shard(..., check=False)",
        ),
        _shard_differs,
        real=True,
        real_match=(
            "shard(): ['w'] (float32 (4, 3), P('dp')) differs between the ranks of Mesh(dp=2):"
            "\n  rank 0: checksum ",
            "\n  rank 1: checksum ",
            "gathering would return blocks that no rank had",
            "Seed every rank the same before creating the values (torch.manual_seed(seed), one "
            "seed on every rank, before building the model), or load them from one file",
            "pass ff.shard(..., check=False)",
        ),
    ),
    Case(
        "gather_shapes_differ_between_ranks",
        "gather({'w'}) of shape (4, 6) on rank 0 and (6, 4) on rank 1 (equal blocks)",
        ValueError,
        (
            "gather(): ['w'] differs between the ranks of Mesh(dp=2):\n"
            "  rank 0: ['w'] float32 (4, 6) P('dp') gathering ['dp']\n"
            "  rank 1: ['w'] float32 (6, 4) P('dp') gathering ['dp']\n",
            "Every rank of the gathered axes ['dp'] must call gather() with the same values",
            "a branch on the rank",
        ),
        lambda ctx: ff.gather(_other_shape_per_rank(ctx)),
        where="real",
        real=True,
    ),
    Case(
        "train_step_global_batch_differs_between_ranks",
        "train_step(batch='global') with each rank's own batch",
        ValueError,
        (
            "train_step(batch='global'): batch[0] differs between the ranks of Mesh(dp=2):\n"
            "  rank 0: shape (4, 8), torch.float32, checksum ",
            "  rank 1: shape (4, 8), torch.float32, checksum ",
            "every rank passes the same global batch and keeps its own share of dim 0",
            "pass train_step(..., batch='local')",
        ),
        _per_rank_global_batch,
        where="real",
        real=True,
    ),
    Case(
        "reshard_shapes_differ_between_ranks",
        "reshard({'w'}, P()) of shape (4, 6) on rank 0 and (6, 4) on rank 1 (equal blocks)",
        ValueError,
        (
            "reshard(): ['w'] differs between the ranks of Mesh(dp=2):\n"
            "  rank 0: ['w'] float32 (4, 6) P('dp') gathering ['dp']\n",
            "must call reshard() with the same values (the same global shapes, specs and dtypes",
        ),
        lambda ctx: ff.reshard(_other_shape_per_rank(ctx), P()),
        where="real",
        real=True,
    ),
    Case(
        "shard_numpy",
        "shard({'w': np.ones((4, 3))}, mesh, P('dp'))",
        TypeError,
        (
            "shard(): ['w'] is a numpy array of shape (4, 3), not a torch.Tensor, so it would "
            "pass through unsharded",
            "torch.from_numpy(array)",
        ),
        lambda ctx: ff.shard({"w": __import__("numpy").ones((4, 3))}, ctx.mesh, P("dp")),
    ),
    Case(
        "reshard_plain_tensor",
        "reshard({'w': full tensor}, P('dp'))",
        TypeError,
        (
            "reshard(): ['w'] (shape (4, 3)) is a plain tensor, not Sharded",
            "instead of laying it out with P('dp')",
            "ff.shard(tree, mesh, specs)",
        ),
        lambda ctx: ff.reshard({"w": torch.ones(4, 3)}, P("dp")),
        real=True,
    ),
    Case(
        "gather_axes_not_names",
        "gather(w, 0)",
        TypeError,
        ("gather(axes=0): axes names mesh axes: a string ('dp')", "got int"),
        lambda ctx: ff.gather(ff.shard(torch.ones(4), ctx.mesh, P("dp")), 0),  # type: ignore[arg-type]
        real=True,
    ),
    Case(
        "gather_bucket_bytes_zero",
        "gather(w, bucket_bytes=0)",
        ValueError,
        ("gather(bucket_bytes=0): the cap on one bucket's local bytes must be a positive int",),
        lambda ctx: ff.gather(ff.shard(torch.ones(4), ctx.mesh, P("dp")), bucket_bytes=0),
    ),
    Case(
        "init_backend_typo",
        "init_distributed('ncl')",
        ValueError,
        ("init_distributed(backend='ncl'): not a c10d backend", "(did you mean 'nccl'?)"),
        lambda ctx: ff.init_distributed("ncl"),
        real=True,
    ),
    Case(
        "shard_meta",
        "shard({'w': meta (4, 3)}, mesh, P('dp'))",
        ValueError,
        ("shard(): ['w'] (shape (4, 3)) is on the meta device", "ff.init_sharded"),
        _shard_meta,
    ),
    Case(
        "gather_mixed_devices",
        "gather({'a': on cpu, 'b': on meta})",
        ValueError,
        (
            "gather() got values on different devices: ['a'] is on cpu but ['b'] (shape (6, 2)) "
            "is on meta",
            "Move them to one device first",
        ),
        _gather_mixed_devices,
        real=True,
    ),
    Case(
        "gather_meta",
        "gather({'w': on meta})",
        ValueError,
        ("gather(): ['w'] (shape (6, 2), P('dp')) is on the meta device", "Materialise it first"),
        _gather_meta,
    ),
    Case(
        "gather_axis_typo",
        "gather(w, 'pd')",
        ValueError,
        (
            "gather(axes=['pd']): the mesh Mesh(dp=2) has no axis 'pd' (did you mean 'dp'?)",
            "or pass axes=None",
        ),
        lambda ctx: ff.gather(ff.shard(torch.ones(4), ctx.mesh, P("dp")), "pd"),
        real=True,
    ),
    Case(
        "gather_rank_order",
        "gather({'a': on mesh [0, 1], 'b': on mesh [1, 0]})",
        ValueError,
        (
            "gather() got values on different meshes: ['a'] is on Mesh(dp=2) over ranks [0, 1] "
            "but ['b'] is on Mesh(dp=2) over ranks [1, 0]",
            "reshard the values onto one mesh first",
        ),
        _gather_two_meshes,
        real=True,
    ),
    Case(
        "local_shape_changed",
        "gather(tree_map(lambda t: t[:1], w))",
        ValueError,
        (
            "gather(): ['w']: Sharded local shape (1, 2) contradicts its layout: global shape "
            "(7, 2) with P('dp') on Mesh(dp=2) has padded local blocks of shape (4, 2)",
            "must keep their shape",
        ),
        _gather_changed_local,
    ),
    Case(
        "sharded_local_not_tensor",
        "Sharded([1, 2], (2,), P('dp'), mesh)",
        TypeError,
        ("Sharded needs its local block as a torch.Tensor, got list", "ff.shard("),
        lambda ctx: ff.Sharded([1, 2], (2,), P("dp"), ctx.mesh),  # type: ignore[arg-type]
    ),
    # ---- ff.fsdp
    Case(
        "fsdp_not_a_module",
        "fsdp('not a module', mesh)",
        TypeError,
        ("ff.fsdp takes an nn.Module, got 'not a module' (str)", "ff.fsdp(model, mesh)"),
        lambda ctx: ff.fsdp("not a module", ctx.mesh),  # type: ignore[arg-type]
    ),
    Case(
        "fsdp_not_a_mesh",
        "fsdp(model, {'dp': 2})",
        TypeError,
        (
            "ff.fsdp(module, mesh) takes a DeviceMesh with named axes, got {'dp': 2} (dict)",
            "ff.make_mesh({'dp': N})",
        ),
        lambda ctx: ff.fsdp(mlp(), {"dp": 2}),  # type: ignore[arg-type]
    ),
    Case(
        "fsdp_data_axes_typo",
        "fsdp(model, mesh, data_axes=('db',))",
        ValueError,
        (
            "ff.fsdp(data_axes=('db',)): the mesh Mesh(dp=2) has no axis 'db' (did you mean 'dp'?)",
            "name the mesh axes that split the batch, some of ('dp',)",
        ),
        lambda ctx: ff.fsdp(mlp(), ctx.mesh, data_axes=("db",)),
    ),
    Case(
        "fsdp_specs_axis_typo",
        "fsdp(model, mesh, specs=P('pd'))",
        ValueError,
        (
            "the spec for parameter '0.weight' (shape (16, 8)) on Mesh(dp=2): P('pd') names "
            "mesh axis 'pd'",
            "(did you mean 'dp'?)",
        ),
        lambda ctx: ff.fsdp(mlp(), ctx.mesh, specs=P("pd")),
    ),
    Case(
        "fsdp_unit_typo",
        "fsdp(llama, mesh, units=['model.layer.*'])",
        ValueError,
        (
            "unit pattern 'model.layer.*' matches no submodule of LlamaForCausalLM (close: "
            "['model.layers.*'",
            "fnmatch patterns",
        ),
        lambda ctx: ff.fsdp(tiny_llama(), ctx.mesh, units=["model.layer.*"]),
    ),
    Case(
        "fsdp_trainable_int",
        "fsdp(model, mesh, trainable=['lin.weight', 'steps']) with an int64 'steps'",
        TypeError,
        (
            "fsdp(trainable=...) selects _WithSteps.steps (shape (3,), torch.int64)",
            "integer and bool parameters have no gradients",
            "Leave it out of trainable=",
        ),
        lambda ctx: ff.fsdp(_WithSteps(), ctx.mesh, trainable=["lin.weight", "steps"]),
    ),
    Case(
        "fsdp_trainable_bool",
        "fsdp(model, mesh, trainable=lambda name: True) with a bool 'mask'",
        TypeError,
        (
            "fsdp(trainable=...) selects _Masked.mask (shape (2, 4), torch.bool)",
            "integer and bool parameters have no gradients",
            "make it a buffer (module.register_buffer)",
        ),
        lambda ctx: ff.fsdp(_Masked(), ctx.mesh, trainable=lambda name: True),
    ),
    Case(
        "policy_grad_reduce",
        "Policy(grad_reduce='avg')",
        ValueError,
        ("Policy(grad_reduce='avg'): use 'mean'",),
        lambda ctx: ff.Policy(grad_reduce="avg"),  # type: ignore[arg-type]
    ),
    Case(
        "mixed_precision_dtype_name",
        "MixedPrecision(param_dtype='bf16')",
        TypeError,
        (
            "MixedPrecision(param_dtype='bf16'): takes a floating-point torch.dtype",
            "e.g. MixedPrecision(param_dtype=torch.bfloat16)",
        ),
        lambda ctx: ff.MixedPrecision(param_dtype="bf16"),  # type: ignore[arg-type]
    ),
    Case(
        "mixed_precision_integer_dtype",
        "MixedPrecision(reduce_dtype=torch.int32)",
        TypeError,
        ("MixedPrecision(reduce_dtype=torch.int32): takes a floating-point torch.dtype, or None",),
        lambda ctx: ff.MixedPrecision(reduce_dtype=torch.int32),
    ),
    # ---- FSDP.apply
    Case(
        "apply_batchnorm_training",
        "train_step on Sequential(Linear, BatchNorm1d) in training mode",
        ValueError,
        (
            "FSDP.apply: the forward writes the buffer '1.running_mean' of BatchNorm1d "
            "(shape (8,), torch.float32) in place",
            "each rank would keep its own value",
            "track_running_stats=False",
            "layer.eval()",
        ),
        lambda ctx: _train_step_writing(
            ctx, lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        ),
        real=True,
    ),
    Case(
        "apply_buffer_written",
        "sharded_model.apply on a module whose forward adds 1 to a buffer",
        ValueError,
        ("FSDP.apply: the forward writes the buffer 'calls' of _Counts (shape (), torch.int64)",),
        lambda ctx: _apply_with(ctx, lambda sm: sm.shard(), _Counts),
        real=True,
    ),
    Case(
        "apply_params_list",
        "sharded_model.apply(list(params.values()), x)",
        TypeError,
        ("FSDP.apply takes params as a dict {name: Sharded}", "got a list"),
        lambda ctx: _apply_with(ctx, lambda sm: list(sm.shard().values())),
        real=True,
    ),
    Case(
        "apply_full_tensors",
        "sharded_model.apply({name: full tensor}, x)",
        TypeError,
        (
            "params['0.weight'] is a ",
            "Tensor of shape (16, 8), not a Sharded value",
            "FSDP.apply takes Sharded values (use FSDP.shard()",
        ),
        lambda ctx: _apply_with(ctx, lambda sm: ff.gather(sm.shard())),
        real=True,
    ),
    Case(
        "apply_other_keys",
        "params of Sequential(Linear, Linear) for Sequential(Linear, ReLU, Linear)",
        ValueError,
        (
            "params do not match Sequential's parameters: missing ['2.bias', '2.weight'], "
            "unexpected ['1.bias', '1.weight']",
            "Pass the dict returned by FSDP.shard()",
        ),
        lambda ctx: _apply_with(
            ctx,
            lambda sm: ff.fsdp(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), ctx.mesh).shard(),
        ),
        real=True,
    ),
    Case(
        "apply_other_shapes",
        "params of an 8-12-4 MLP for an 8-16-4 MLP",
        ValueError,
        (
            "params['0.weight'] is torch.float32 (12, 8) P('dp'), but Sequential's parameter is "
            "torch.float32 (16, 8) P('dp') on Mesh(dp=2)",
            "Pass the parameters of this model",
        ),
        lambda ctx: _apply_with(ctx, lambda sm: ff.fsdp(mlp(12), ctx.mesh).shard()),
        real=True,
    ),
    Case(
        "apply_hf_other_config",
        "params of a Llama with intermediate_size=48 for one with 64",
        ValueError,
        (
            "params['model.layers.0.mlp.gate_proj.weight'] is torch.float32 (48, 32) P('dp'), but "
            "LlamaForCausalLM's parameter is torch.float32 (64, 32) P('dp') on Mesh(dp=2)",
        ),
        _hf_other_config,
        real=True,
    ),
    Case(
        "apply_other_mesh",
        "params on Mesh(dp=1, tp=2) for an FSDP on Mesh(dp=2)",
        ValueError,
        (
            "params['0.weight'] lives on Mesh(dp=1, tp=2) over ranks [[0, 1]], but this FSDP runs "
            "on Mesh(dp=2) over ranks [0, 1]",
            "ff.checkpoint.load(path, sharded_model.shard())",
        ),
        lambda ctx: _other_mesh_params(
            ctx, DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("dp", "tp"))
        ),
        real=True,
    ),
    Case(
        "apply_rank_order",
        "params on a Mesh(dp=2) over ranks [1, 0] for an FSDP over [0, 1]",
        ValueError,
        (
            "params['0.weight'] lives on Mesh(dp=2) over ranks [1, 0], but this FSDP runs on "
            "Mesh(dp=2) over ranks [0, 1]",
            "Shard the parameters on this FSDP's mesh",
        ),
        lambda ctx: _other_mesh_params(ctx, ctx.reversed_mesh()),
        real=True,
    ),
    Case(
        "apply_meta_params",
        "sharded_model.apply(params on meta, x)",
        ValueError,
        (
            "params['0.weight'] (shape (16, 8), P('dp')) is on the meta device",
            "ff.init_sharded(sharded_model)",
        ),
        lambda ctx: _apply_with(
            ctx, lambda sm: ff.tree_map(lambda t: torch.empty_like(t, device="meta"), sm.shard())
        ),
        real=True,
    ),
    Case(
        "apply_complex_grad",
        "torch.func.grad through apply of a complex parameter",
        TypeError,
        (
            "params['filt'] is complex (torch.complex64, shape (2, 4)) and is being differentiated",
            "cannot sum complex tensors",
            "torch.view_as_real",
        ),
        _apply_complex_grad,
        real=True,
    ),
    # ---- train_step
    Case(
        "batch_not_divisible",
        "a global batch of 3 on 2 data-parallel ranks",
        ValueError,
        (
            "a global batch of 3 examples (shape (3, 8)) does not divide across the 2 "
            "data-parallel ranks of Mesh(dp=2)",
            "use a multiple of 2",
        ),
        lambda ctx: _step_with_batch(ctx, 3),
        real=True,
    ),
    Case(
        "batch_smaller_than_ranks",
        "a global batch of 1 on 2 data-parallel ranks",
        ValueError,
        (
            "a global batch of 1 example (shape (1, 8)) does not divide across the 2",
            "batch='local'",
        ),
        lambda ctx: _step_with_batch(ctx, 1),
        real=True,
    ),
    Case(
        "accumulate_not_dividing",
        "train_step(accumulate=3) with 2 examples per rank",
        ValueError,
        (
            "train_step: this rank's share of the global batch (4 examples over the 2 "
            "data-parallel ranks of Mesh(dp=2), data axes ('dp',)) holds 2 examples, which "
            "does not split into 3 equal micro-batches (accumulate=3)",
            "make it a multiple of 3",
        ),
        lambda ctx: _step_with_batch(ctx, 4, accumulate=3),
        real=True,
    ),
    Case(
        "accumulate_one_example",
        "train_step(accumulate=2) with 1 example per rank",
        ValueError,
        (
            "this rank's share of the global batch (2 examples over the 2 data-parallel ranks",
            "holds 1 example, which does not split into 2 equal micro-batches (accumulate=2)",
            "make it a multiple of 2",
        ),
        lambda ctx: _step_with_batch(ctx, 2, accumulate=2),
    ),
    Case(
        "accumulate_zero",
        "train_step(accumulate=0)",
        ValueError,
        (
            "train_step: accumulate must be >= 1, got 0",
            "accumulate=1 (the default) computes the step on the whole batch",
        ),
        lambda ctx: _step(ctx, accumulate=0),
    ),
    Case(
        "engine_unknown",
        "train_step(engine='jax')",
        ValueError,
        (
            "train_step: engine must be 'auto', 'func' or 'autograd', got 'jax'",
            "'autograd' with plain autograd (for model code torch.func cannot transform",
            "'auto' (the default) uses torch.func where it can",
        ),
        lambda ctx: _step(ctx, engine="jax"),
    ),
    Case(
        "engine_func_cannot_transform",
        "train_step(engine='func') on a module whose forward hook calls requires_grad_()",
        RuntimeError,
        (
            "train_step(engine='func'): torch.func cannot differentiate this model "
            "(Tensor.requires_grad_() inside the forward)",
            "Use engine='autograd' (the same pure step and gradients",
            "or engine='auto' to choose by itself",
        ),
        _func_engine_on_a_hook,
        real=True,
    ),
    Case(
        "batch_empty",
        "train_step on a batch of 0 examples",
        ValueError,
        (
            "train_step: the batch is empty: batch[0] has 0 examples (shape (0, 8))",
            "drop_last=True",
        ),
        lambda ctx: _step_with_batch(ctx, 0),
        real=True,
    ),
    Case(
        "state_int_leaf",
        "TrainState.create(params, opt) whose params hold an int64 'steps'",
        TypeError,
        (
            "TrainState.create: params['steps'] is int64 (shape (3,)) and every leaf trains "
            "(no trainable= was given)",
            "integer and bool tensors have no gradients",
            "trainable=sharded_model",
            "module.register_buffer",
        ),
        lambda ctx: ff.TrainState.create(ff.fsdp(_WithSteps(), ctx.mesh).shard(), ff.sgd(0.1)),
        real=True,
    ),
    Case(
        "train_step_bool_leaf",
        "train_step without model= on a state whose trainable params hold a bool 'mask'",
        TypeError,
        (
            "train_step: params['mask'] is bool (shape (2, 4)) and every leaf trains",
            "integer and bool tensors have no gradients",
            "trainable=lambda path, p: p.dtype.is_floating_point",
        ),
        _train_bool_leaf,
        real=True,
    ),
    Case(
        "loss_not_scalar",
        "loss_fn returning one loss per example",
        ValueError,
        ("loss_fn must return a scalar tensor", "got (2,)", "return loss.mean()"),
        _loss_not_scalar,
        real=True,
    ),
    Case(
        "zero_opt_specs_only_in_step",
        "train_step(opt_specs=P('dp')) with a state created without opt_specs",
        ValueError,
        (
            "train_step(opt_specs=...): this TrainState was created without opt_specs",
            "laid out like the parameters (e.g. '0.bias'), not by P('dp')",
            "ff.TrainState.create(params, optimizer, opt_specs=P('dp'))",
            "leave opt_specs out of train_step",
        ),
        lambda ctx: _zero_step(ctx, None, P("dp")),
        real=True,
    ),
    Case(
        "zero_opt_specs_disagree",
        "train_step(opt_specs=P()) with a state created with opt_specs=P('dp')",
        ValueError,
        (
            "train_step(opt_specs=...): gives '0.bias' the optimizer layout P()",
            "the TrainState was created with P('dp')",
            "leave opt_specs out of train_step",
        ),
        lambda ctx: _zero_step(ctx, P("dp"), P()),
    ),
    Case(
        "lora_state_without_trainable",
        "TrainState.create(sm.shard(), opt) for a LoRA Llama (frozen base), no trainable=",
        ValueError,
        (
            "TrainState.create: params['base_model.model.lm_head.weight'] and",
            "are the shards of frozen parameters (requires_grad=False) of the module",
            "trainable=sharded_model",
        ),
        _lora_state_without_trainable,
        real=True,
    ),
    Case(
        "step_after_simulation_ended",
        "a train_step called after its simulated mesh has ended",
        ValueError,
        (
            "train_step: the value's mesh Mesh(dp=2) belonged to ff.simulated_mesh({'dp': 2})",
            "which has ended",
            "persistent=True",
        ),
        _step_after_simulation,
        where="plain",
    ),
    Case(
        "fsdp_called_like_a_module",
        "sharded_model(x) instead of sharded_model.apply(params, x)",
        TypeError,
        ("an FSDP description is not a module", "sharded_model.apply(params, *inputs)"),
        lambda ctx: ff.fsdp(mlp(), ctx.mesh)(torch.ones(2, 8)),
        real=True,
    ),
    Case(
        "units_type_matches_nothing",
        "ff.fsdp(mlp, mesh, units=nn.Conv2d) on a model without convolutions",
        ValueError,
        (
            "units=Conv2d: unit type Conv2d matches no submodule of Sequential, so the whole "
            "model would be one unit, gathered at once",
            "Its submodules are of types [Linear, ReLU]",
            "units=None for one unit per child",
            "units=[] for one unit on purpose",
        ),
        lambda ctx: ff.fsdp(mlp(), ctx.mesh, units=nn.Conv2d),
        real=True,
    ),
    Case(
        "units_module_instance",
        "ff.fsdp(mlp, mesh, units=nn.Linear(8, 16))",
        TypeError,
        ("units=Linear(...) is a module instance; units takes its type: units=Linear",),
        lambda ctx: ff.fsdp(mlp(), ctx.mesh, units=nn.Linear(8, 16)),
    ),
    Case(
        "units_not_types_or_paths",
        "ff.fsdp(model, mesh, units=[nn.Linear, 3])",
        TypeError,
        ("3 (int) is neither a module type nor a module path", "units={Block}"),
        lambda ctx: ff.fsdp(mlp(), ctx.mesh, units=[nn.Linear, 3]),
    ),
    Case(
        "local_batch_not_dividing",
        "ff.local_batch of 3 examples on 2 data-parallel ranks",
        ValueError,
        (
            "ff.local_batch: a global batch of 3 examples (shape (3, 8)) does not divide",
            "Mesh(dp=2)",
            "use a multiple of 2",
        ),
        lambda ctx: ff.local_batch(torch.ones(3, 8), ctx.mesh),
        real=True,
    ),
    Case(
        "local_batch_unknown_axis",
        "ff.local_batch(batch, mesh, data_axes='pd')",
        ValueError,
        (
            "ff.local_batch(data_axes=('pd',)): the mesh Mesh(dp=2) has no axis 'pd' (did you "
            "mean 'dp'?)",
            "or pass the FSDP model itself (ff.local_batch(batch, sharded_model))",
        ),
        lambda ctx: ff.local_batch(torch.ones(2, 8), ctx.mesh, data_axes="pd"),
    ),
    Case(
        "get_rank_in_simulation",
        "batch.chunk(2)[torch.distributed.get_rank()] on a simulated mesh",
        RuntimeError,
        (
            "torch.distributed.get_rank() inside ff.simulated_mesh({'dp': 2})",
            "torch would answer 0 for every rank",
            "ff.local_batch(global_batch, sharded_model)",
        ),
        _get_rank_in_simulation,
    ),
    Case(
        "torch_optimizer",
        "TrainState.create(params, torch.optim.AdamW(model.parameters()))",
        TypeError,
        (
            "TrainState.create: optimizer must be a GradientTransformation",
            "got AdamW: torch.optim.AdamW holds its own state",
            "ff.adamw(3e-4, weight_decay=0.01)",
        ),
        lambda ctx: ff.TrainState.create(
            ff.fsdp(mlp(), ctx.mesh).shard(), torch.optim.AdamW(mlp().parameters())
        ),
        real=True,
    ),
    Case(
        "step_given_params",
        "step(params, batch) instead of step(state, batch)",
        TypeError,
        ("step(state, batch) takes a TrainState, got dict", "ff.TrainState.create(params"),
        lambda ctx: _step(ctx)[0](ff.fsdp(mlp(), ctx.mesh).shard(), _batch(4)),
    ),
    Case(
        "train_step_model_is_module",
        "train_step(loss_fn, opt, model=module)",
        TypeError,
        ("train_step: model= takes the FSDP description", "got Sequential", "model=sharded_model"),
        lambda ctx: ff.train_step(lambda p, b: b, ff.sgd(0.1), model=mlp()),
    ),
    Case(
        "donated_state_reused",
        "a state used again after train_step(donate=True)",
        DonatedStateError,
        ("this TrainState was donated", "Use the state that call returned"),
        _donated_reuse,
    ),
    # ---- checkpoints
    Case(
        "ckpt_missing",
        "checkpoint.load('missing/step_5', like)",
        CheckpointError,
        ("no checkpoint at ", "missing/step_5': the directory does not exist", "latest_step()"),
        _ckpt_missing,
        where="plain",
        real=True,
    ),
    Case(
        "ckpt_read_only",
        "checkpoint.save into a read-only directory",
        CheckpointError,
        (
            "checkpoint.save: cannot save to ",
            "Permission denied",
            "Choose a writable directory",
            "previous checkpoint at this path, if any, is untouched",
        ),
        _ckpt_read_only,
        where="plain",
        real=True,
    ),
    Case(
        "ckpt_disk_full",
        "checkpoint.save onto a full disk (ENOSPC)",
        CheckpointError,
        (
            "checkpoint.save: cannot save to ",
            "No space left on device",
            "Free disk space",
            "previous checkpoint at this path, if any, is untouched",
        ),
        _ckpt_disk_full,
        where="plain",
        real=True,
    ),
    Case(
        "ckpt_other_model",
        "checkpoint.load of a narrower model's checkpoint",
        ValueError,
        (
            "checkpoint.load: 'embed' was saved with global shape (10, 4)",
            "but the template has (10, 6): the checkpoint is of another model",
            "3 key(s) differ in shape: 'embed' saved (10, 4), template (10, 6); 'head.b' saved "
            "(4,), template (6,); 'head.w' saved (4, 4), template (6, 6)",
            "1 key(s) are not in the checkpoint: ['norm']",
            "Build the template from the model configuration",
        ),
        _ckpt_other_model,
        where="plain",
        real=True,
    ),
    Case(
        "ckpt_other_llama",
        "checkpoint.load of a 2-layer Llama's checkpoint into a 3-layer, wider one",
        ValueError,
        (
            "checkpoint.load: 'lm_head.weight' was saved with global shape (96, 32)",
            "but the template has (96, 48)",
            "key(s) are not in the checkpoint: ['model.layers.2.",
        ),
        _ckpt_other_llama,
        where="plain",
        real=True,
    ),
    Case(
        "ckpt_not_a_checkpoint",
        "checkpoint.save onto a directory of other files",
        CheckpointError,
        (
            "checkpoint.save: cannot save to ",
            "the directory exists and is not a checkpoint "
            "(it holds ['data.csv', 'train.py']), so saving would delete those files",
            "Save into a new directory",
        ),
        _ckpt_not_a_checkpoint,
        where="plain",
        real=True,
    ),
    Case(
        "ckpt_onto_a_file",
        "checkpoint.save('results.txt', state) where the file exists",
        CheckpointError,
        (
            "results.txt': it is a file, not a checkpoint directory",
            "Save into a new directory, e.g. ",
            "ckpt_onto_a_file/step_100'",
        ),
        _ckpt_file,
        where="plain",
    ),
    Case(
        "ckpt_truncated",
        "checkpoint.load of a checkpoint with a truncated .metadata",
        CheckpointError,
        (
            "truncated/ckpt' is corrupt: the file .metadata has",
            "bytes, but",
            "Load the previous checkpoint",
        ),
        _ckpt_truncated,
        where="plain",
    ),
]


# --------------------------------------------------------------------------- real processes


def run_real(root: str, ids: list[str]) -> dict[str, tuple[str, str, bool]]:
    """Run the named cases on this gloo process (every rank runs them, in order)."""
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    tmp = Path(root)
    out = {}
    by_id = {c.id: c for c in CASES}
    for case_id in ids:
        ctx = Ctx(mesh, tmp, real=True)
        out[case_id] = outcome(by_id[case_id], ctx)
        dist.barrier()
    return out


def table() -> str:
    """The catalogue as a Markdown table (the messages as raised in-process)."""
    rows = ["| input | error | message (excerpt) |", "|---|---|---|"]
    root = Path(tempfile.mkdtemp(prefix="ff-catalogue-"))
    os.chmod(root, 0o755)
    try:
        for case in CASES:
            tmp = root / case.id
            tmp.mkdir()
            os.chmod(tmp, 0o755)
            if case.where == "real":
                name, msg = case.error.__name__, "(on real processes only) " + "…".join(case.match)
            elif case.where == "plain":
                name, msg, _ = outcome(case, Ctx(None, tmp, real=False))
            else:
                with ff.simulated_mesh({"dp": 2}) as mesh:
                    name, msg, _ = outcome(case, Ctx(mesh, tmp, real=False))
            msg = msg.replace(str(root), "…").replace("|", "\\|")
            rows.append(f"| `{case.input}` | {name} | {msg} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
