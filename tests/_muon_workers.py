"""The library's side of tests/test_muon.py: Muon cases by name, the params and gradient
sequences, and the runs on gloo ranks (FSDP, ZeRO's optimizer shards, HSDP, dp x tp)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import functional_fsdp as ff
from functional_fsdp.optim import muon as M

MDN = ff.contrib.MuonDimensionNumbers
SHAPES = {"w": (7, 3), "c": (3, 7), "q": (5, 5), "t": (2, 3, 4), "b": (3,), "embed": (6, 4)}


def params(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for k, s in SHAPES.items()
    }


def grads(steps: int, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            k: (0.3 * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype)
            for k, s in SHAPES.items()
        }
        for _ in range(steps)
    ]


def by_name(path: str, p: Any) -> Any:
    """Matrices by name: embeddings to Adam, the 3-D leaf as two (3, 4) matrices."""
    if "embed" in path or p.ndim == 1:
        return None
    return MDN(1, 2) if p.ndim == 3 else MDN()


def decay_matrices(p: Any) -> Any:
    return {k: len(SHAPES[k]) == 2 for k in p}


DIMS_TREE = {"w": MDN(1, 0), "c": MDN(), "q": None, "t": MDN((0, 1), 2), "b": None, "embed": MDN()}


def _options(**budget: Any) -> ff.GradientTransformation:
    """Every option of optax's signature, positional where optax's order allows."""
    return ff.contrib.muon(
        2e-2,
        "dion",
        5,
        0.9,
        1e-7,
        0.1,
        decay_matrices,
        nesterov=False,
        adaptive=True,
        preconditioning="aol",
        adam_b1=0.8,
        adam_weight_decay=0.01,
        adam_learning_rate=5e-3,
        muon_weight_dimension_numbers=DIMS_TREE,
        consistent_rms=0.2,
        **budget,
    )


CASES: dict[str, Callable[[], ff.GradientTransformation]] = {
    "defaults": lambda: ff.contrib.muon(1e-2, muon_weight_dimension_numbers=by_name),
    "options": lambda: _options(),
    "schatten": lambda: ff.contrib.muon(
        1e-2, ns_steps=4, preconditioning="schatten", muon_weight_dimension_numbers=by_name
    ),
    "spectral": lambda: ff.contrib.muon(
        1e-2, preconditioning="spectral", muon_weight_dimension_numbers=by_name
    ),
    # Composition: the global norm spans every rank's blocks; the rate lives in the state;
    # counts become tensors under apply_if_finite; MultiSteps accumulates first.
    "clip_chain": lambda: ff.chain(
        ff.clip_by_global_norm(0.5), ff.contrib.muon(1e-2, muon_weight_dimension_numbers=by_name)
    ),
    "inject_schedule": lambda: ff.inject_hyperparams(ff.contrib.muon)(
        learning_rate=ff.warmup_cosine_decay_schedule(0.0, 2e-2, 3, 20), weight_decay=0.05
    ),
    "apply_if_finite": lambda: ff.apply_if_finite(
        ff.contrib.muon(1e-2, muon_weight_dimension_numbers=by_name), 2
    ),
    "multi_steps": lambda: ff.MultiSteps(
        ff.contrib.muon(1e-2, muon_weight_dimension_numbers=by_name), 2
    ),
    # Over matrix_budget_bytes=90 (float32: q 100 B, t 96 B; float64: every matrix), a
    # matrix is orthogonalized by all ranks together; optax's numbers are the same.
    "split": lambda: ff.contrib.muon(
        1e-2, muon_weight_dimension_numbers=by_name, matrix_budget_bytes=90
    ),
    "split_options": lambda: _options(matrix_budget_bytes=90),
    "split_spectral": lambda: ff.contrib.muon(
        1e-2,
        preconditioning="spectral",
        muon_weight_dimension_numbers=by_name,
        matrix_budget_bytes=90,
    ),
    "split_schatten": lambda: ff.contrib.muon(
        1e-2,
        ns_steps=4,
        preconditioning="schatten",
        muon_weight_dimension_numbers=by_name,
        matrix_budget_bytes=90,
    ),
}
BUDGET = {"split": 90, "split_options": 90, "split_spectral": 90, "split_schatten": 90}


def run(name: str, p: Any, steps: list[Any]) -> Any:
    opt = CASES[name]()
    state = opt.init(p)
    for g in steps:
        updates, state = opt.update(g, state, p)
        p = ff.apply_updates(p, updates)
    return p


# --------------------------------------------------------------------------- on gloo ranks

LAYOUTS = {
    # FSDP / ZeRO-3: every leaf split over dp (unevenly); ZeRO-1/2's optimizer shards are
    # the same layout (the step hands the optimizer reduce-scattered gradients).
    "fsdp": ({"dp": 2}, {k: ff.P("dp") for k in SHAPES}),
    "columns": (
        {"dp": 2},
        {
            "w": ff.P(None, "dp"),
            "c": ff.P(None, "dp"),
            "q": ff.P("dp"),
            "t": ff.P(None, "dp"),
            "b": ff.P(),
            "embed": ff.P(None, "dp"),
        },
    ),
    "ddp": ({"dp": 2}, {k: ff.P() for k in SHAPES}),
    "fsdp4": ({"dp": 4}, {k: ff.P("dp") for k in SHAPES}),
    "hsdp": ({"replicate": 2, "shard": 2}, {k: ff.P("shard") for k in SHAPES}),
    "dp_tp": (
        {"dp": 2, "tp": 2},
        {
            "w": ff.P(("tp", "dp")),
            "c": ff.P("dp", "tp"),
            "q": ff.P("tp"),
            "t": ff.P(None, "dp", "tp"),
            "b": ff.P("dp"),
            "embed": ff.P(None, "tp"),
        },
    ),
}


def on_ranks(names: list[tuple[str, str, str]], steps: int) -> dict[str, Any]:
    """Each (layout, case, dtype) run on sharded leaves, gathered; and the Newton-Schulz
    calls of this rank (by leaf shape) in the first layout's first step."""
    out: dict[str, Any] = {}
    calls: list[tuple[int, ...]] = []
    split_calls: list[tuple[int, ...]] = []
    original, original_split = M.orthogonalize_via_newton_schulz, M.orthogonalize_split

    def counted(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return original(x, *args, **kw)

    def counted_split(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        split_calls.append(tuple(args[-1].shape))
        return original_split(x, *args, **kw)

    meshes: dict[tuple[tuple[str, int], ...], Any] = {}
    for layout, name, dtype_name in names:
        axes, specs = LAYOUTS[layout]
        key = tuple(axes.items())
        if key not in meshes:
            meshes[key] = ff.make_mesh(axes)
        mesh = meshes[key]
        dtype = getattr(torch, dtype_name)
        p = ff.shard(params(dtype), mesh, specs)
        seq = [ff.shard(g, mesh, specs) for g in grads(steps, dtype)]
        calls.clear()
        split_calls.clear()
        M.orthogonalize_via_newton_schulz = counted
        M.orthogonalize_split = counted_split
        try:
            opt = CASES[name]()
            state = opt.init(p)
            with ff.count_comms() as comms:
                for i, g in enumerate(seq):
                    updates, state = opt.update(g, state, p)
                    p = ff.apply_updates(p, updates)
                    if i == 0:
                        first_calls, first_split = list(calls), list(split_calls)
        finally:
            M.orthogonalize_via_newton_schulz = original
            M.orthogonalize_split = original_split
        out[f"{layout}/{name}/{dtype_name}"] = {
            "params": {k: v.clone() for k, v in ff.gather(p).items()},
            "calls": first_calls,
            "split_calls": first_split,
            "all_to_all": comms.bytes("all_to_all") // steps,
        }
    return out


# --------------------------------------------------------------------------- a Llama


def llama_rule(path: str, p: Any) -> Any:
    """Hidden matrices to Muon (torch's [out, in] layout); embeddings, head, norms to Adam."""
    if p.ndim != 2 or "embed" in path or "lm_head" in path:
        return None
    return MDN(1, 0)


# gate, up and down (40 x 24 float32, 3,840 B) over it: split; q, k, v, o (2,304 B) whole.
LLAMA_BUDGET = 3000


def llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from ._hf import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=24, intermediate_size=40))
    model.config.use_cache = False
    return model


