"""Worker functions for the compiled-step tests (``ff.jit``): eager and compiled steps side
by side on real gloo processes, from the same state and the same batches.

A case is ``(mesh axes, model, ff.fsdp kwargs, TrainState.create kwargs, train_step kwargs)``.
The optimizer is ``chain(clip_by_global_norm, adamw)`` (the clip uses the step's gradient
norm: one all-reduce), wrapped in ``apply_if_finite`` where a case says so.
"""

from __future__ import annotations

import time
from typing import Any

import optree
import torch

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, MLPModel, gpt_plan, lm_loss

LR = 1e-2
# An MLP with uneven widths (no dim divides by 4: padded shards) and no degenerate
# parameter: AdamW divides by the root of the second moment, so a parameter whose exact
# gradient is zero (a GPT's key bias) would turn rounding noise into steps of size lr.
SIZES = (12, 30, 18, 6)
GPT_CFG = GPTConfig(n_layer=2, vocab_size=40, n_embd=32, n_head=4, block_size=16)

CASES: dict[str, dict[str, Any]] = {
    "ddp": dict(axes={"dp": 2}, fsdp=dict(specs=ff.P())),
    "zero1": dict(
        axes={"dp": 2},
        fsdp=dict(specs=ff.P()),
        create=dict(opt_specs=ff.P("dp")),
        step=dict(accumulate=2, accumulate_mode="local"),
    ),
    "zero2": dict(axes={"dp": 2}, fsdp=dict(specs=ff.P()), create=dict(opt_specs=ff.P("dp"))),
    "shard_grad_op": dict(axes={"dp": 2}, fsdp=dict(policy=ff.Policy(reshard_after_forward=False))),
    "zero3": dict(axes={"dp": 2}),
    "zero3_accumulate": dict(axes={"dp": 2}, step=dict(accumulate=2)),
    "zero3_local_accumulate": dict(
        axes={"dp": 2}, step=dict(accumulate=2, accumulate_mode="local")
    ),
    "zero3_checkpointed": dict(
        axes={"dp": 2}, fsdp=dict(policy=ff.Policy(activation_checkpointing=True))
    ),
    "apply_if_finite": dict(axes={"dp": 2}, finite=True),
    "frozen": dict(axes={"dp": 2}, frozen=True),
    "peft_lora": dict(axes={"dp": 2}, model="llama"),
    "zero3_dp4": dict(axes={"dp": 4}),
    "hsdp": dict(axes={"replicate": 2, "shard": 2}),
    "fsdp_tp": dict(axes={"dp": 2, "tp": 2}, model="gpt"),
}


