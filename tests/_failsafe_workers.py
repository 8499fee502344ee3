"""Worker functions for the failure tests: non-finite steps, exceptions inside a step,
collectives that time out, and the debug checks (real gloo, and simulated meshes)."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import functional_fsdp as ff
from functional_fsdp.distributed import checks
from functional_fsdp.distributed.process import free_port
from functional_fsdp.models import GPT, lm_loss

from ._fsdp_workers import CFG
from ._hf import tiny_llama_config

BATCH = 8

# --------------------------------------------------------------------------- models


class _ScaleGrad(torch.autograd.Function):
    """Identity whose gradient is multiplied by a per-row factor (``inf`` poisons it while
    the loss stays finite)."""

    @staticmethod
    def forward(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.rows = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.rows.view(-1, *[1] * (grad.ndim - 1)), None


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def mlp_loss(f: ff.FSDP, p: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
    out = _ScaleGrad.apply(f.apply(p, b["x"]), b["g"])
    return ((out - b["y"]).pow(2).mean(1) * b["w"]).mean()


def llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.config.use_cache = False
    return model


def llama_loss(f: ff.FSDP, p: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = _ScaleGrad.apply(f.apply(p, input_ids=b["ids"][:, :-1]).logits, b["g"])
    per_row = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), b["ids"][:, 1:], reduction="none"
    ).mean(1)
    return (per_row * b["w"]).mean()


def make_batch(kind: str, seed: int, bad: str | None = None, rank: int = 1) -> dict:
    """A global batch of ``BATCH`` rows; ``bad="nan"`` puts NaN in ``rank``'s share (of 2),
    ``bad="inf_grad"`` an infinite gradient factor there (the loss stays finite)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        batch = {"x": torch.randn(BATCH, 6, generator=g), "y": torch.randn(BATCH, 2, generator=g)}
    else:
        batch = {"ids": torch.randint(0, 96, (BATCH, 9), generator=g)}
    batch["w"], batch["g"] = torch.ones(BATCH), torch.ones(BATCH)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    if bad == "nan":
        batch["w"][rows] = float("nan")
    elif bad == "inf_grad":
        batch["g"][rows] = float("inf")
    return batch


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., torch.Tensor]]] = {
    "mlp": (mlp, mlp_loss),
    "llama": (llama, llama_loss),
}


def _values(x: torch.Tensor) -> list[torch.Tensor]:
    return ff.rank_values(x)


def _same(a: Any, b: Any) -> bool:
    """Bitwise equal trees (NaN never equals: a NaN written anywhere shows)."""
    la, lb = ff.tree_leaves(a), ff.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not all(torch.equal(u, v) for u, v in zip(_values(x), _values(y), strict=True)):
                return False
        elif x != y:
            return False
    return True


def _snapshot(tree: Any) -> Any:
    return ff.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _number(v: Any) -> float:
    return float(v) if isinstance(v, torch.Tensor) else v


# --------------------------------------------------------------------------- item 1: skip