def llama_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 96, (4, 9), generator=g) for _ in range(steps)]


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:])


def llama_reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, plain tensors: the numbers every layout must give."""
    model = llama()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = ff.contrib.muon(2e-2, muon_weight_dimension_numbers=llama_rule)

    def loss(p: Any, ids: torch.Tensor) -> torch.Tensor:
        return _lm_loss(torch.func.functional_call(model, p, (ids[:, :-1],)).logits, ids)

    step = ff.train_step(loss, opt, batch="local")
    state = ff.TrainState.create(params, opt)
    for ids in llama_batches(steps):
        state, _ = step(state, ids)
    return dict(state.params)


def llama_on_ranks(layouts: list[str], steps: int) -> dict[str, Any]:
    """``train_step`` with Muon on a Llama: FSDP with donation; FSDP compiled by ``ff.jit``
    (traced into one graph); ZeRO-2 (params replicated, optimizer shards over dp) under
    master_weights; FSDP + TP on (dp, tp); ``*_split``: with the MLP's matrices over
    ``matrix_budget_bytes``, orthogonalized by all ranks together."""
    out: dict[str, Any] = {}
    world = torch.distributed.get_world_size()
    for layout in layouts:
        model = llama()
        rule = llama_rule
        budget = LLAMA_BUDGET if layout.endswith("_split") else None
        opt: ff.GradientTransformation = ff.contrib.muon(
            2e-2, muon_weight_dimension_numbers=rule, matrix_budget_bytes=budget
        )
        create: dict[str, Any] = {}
        donate = False
        if layout in ("fsdp_donate", "fsdp_jit", "fsdp_split"):
            mesh = ff.make_mesh({"dp": world})
            f = ff.fsdp(model, mesh)
            donate = layout == "fsdp_donate"
        elif layout == "zero2_masters":
            mesh = ff.make_mesh({"dp": world})
            f = ff.fsdp(model, mesh, specs=ff.P())
            opt = ff.master_weights(opt, param_dtype=torch.float32)
            create = {"opt_specs": ff.P("dp")}
        else:  # dp x tp: the model's TP plan, FSDP over dp on top
            from functional_fsdp.models import llama_plan

            mesh = ff.make_mesh({"dp": 2, "tp": world // 2})
            tp = ff.tensor_parallel(model, mesh, llama_plan(model.config, loss_parallel=False))
            f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)
        step = ff.train_step(
            lambda p, ids, f=f: _lm_loss(f.apply(p, ids[:, :-1]).logits, ids),
            opt,
            model=f,
            donate=donate,
        )
        if layout == "fsdp_jit":  # the whole step, Muon's all-to-alls included, one graph
            step = ff.jit(step, backend="eager")
        state = ff.TrainState.create(f.shard(), opt, **create)
        captured: list[Any] = []
        with ff.count_comms() as comms, _capturing_exchange(captured, layout != "fsdp_jit"):
            for ids in llama_batches(steps):
                state, _ = step(state, ids)
        params = ff.gather(state.params)
        out[layout] = {
            "params": {k: v.clone() for k, v in params.items()},
            "all_to_all": comms.bytes("all_to_all") // steps,
            "all_reduce": comms.bytes("all_reduce") // steps,
            "exchange_peak": _exchange_peak(*captured[0]) if captured else None,
        }
    return out


@contextlib.contextmanager
def _capturing_exchange(captured: list[Any], on: bool) -> Iterator[None]:
    """Keep a copy of the first exchange's matrices (the step's own momentum blocks)."""
    original = M._on_owners

    def capture(mesh: Any, leaves: list[Any], ns: Any) -> list[torch.Tensor]:
        if on and not captured:
            captured.append((mesh, [x._replace(local=x.local.clone()) for x in leaves]))
        return original(mesh, leaves, ns)

    M._on_owners = capture
    try:
        yield
    finally:
        M._on_owners = original


def _identity(x: torch.Tensor, dims: Any, split: Any = None) -> torch.Tensor:
    return x


def _exchange_peak(mesh: Any, leaves: list[Any]) -> int:
    """The peak of tensor memory the exchange adds on this rank, measured by torch's
    profiler, with Newton-Schulz replaced by the identity (its result is then the matrix
    whole: the same bytes, without its temporaries); the least of 3 runs."""
    torch.distributed.barrier()
    return min(
        ff.tensor_peak(lambda: M._on_owners(mesh, leaves, _identity)).added_bytes for _ in range(3)
    )


# --------------------------------------------------------------------------- checkpoints


def _fsdp_state(world: int) -> tuple[Any, Any, Any]:
    mesh = ff.make_mesh({"dp": world})
    specs = {k: ff.P("dp") for k in SHAPES}
    p = ff.shard(params(), mesh, specs)
    opt = CASES["defaults"]()
    return mesh, specs, (p, opt.init(p))


def _steps(state: Any, mesh: Any, specs: Any, seq: list[Any]) -> Any:
    opt = CASES["defaults"]()
    p, s = state
    for g in seq:
        updates, s = opt.update(ff.shard(g, mesh, specs), s, p)
        p = ff.apply_updates(p, updates)
    return p, s


def checkpoint_save(path: str, steps: int, half: int) -> dict[str, torch.Tensor]:
    """``half`` steps on these ranks, saved; and the uninterrupted run's params."""
    world = torch.distributed.get_world_size()
    mesh, specs, state = _fsdp_state(world)
    seq = grads(steps)
    state = _steps(state, mesh, specs, seq[:half])
    ff.checkpoint.save(path, state)
    p, _ = _steps(state, mesh, specs, seq[half:])
    return {k: v.clone() for k, v in ff.gather(p).items()}


def checkpoint_resume(path: str, steps: int, half: int) -> dict[str, torch.Tensor]:
    """The saved state loaded onto these ranks, then the remaining steps."""
    world = torch.distributed.get_world_size()
    mesh, specs, template = _fsdp_state(world)
    state = ff.checkpoint.load(path, template)
    p, _ = _steps(state, mesh, specs, grads(steps)[half:])
    return {k: v.clone() for k, v in ff.gather(p).items()}