def _model(case: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    if case.get("model") == "gpt":
        model = GPT(GPT_CFG)
        for block in model.blocks:  # softmax ignores a key bias: its exact gradient is 0
            block.attn.wk.register_parameter("bias", None)
        return model
    if case.get("model") == "llama":  # peft LoRA on a transformers Llama: a frozen base
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from ._hf import tiny_llama_config

        base = LlamaForCausalLM(tiny_llama_config(use_cache=False))
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(base, config)
        for name, p in model.named_parameters():  # B = 0 would make the first steps trivial
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model
    model = MLPModel(SIZES)
    if case.get("frozen"):  # the first layer is a frozen base
        model.layers[0].requires_grad_(False)
    return model


def _batches(case: dict[str, Any], n: int) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    if case.get("model") in ("gpt", "llama"):
        vocab = GPT_CFG.vocab_size if case["model"] == "gpt" else 96
        return [torch.randint(0, vocab, (8, 9), generator=g) for _ in range(n)]
    out = [
        (torch.randn(8, SIZES[0], generator=g), torch.randn(8, SIZES[-1], generator=g))
        for _ in range(n)
    ]
    if case.get("finite"):  # a NaN in rank 1's rows of step 3, an inf in rank 0's of step 6
        x, y = out[3]
        out[3] = (x.clone().index_fill_(0, torch.tensor([6]), float("nan")), y)
        x, y = out[6]
        out[6] = (x.clone().index_fill_(0, torch.tensor([1]), float("inf")), y)
    return out


def setup(name: str, donate: bool) -> tuple[Any, Any, Any, list[Any]]:
    """``(step, fresh_state, sharded_model, batches)`` of a case."""
    case = CASES[name]
    mesh = ff.make_mesh(case["axes"])
    model = _model(case)
    fsdp_kwargs = dict(case.get("fsdp", {}))
    if case.get("model") == "gpt":  # FSDP over dp on top of Megatron's TP over tp
        tp = ff.tensor_parallel(model, mesh, gpt_plan(GPT_CFG, loss_parallel=False))
        fsdp_kwargs.update(specs=tp.specs, wrappers=tp.wrappers)
    sm = ff.fsdp(model, mesh, **fsdp_kwargs)
    opt = ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(LR, weight_decay=0.1))
    if case.get("finite"):
        opt = ff.apply_if_finite(opt, max_consecutive_errors=5)

    if case.get("model") == "gpt":

        def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
            return lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:])
    elif case.get("model") == "llama":

        def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
            return sm.apply(p, input_ids=b, labels=b).loss
    else:

        def loss_fn(p: Any, b: Any) -> torch.Tensor:
            return (sm.apply(p, b[0]) - b[1]).pow(2).mean()

    step = ff.train_step(loss_fn, opt, model=sm, donate=donate, **case.get("step", {}))
    create = dict(case.get("create", {}))
    if case.get("frozen") or case.get("model") == "llama":
        create["trainable"] = sm

    def fresh() -> ff.TrainState:
        return ff.TrainState.create(sm.shard(), opt, **create)

    return step, fresh, sm, _batches(case, 40)


def _names(tree: Any) -> list[str]:
    paths, _, _ = optree.tree_flatten_with_path(tree, namespace="functional_fsdp")
    return [".".join(map(str, p)) for p in paths]