def skip_nonfinite(kind: str, donate: bool, simulated: bool = False) -> dict:
    """Train good, NaN (rank 1's rows), good, Inf-gradient (rank 1's rows), good batches with
    ``apply_if_finite``; compare with plain ``adamw`` on the good batches only."""
    build, loss = MODELS[kind]
    model = build()
    good = [make_batch(kind, s) for s in range(3)]
    nan, inf = make_batch(kind, 10, "nan"), make_batch(kind, 11, "inf_grad")
    order = [good[0], nan, good[1], inf, good[2]]
    schedule = ff.linear_schedule(1e-2, 1e-3, transition_steps=4)
    mesh_cm = ff.simulated_mesh({"dp": 2}) if simulated else contextlib.nullcontext(None)
    with mesh_cm as sim:
        mesh = sim if simulated else ff.make_mesh({"dp": dist.get_world_size()})
        f = ff.fsdp(model, mesh)
        opt = ff.apply_if_finite(
            ff.adamw(schedule, eps=1e-6, weight_decay=0.01), max_consecutive_errors=3
        )
        step = ff.train_step(lambda p, b: loss(f, p, b), opt, model=f, donate=donate)
        state = ff.TrainState.create(f.shard(), opt)
        out: dict[str, Any] = {"metrics": [], "params_kept": [], "inner_kept": [], "types": []}
        for b in order:
            params, inner = _snapshot(state.params), _snapshot(state.opt_state.inner_state)
            state, m = step(state, b)
            out["metrics"].append({k: _number(v) for k, v in m.items()})
            out["types"].append(sorted({type(v).__name__ for v in m.values()}))
            out["params_kept"].append(_same(params, state.params))
            out["inner_kept"].append(_same(inner, state.opt_state.inner_state))
        ref_opt = ff.adamw(schedule, eps=1e-6, weight_decay=0.01)
        ref_step = ff.train_step(lambda p, b: loss(f, p, b), ref_opt, model=f)
        ref = ff.TrainState.create(f.shard(), ref_opt)
        ref_lr = []
        for b in good:
            ref, m = ref_step(ref, b)
            ref_lr.append(_number(m["lr"]))
        out["ref_lr"] = ref_lr
        out["params_equal_reference"] = _same(state.params, ref.params)
        inner_adam, ref_adam = state.opt_state.inner_state[0], ref.opt_state[0]
        out["moments_equal_reference"] = _same(inner_adam.mu, ref_adam.mu) and _same(
            inner_adam.nu, ref_adam.nu
        )
        out["count"] = int(_values(inner_adam.count)[0])
        out["loss_formatted"] = f"{out['metrics'][0]['loss']:.3f}"
    return out


# --------------------------------------------------------------------------- item 2: exceptions


class Boom(RuntimeError):
    """Raised on purpose by the tests."""


def _raising_transform() -> ff.GradientTransformation:
    def update(updates: Any, state: Any, params: Any = None) -> Any:
        raise Boom("a transformation after adamw raised (after the in-place update started)")

    return ff.GradientTransformation(lambda params: ff.EmptyState(), update)


def _failing_schedule(count: int) -> float:
    if count >= 1:
        raise Boom("the learning-rate schedule raised")
    return 1e-2


def exceptions_keep_state(simulated: bool = False) -> dict:
    """For each way a step can fail, with and without donation: does the input state stay
    alive, intact, and usable (its next step equal to one from an untouched state)?"""
    model = mlp()
    good = [make_batch("mlp", s) for s in range(2)]
    wrong = dict(good[1], x=torch.randn(BATCH, 5))  # 5 features for a Linear(6, ...)
    mesh_cm = ff.simulated_mesh({"dp": 2}) if simulated else contextlib.nullcontext(None)
    out: dict[str, Any] = {}
    with mesh_cm as sim:
        mesh = sim if simulated else ff.make_mesh({"dp": dist.get_world_size()})
        f = ff.fsdp(model, mesh)

        def plain(p: Any, b: Any) -> torch.Tensor:
            return mlp_loss(f, p, b)

        def loss_raises(p: Any, b: Any) -> torch.Tensor:
            raise Boom("loss_fn raised")

        adamw = ff.adamw(1e-2, weight_decay=0.01)
        cases = {
            "loss_fn": (adamw, loss_raises, good[1]),
            "bad_input": (adamw, plain, wrong),
            "schedule": (ff.adamw(_failing_schedule, weight_decay=0.01), plain, good[1]),
            "after_update": (ff.chain(adamw, _raising_transform()), plain, good[1]),
        }
        for name, (opt, failing_loss, failing_batch) in cases.items():
            for donate in (False, True):
                first = adamw if name == "after_update" else opt
                ok_step = ff.train_step(plain, adamw, model=f, donate=donate)
                bad_step = ff.train_step(failing_loss, opt, model=f, donate=donate)
                first_step = ff.train_step(plain, first, model=f)
                state, _ = first_step(ff.TrainState.create(f.shard(), first), good[0])
                if name == "after_update":  # the state of the chain (adamw, raising)
                    state = ff.TrainState(state.params, (state.opt_state, ff.EmptyState()), 1)
                kept = _snapshot((state.params, state.opt_state))
                try:
                    bad_step(state, failing_batch)
                    raised = "nothing"
                except Exception as e:
                    raised = type(e).__name__
                try:
                    intact = _same(kept, (state.params, state.opt_state)) and state.step == 1
                    alive = True
                except ff.DonatedStateError:
                    alive = intact = False
                usable = None
                if alive and name in ("loss_fn", "bad_input"):  # next step == one from a copy
                    copy = ff.TrainState(*_snapshot((state.params, state.opt_state)), 1)
                    again, m1 = ok_step(state, good[1])
                    expected, m2 = ok_step(copy, good[1])
                    usable = _same(again.params, expected.params) and float(m1["loss"]) == float(
                        m2["loss"]
                    )
                out[f"{name}/donate={donate}"] = {
                    "raised": raised,
                    "alive": alive,
                    "intact": intact,
                    "usable": usable,
                }
    return out


