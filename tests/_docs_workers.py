"""Worker side of the docs tests: run one code block of the docs on a rank, then check it.

A block runs as a fresh ``torchrun`` process would run it: in its own ``__main__`` namespace,
with a random seed that differs per rank (so a block that forgets to seed shows it), in a
working directory of its own. Each check then compares what the block computed with a
single-process reference built from the block's own (unchanged) model.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff


@contextlib.contextmanager
def _cwd(path: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def execute(source: str, filename: str, cwd: str | None = None) -> dict[str, Any]:
    """Run ``source`` as a script would run; return its namespace."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(torch.initial_seed() + 7919 * (rank + 1))  # as fresh processes differ
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": filename}
    with _cwd(cwd) if cwd else contextlib.nullcontext():
        exec(compile(source, filename, "exec"), namespace)
    return namespace


def run_block(source: str, filename: str, check: str | None, cwd: str) -> Any:
    """Run a docs block on this rank, then the named check on its namespace."""
    namespace = execute(source, filename, cwd)
    if check is None:
        return None
    with _cwd(cwd):
        return CHECKS[check](namespace)


# --------------------------------------------------------------------------- checks


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> float:
    err = float((a.float() - b.float()).abs().max())
    if not err <= atol:
        raise AssertionError(f"max abs error {err:.3g} > {atol:g}")
    return err


def check_one_screen(ns: dict[str, Any]) -> dict[str, float]:
    """The step's loss and the torch.func gradients against one process on the global batch."""
    from functional_fsdp.models import lm_loss

    model, batch = ns["model"], ns["global_batch"]
    before = {n: p.detach() for n, p in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (batch[:, :-1],))
        return lm_loss(logits, batch[:, 1:])

    out = {"loss": _close(ns["metrics"]["loss"], loss(before), 1e-5)}
    # The gradients of the block's last lines are taken at the updated parameters.
    after = ff.gather(ns["state"].params)
    reference = torch.func.grad(loss)(after)
    grads = ff.gather(ns["grads"])
    if set(grads) != {n for n, p in model.named_parameters() if p.requires_grad}:
        raise AssertionError(f"gradients for {sorted(grads)}")
    out["grads"] = max(_close(grads[n], reference[n], 1e-6) for n in grads)
    return out


def check_lora(ns: dict[str, Any]) -> dict[str, float]:
    """The exported adapter and merged model, reloaded with transformers + peft, against the
    sharded model's own forward (bf16 compute, hence the tolerance)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = ns["batch"]
    sharded = ns["sharded_model"].apply(
        ns["state"].params, input_ids=batch, labels=batch, buffers=ns["buffers"]
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained("llama-dir")
    peft_model = PeftModel.from_pretrained(base, "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained("merged").eval()
    with torch.no_grad():
        via_peft = peft_model(input_ids=batch, labels=batch)
        via_merged = merged(input_ids=batch, labels=batch)
    trained = ff.gather({n: ns["state"].params[n] for n in ns["sharded_model"].trainable})
    if not any(
        n.endswith("lora_B.default.weight") and t.abs().sum() > 0 for n, t in trained.items()
    ):
        raise AssertionError("the step did not change lora_B")
    return {
        "peft": _close(via_peft.logits, sharded.logits, 0.05),
        "merged": _close(via_merged.logits, via_peft.logits, 1e-4),
    }


def check_2d(ns: dict[str, Any]) -> dict[str, float]:
    """The FSDP+TP loss against one process on the same batch."""
    from functional_fsdp.models import lm_loss

    with torch.no_grad():
        reference = lm_loss(ns["model"](ns["x"]), ns["y"])
    loss = ns["loss"]  # a (sum, count): this rank's batch is the whole batch
    return {"loss": _close(loss.sum / loss.count, reference, 1e-5)}


def notebook_variant(source: str) -> str:
    """The block as its mesh line's comment says to run it in a notebook.

    ``mesh = ff.make_mesh(...)  # torchrun; in a notebook: EXPR`` becomes ``mesh = EXPR``;
    nothing else changes.
    """
    lines = source.splitlines()
    for i, line in enumerate(lines):
        found = re.match(r"^(\s*mesh = )ff\.make_mesh\(.*#.*in a notebook: (.+?)\s*$", line)
        if found:
            lines[i] = found.group(1) + found.group(2)
            return "\n".join(lines) + "\n"
    raise AssertionError("the block has no `mesh = ff.make_mesh(...)  # ... in a notebook: ...`")


def run_one_screen_simulated(source: str, filename: str) -> dict[str, float]:
    """The one screen in its notebook form (a persistent simulated mesh), in this process:
    each simulated rank's step loss and torch.func gradients against one process on the
    global batch."""
    source = notebook_variant(source)
    try:
        ns = execute(source, filename)
        if not ff.is_simulated():
            raise AssertionError("the notebook form did not start a simulated mesh")
        world = ff.axis_size(ns["mesh"], "dp")
        grads = {n: ff.rank_values(g) for n, g in ff.gather(ns["grads"]).items()}
        after = {n: ff.rank_values(p) for n, p in ff.gather(ns["state"].params).items()}
        loss = ff.rank_values(ns["metrics"]["loss"])
        # Made inside the simulation, the model and batch hold one tensor per rank.
        batches = ff.rank_values(ns["global_batch"])
        before = {n: ff.rank_values(p.detach()) for n, p in ns["model"].named_parameters()}
    finally:
        ff.end_simulation()
    from functional_fsdp.models import lm_loss

    model = ns["model"]
    if not all(torch.equal(b, batches[0]) for b in batches):
        raise AssertionError("the simulated ranks hold different global batches")

    def on(values: list[torch.Tensor], r: int) -> torch.Tensor:
        return values[r if len(values) > 1 else 0]

    def reference(params: dict[str, torch.Tensor], r: int) -> torch.Tensor:
        batch = on(batches, r)
        logits = torch.func.functional_call(model, params, (batch[:, :-1],))
        return lm_loss(logits, batch[:, 1:])

    if {len(v) for v in grads.values()} != {world}:
        raise AssertionError(f"expected one gradient per simulated rank ({world})")
    out = {
        "loss": max(
            _close(v, reference({n: on(p, 0) for n, p in before.items()}, 0), 1e-5) for v in loss
        )
    }
    errors = []
    for r in range(world):
        expected = torch.func.grad(reference)({n: on(v, r) for n, v in after.items()}, r)
        errors += [_close(grads[n][r], expected[n], 1e-6) for n in grads]
    out["grads"] = max(errors)
    return out


def check_jit(ns: dict[str, Any]) -> dict[str, float]:
    """The compiled steps against the same steps eager from a fresh state: one compilation,
    losses and parameters within inductor's rounding."""
    compiled, step, model = ns["compiled"], ns["step"], ns["sharded_model"]
    if compiled.compilations != 1:
        raise AssertionError(f"{compiled.compilations} compilations for 5 steps")
    state = ff.TrainState.create(model.shard(), ns["optimizer"])
    for batch in ns["batches"]:
        state, metrics = step(state, batch)
    out = {"loss": _close(ns["metrics"]["loss"], metrics["loss"], 1e-5)}
    eager, jitted = ff.gather(state.params), ff.gather(ns["state"].params)
    # AdamW turns rounding in the key bias's gradient (exactly 0: softmax ignores it) into
    # steps of up to lr; measured 1.2e-5 after 5 steps at lr 3e-3.
    out["params"] = max(_close(jitted[n], eager[n], 1e-4) for n in eager)
    return out


CHECKS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "one_screen": check_one_screen,
    "lora": check_lora,
    "2d": check_2d,
    "jit": check_jit,
}