def _floats(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree`` (counts are ints eagerly, tensors compiled)."""
    return [
        t for t in ff.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = a.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


# This worker's compiled donating steps, by (case, backend), with their case's fresh state and
# batches: many_steps goes on with the step compare compiled instead of compiling it again
# (tens of seconds on 2 cores; compare's zero3 compiles with inductor's caches off).
_DONATING: dict[tuple[str, str], tuple[Any, Any, list[Any]]] = {}


def compare(
    name: str, backend: str, steps: int, donate: bool = False, code: bool = False
) -> dict[str, Any]:
    """``steps`` eager and ``steps`` compiled steps from the same state and batches: the
    largest relative differences of losses and parameters, the collectives of each (eager
    ``count_comms``, the compiled step's ``count_comms``, its graph's), compilations, and
    whether donation wrote the new parameters into the old buffers."""
    torch._inductor.config.compile_threads = 1  # two ranks share two cores
    step, fresh, _, batches = setup(name, donate)
    fast = ff.jit(step, backend=backend)
    codes: list[str] = []
    if code:  # caches off, so that inductor writes (and we read) its code
        from torch._inductor.utils import run_and_get_code

        with torch._inductor.config.patch(force_disable_caches=True):
            compiled, codes = run_and_get_code(lambda: fast.lower(fresh(), batches[0]))
    else:
        compiled = fast.lower(fresh(), batches[0])
    graph_comms = fast.comms(fresh(), batches[0]).records

    def run(fn: Any) -> tuple[Any, list[torch.Tensor], list[Any], float, list[Any]]:
        state, losses, metrics = fresh(), [], []
        start = time.perf_counter()
        with ff.count_comms() as comms:
            for b in batches[:steps]:
                state, m = fn(state, b)
                losses.append(m["loss"])
                metrics.append(m)
        return state, losses, comms.records, time.perf_counter() - start, metrics

    eager, eager_losses, eager_comms, _, eager_metrics = run(step)
    state, losses, comms, _, metrics = run(fast)
    pe, pc = ff.tree_leaves(eager.params), ff.tree_leaves(state.params)
    oe, oc = _floats(eager.opt_state), _floats(state.opt_state)
    moved = [_rel(a, b) for a, b in zip(ff.tree_leaves(fresh().params), pe)]
    out = {
        "loss": max(abs(a - b).item() / abs(a).item() for a, b in zip(eager_losses, losses)),
        "params": max(_rel(a, b) for a, b in zip(pe, pc)),
        "worst": max(zip((_rel(a, b) for a, b in zip(pe, pc)), _names(eager.params))),
        "opt_state": max((_rel(a.float(), b.float()) for a, b in zip(oe, oc)), default=0.0),
        "moved": max(moved),
        "step": int(state.step),
        "compilations": fast.compilations,
        "comms_equal": eager_comms == comms == list(graph_comms) * steps,
        "n_comms": len(graph_comms),
        "trace_s": compiled.trace_seconds,
        "compile_s": compiled.compile_seconds,
        "skipped": [bool(m.get("skipped", False)) for m in metrics],
        "eager_skipped": [bool(m.get("skipped", False)) for m in eager_metrics],
    }
    if code:
        out["overlap"] = _overlap(codes)
        out["gathers"] = sorted(
            {str(n.target) for n in compiled.graph.graph.nodes if "gather" in str(n.target)}
        )
    if donate:
        _DONATING[name, backend] = (fast, fresh, batches)
        before = fresh()
        ptrs = [t.data_ptr() for t in ff.tree_leaves(before.params)]
        after, _ = fast(before, batches[0])
        out["in_place"] = ptrs == [t.data_ptr() for t in ff.tree_leaves(after.params)]
        try:
            before.params  # noqa: B018 - must raise: donated
            out["old_state_dead"] = False
        except ff.DonatedStateError:
            out["old_state_dead"] = True
    return out


def many_steps(name: str, backend: str, steps: int) -> dict[str, Any]:
    """``steps`` compiled steps from a fresh state: how many compilations the compiled step
    has taken in all (compare's steps included when this worker compiled it there)."""
    torch._inductor.config.compile_threads = 1
    if (name, backend) in _DONATING:
        fast, fresh, batches = _DONATING[name, backend]
    else:
        step, fresh, _, batches = setup(name, donate=True)
        fast = ff.jit(step, backend=backend)
    state = fresh()
    for i in range(steps):
        state, m = fast(state, batches[i % len(batches)])
    return {"compilations": fast.compilations, "step": int(state.step), "loss": float(m["loss"])}


def _overlap(codes: list[str]) -> dict[str, Any]:
    """For every collective in inductor's generated code, in the order issued: its kind and
    the compute kernels issued between it and its wait."""
    import re

    start = re.compile(
        r"(\w+) = torch\.ops\.(?:_c10d_functional|functional_fsdp)\.(\w+)\.default\("
    )
    in_place = re.compile(r"^torch\.ops\._c10d_functional\.(all_reduce)_\.default\((?:\w+\()?(\w+)")
    wait = re.compile(r"wait_tensor\.default\((?:reinterpret_tensor\()?(\w+)")
    compute = re.compile(r"^(cpp_fused|extern_kernels\.)")
    alias = re.compile(r"^(\w+) = (\w+)$")
    kinds = {"all_gather_into_tensor": "all_gather", "gloo_all_gather": "all_gather"}
    kinds |= {"all_to_all_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
    pending: dict[str, tuple[int, int]] = {}
    found: list[tuple[str, int] | None] = []
    kernels = 0
    for line in (x.strip() for code in codes for x in code.splitlines()):
        if line.startswith("#"):
            continue
        if (m := alias.match(line)) and m.group(2) in pending:  # an op's result, renamed
            pending[m.group(1)] = pending.pop(m.group(2))
        elif (m := wait.search(line)) and m.group(1) in pending:
            i, issued = pending.pop(m.group(1))
            found[i] = (found[i][0], kernels - issued)  # type: ignore[index]
        elif (m := start.match(line)) and "wait_tensor" not in line:
            pending[m.group(1)] = (len(found), kernels)
            found.append((kinds.get(m.group(2), m.group(2)), -1))
        elif m := in_place.match(line):
            pending[m.group(2)] = (len(found), kernels)
            found.append((m.group(1), -1))
        elif compute.match(line):
            kernels += 1
    return {"gaps": found, "kernels": kernels}