# --------------------------------------------------------------------------- item 4: no hangs


def _fresh_entry(
    rank: int, world: int, port: int, timeout_s: float, fn: Callable, args: tuple, results: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    code = 0
    try:
        ff.init_distributed(device_type="cpu", timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, "returned", fn(*args)))
    except BaseException as e:  # an uncaught exception: report it, then exit like a script
        results.put(
            (rank, "raised", {"type": type(e).__name__, "message": str(e), "at": time.time()})
        )
        code = 1
    results.close()
    results.join_thread()
    os._exit(code)  # no teardown of a process group that may be broken


def run_fresh(
    jobs: list[tuple[Callable, tuple]], world: int, timeout_s: float, limit: float = 90
) -> list[dict[int, tuple[str, Any]]]:
    """Run each ``(fn, args)`` of ``jobs`` at once, each on ``world`` new processes in its own
    gloo group whose collectives time out after ``timeout_s``; return, per job,
    ``{rank: (how, value)}``. Processes still alive after ``limit`` seconds are killed (and
    missing from the result), so a hang fails a test instead of stalling it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queues = [ctx.Queue() for _ in jobs]
    procs = []
    for (fn, args), results in zip(jobs, queues):
        port = free_port()
        procs += [
            ctx.Process(target=_fresh_entry, args=(r, world, port, timeout_s, fn, args, results))
            for r in range(world)
        ]
    for p in procs:
        p.start()
    out: list[dict[int, tuple[str, Any]]] = [{} for _ in jobs]
    deadline = time.monotonic() + limit
    for got, results in zip(out, queues):
        while len(got) < world and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                rank, how, value = results.get(timeout=0.5)
                got[rank] = (how, value)
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    return out


def _group_timeout(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def fail_inside_step(mode: str, timeout_s: float) -> dict:
    """Rank 1 raises inside the second step; ``mode="exit"``: its process then ends (as a
    script's uncaught exception does); ``"alive"``: it stays alive and issues no collective
    (a notebook, or a caught exception). Rank 0 reports what it got, and how soon."""
    rank = dist.get_rank()
    timeouts = {}
    if mode == "alive":  # the mesh axes' groups get the timeout too (DeviceMesh's new_group)
        two_d = ff.make_mesh({"dp": 2, "one": 1})
        timeouts = {a: _group_timeout(two_d.get_group(a)) for a in ("dp", "one")}
    mesh = ff.make_mesh({"dp": 2})
    torch.manual_seed(0)
    f = ff.fsdp(GPT(CFG), mesh)
    opt = ff.adamw(1e-2, weight_decay=0.01)
    batch = torch.randint(
        0, CFG.vocab_size, (BATCH, 13), generator=torch.Generator().manual_seed(0)
    )

    def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
        return lm_loss(f.apply(p, b[:, :-1]), b[:, 1:])

    def failing(p: Any, b: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            raise Boom("rank 1 fails inside the step")
        return loss_fn(p, b)

    state, _ = ff.train_step(loss_fn, opt, model=f)(ff.TrainState.create(f.shard(), opt), batch)
    kept = _snapshot((state.params, state.opt_state))
    start = time.monotonic()
    try:
        ff.train_step(failing, opt, model=f)(state, batch)
    except ff.CollectiveError as e:
        return {
            "error": str(e),
            "at": time.time(),
            "seconds": time.monotonic() - start,
            "intact": _same(kept, (state.params, state.opt_state)) and state.step == 1,
            "timeouts": timeouts,
        }
    except Boom:
        if mode == "exit":
            raise
        at = time.time()
        time.sleep(timeout_s + 2)  # alive, in no collective, until rank 0 has given up
        return {"at": at}
    return {"error": None}


# --------------------------------------------------------------------------- item 5: debug mode


def _rank() -> int:
    return dist.get_rank()


def _caught(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _healthy(mesh: Any) -> bool:
    """The group still works after a check raised (every rank raised at the same point)."""
    return float(ff.all_reduce(torch.ones(1), mesh, "dp")) == dist.get_world_size()


def mismatched_collectives() -> dict:
    mesh = ff.make_mesh({"dp": 2})
    shape = (4, 6) if _rank() == 0 else (6, 4)
    x = torch.arange(24.0).reshape(shape)
    out: dict[str, Any] = {"unchecked": tuple(ff.all_gather(x, mesh, "dp").shape)}
    with ff.check_collectives():
        out["all_gather"] = _caught(lambda: ff.all_gather(x, mesh, "dp"))
        out["healthy_after_all_gather"] = _healthy(mesh)
        # Sharded values of equal local size but other shapes: one flat bucket each.
        w = ff.Sharded(torch.zeros(shape), (shape[0] * 2, shape[1]), ff.P("dp"), mesh)
        out["gather"] = _caught(lambda: ff.gather(w, check=False))  # the debug check's turn
        # Rank 1 skips the all-gather and goes on to the next collective.
        if _rank() == 0:
            out["skipped"] = _caught(lambda: ff.all_gather(torch.ones(3), mesh, "dp"))
        else:
            out["skipped"] = _caught(lambda: ff.all_reduce(torch.ones(1), mesh, "dp"))
        out["healthy"] = _healthy(mesh)
    return out


def shard_checks() -> dict:
    mesh = ff.make_mesh({"dp": 2})
    torch.manual_seed(0)
    same = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    differs = dict(same, w=same["w"] + (0.5 if _rank() == 1 else 0.0))
    out: dict[str, Any] = {}
    with ff.check_collectives():
        out["same"] = _caught(lambda: ff.shard(same, mesh, ff.P("dp")))
        out["differs"] = _caught(lambda: ff.shard(differs, mesh, ff.P("dp")))
        out["healthy"] = _healthy(mesh)
    out["default"] = _caught(lambda: ff.shard(differs, mesh, ff.P("dp")))  # checked anyway
    out["unchecked"] = _caught(lambda: ff.shard(differs, mesh, ff.P("dp"), check=False))
    previous = os.environ.get("FUNCTIONAL_FSDP_CHECK")
    os.environ["FUNCTIONAL_FSDP_CHECK"] = "1"
    try:
        ff.init_distributed()  # the group exists: it only reads the switch (and a timeout)
        out["env_switch"] = checks._CHECK
        out["env_differs"] = _caught(lambda: ff.shard(differs, mesh, ff.P("dp")))
    finally:
        checks._CHECK = False
        if previous is None:
            os.environ.pop("FUNCTIONAL_FSDP_CHECK")
        else:
            os.environ["FUNCTIONAL_FSDP_CHECK"] = previous
    return out


def _equal_bucket_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Per rank: an MLP and a Llama whose shards hold other shapes but equal element counts.

    Rank 0: 8-8-16-4; rank 1: 8-8-12-8 (both 212 elements after the shared first layer).
    Llama: head_dim 8 and intermediate 64 on rank 0, head_dim 4 and intermediate 80 on rank 1
    (9216 elements per decoder layer either way); the root unit is the same.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hidden, out = (16, 4) if _rank() == 0 else (12, 8)
    L = torch.nn.Linear
    mlp = torch.nn.Sequential(
        L(8, 8), torch.nn.Tanh(), L(8, hidden), torch.nn.Tanh(), L(hidden, out)
    )
    options = {"head_dim": 8, "intermediate_size": 64}
    if _rank() == 1:
        options = {"head_dim": 4, "intermediate_size": 80}
    llama = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, **options))
    llama.config.use_cache = False
    return mlp, llama


def _unchecked_shard(f: ff.FSDP) -> dict[str, Any]:
    """``f.shard()`` without its check that every rank holds the same model."""
    params = {n: p.detach() for n, p in f.module.named_parameters()}
    return ff.shard(params, f.mesh, f.param_specs(), check=False)


def mismatched_models() -> dict:
    """Ranks running differently-shaped models whose buckets have equal sizes: the FSDP
    engine's collectives carry the parameters' names, shapes and specs, so the debug check
    catches it (forward all-gather; backward reduce-scatter) and names the parameters."""
    mesh = ff.make_mesh({"dp": 2})
    mlp, llama = _equal_bucket_models()
    x, ids = torch.randn(4, 8), torch.randint(0, 96, (2, 6))
    out: dict[str, Any] = {}
    f = ff.fsdp(mlp, mesh, units=[])  # one bucket: the whole model
    params = _unchecked_shard(f)  # f.shard() would compare the models first
    out["shard_numel"] = sum(p.local.numel() for p in params.values())
    out["unchecked"] = tuple(f.apply(params, x).shape)  # silently runs on mixed-up bytes
    with ff.check_collectives():
        out["mlp_forward"] = _caught(lambda: f.apply(params, x))
        out["healthy_after_forward"] = _healthy(mesh)
    # The backward's reduce-scatter (no regather: ZeRO-2), checked on its own.
    z2 = ff.fsdp(mlp, mesh, units=[], policy=ff.Policy(reshard_after_forward=False))
    leaves = {
        k: ff.Sharded(v.local.clone().requires_grad_(), v.global_shape, v.spec, mesh)
        for k, v in _unchecked_shard(z2).items()
    }
    loss = z2.apply(leaves, x).sum()
    with ff.check_collectives():
        out["mlp_backward"] = _caught(lambda: loss.backward())
        out["healthy"] = _healthy(mesh)
    g = ff.fsdp(llama, mesh)
    llama_params = _unchecked_shard(g)
    with ff.check_collectives():
        out["llama"] = _caught(lambda: g.apply(llama_params, input_ids=ids))
        out["healthy_after_llama"] = _healthy(mesh)
    return out


def _gpt_steps(steps: int, check: bool, cfg: Any = CFG) -> tuple[list[float], Any, float]:
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (BATCH, 13), generator=g) for _ in range(steps)]
    with ff.check_collectives(check):
        f = ff.fsdp(model, mesh)
        opt = ff.adamw(1e-2, weight_decay=0.01)
        step = ff.train_step(lambda p, b: lm_loss(f.apply(p, b[:, :-1]), b[:, 1:]), opt, model=f)
        state = ff.TrainState.create(f.shard(), opt)
        state, _ = step(state, data[0])  # warm-up
        losses = []
        dist.barrier()
        start = time.perf_counter()
        for b in data[1:]:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        seconds = (time.perf_counter() - start) / max(1, len(data) - 1)
    return losses, ff.gather(state.params), seconds


def checked_train_step() -> dict:
    """A checked FSDP train step computes bitwise what an unchecked one does."""
    losses, params, _ = _gpt_steps(3, check=False)
    checked_losses, checked_params, _ = _gpt_steps(3, check=True)
    return {"same": losses == checked_losses and _same(params, checked_params)}
