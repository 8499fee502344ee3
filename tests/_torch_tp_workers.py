"""Workers for tests/test_torch_tp.py: torchtitan's Llama3 under plans in torch's TP styles.

The model and its reference parallelization are torchtitan's own (its package,
``torchtitan.models.llama3``: the model code and ``apply_tp``/``apply_fsdp``, which call torch's
``parallelize_module`` and ``fully_shard``). This library runs the same model with the PyTorch
TP tutorial's plan, written in torch's styles, through ``ff.parallelize_module``.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import functional_fsdp as ff
from functional_fsdp.train import local_batch

BATCH, SEQ = 4, 8


@functools.cache
def torchtitan() -> types.SimpleNamespace:
    """torchtitan's Llama3 model and parallelize functions.

    torchtitan imports its MoE Triton kernels at package import; CPU torch has no Triton, and
    a dense Llama never calls them, so that one module is stood in for before the import.
    """
    name = "torchtitan.models.moe.kernels"
    if name not in sys.modules:
        kernels = types.ModuleType(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torchtitan's MoE Triton kernels are not available on CPU")

        kernels.generate_permute_indices = kernels.fill_indices_wrapper = unavailable  # type: ignore[attr-defined]
        sys.modules[name] = kernels
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, apply_tp
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    return types.SimpleNamespace(
        Transformer=Transformer,
        Args=TransformerModelArgs,
        apply_tp=apply_tp,
        apply_fsdp=apply_fsdp,
        cross_entropy_loss=cross_entropy_loss,
    )


def new_model() -> torch.nn.Module:
    tt = torchtitan()
    args = tt.Args(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
        max_seq_len=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tt.Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 128, (BATCH, SEQ), generator=g),
        torch.randint(0, 128, (BATCH, SEQ), generator=g),
    )


def tutorial_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """The PyTorch TP tutorial's Llama plan in torch's styles, as one nested plan."""
    logits = Shard(-1) if loss_parallel else Replicate()
    if not sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=logits, use_local_output=not loss_parallel),
            "layers.*": {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
            },
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=logits, use_local_output=not loss_parallel
        ),
        "layers.*": {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        },
    }


def mesh_2d() -> Any:
    return ff.make_mesh({"dp": dist.get_world_size() // 2, "tp": 2})


# --------------------------------------------------------------------------- the three runs


def one_process(model: torch.nn.Module, steps: int) -> dict[str, Any]:
    """One process, the global batch, torch.optim.AdamW."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], {}
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": dict(ref.named_parameters())}


def torchtitan_run(model, mesh, sequence_parallel: bool, loss_parallel: bool, steps: int):
    """torchtitan's own FSDP2+TP: its apply_tp (sequence parallel) or, without sequence
    parallelism, torch's parallelize_module with the same plan; then its apply_fsdp."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
    from torch.distributed.tensor.parallel import parallelize_module

    tt = torchtitan()
    ref = copy.deepcopy(model)
    if sequence_parallel:
        tt.apply_tp(ref, mesh["tp"], loss_parallel, enable_float8_tensorwise_tp=False)
    else:
        parallelize_module(ref, mesh["tp"], tutorial_plan(False, loss_parallel))
    tt.apply_fsdp(ref, mesh["dp"], torch.float32, torch.float32, pp_enabled=False)
    for m in ref.modules():  # gloo has no PREMUL_SUM (its division by 1.0): a plain sum
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], {}
    for step in range(steps):
        x, y = batch(step)
        x, y = local_batch(x, mesh, ("dp",)), local_batch(y, mesh, ("dp",))
        # torchtitan's loss: a sum over this rank's tokens over the global token count, its
        # gradients summed over dp (apply_fsdp turns FSDP2's division off).
        with torch_loss_parallel() if loss_parallel else torch.enable_grad():
            loss = tt.cross_entropy_loss(ref(x), y) / (BATCH * SEQ)
            loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        total = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        losses.append(ff.all_reduce(total.detach(), mesh, ("dp",)).item())
    params = {n: p.full_tensor() for n, p in ref.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def ours(model, mesh, sequence_parallel: bool, loss_parallel: bool, steps: int):
    """This library: ff.parallelize_module with the plan in torch's styles, ff.fsdp, ff.adamw."""
    tp = ff.parallelize_module(model, mesh["tp"], tutorial_plan(sequence_parallel, loss_parallel))
    f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers, units=["layers.*"])

    def loss_fn(params, x, y):
        logits = f.apply(params, x)
        if loss_parallel:
            return ff.vocab_parallel_cross_entropy(logits, y, mesh)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    params = f.shard()
    opt = ff.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    losses, grads = [], {}
    for step in range(steps):
        x, y = local_batch(batch(step), mesh, f.data_axes)
        g, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        if step == 0:
            grads = ff.gather(g)
        updates, state = opt.update(g, state, params)
        params = ff.apply_updates(params, updates)
        losses.append(ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean").item())
    return {"losses": losses, "grads": grads, "params": ff.gather(params)}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in b)


def compare(sequence_parallel: bool, loss_parallel: bool, steps: int = 5) -> dict[str, Any]:
    """Step-1 loss and gradients and ``steps`` AdamW steps: ours vs torchtitan vs one process."""
    model = new_model()
    mesh = mesh_2d()
    single = one_process(model, steps)
    titan = torchtitan_run(model, mesh, sequence_parallel, loss_parallel, steps)
    mine = ours(model, mesh, sequence_parallel, loss_parallel, steps)
    out: dict[str, Any] = {"losses": mine["losses"]}
    for name, other in (("single", single), ("titan", titan)):
        out[f"loss_vs_{name}"] = max(abs(a - b) for a, b in zip(mine["losses"], other["losses"]))
        out[f"grad_vs_{name}"] = _rel(mine["grads"], other["grads"])
        out[f"param_vs_{name}"] = max(
            (mine["params"][k] - v.detach()).abs().max().item() for k, v in other["params"].items()
        )
    return out


# --------------------------------------------------------------------------- every style


class Inner(torch.nn.Module):
    """A block whose input comes by keyword (``inner(h=x)``)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.proj1 = torch.nn.Linear(d, hidden)
        self.proj2 = torch.nn.Linear(hidden, d)

    def forward(self, *, h: torch.Tensor) -> torch.Tensor:
        return self.proj2(torch.tanh(self.proj1(h)))


class Pool(torch.nn.Module):
    """No parameters: replicated compute on a gathered input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x.mean(dim=1, keepdim=True))


class Toy(torch.nn.Module):
    """One module per kind of torch style and layout change."""

    def __init__(self, vocab: int = 32, d: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)
        self.norm = torch.nn.LayerNorm(d)
        self.inner = Inner(d, hidden)
        self.norm2 = torch.nn.LayerNorm(d)
        self.pool = Pool()
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.up(self.emb(ids)))
        x = self.norm(self.down(x))  # sequence-split from here
        x = self.norm2(x + self.inner(h=x))
        return self.head(self.pool(x))  # gathered again


def toy_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return {
        "emb": ColwiseParallel(output_layouts=Replicate()),  # the embedding dim split
        "up": ColwiseParallel(output_layouts=Replicate()),
        "down": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
        "inner": {
            "": PrepareModuleInputOutput(
                input_kwarg_layouts={"h": Shard(1)},
                desired_input_kwarg_layouts={"h": Replicate()},
                output_layouts=Replicate(),
                desired_output_layouts=Shard(1),
            ),
            "proj1": ColwiseParallel(),
            "proj2": RowwiseParallel(),
        },
        "norm2": SequenceParallel(use_local_output=True),
        "pool": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        ),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def toy_compare() -> dict[str, float]:
    """Every accepted style: ours vs torch's parallelize_module (DTensor, loss_parallel) vs
    one process, on a {"dp": world / 2, "tp": 2} mesh."""
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    torch.manual_seed(0)
    model = Toy()
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)
    single = copy.deepcopy(model)
    loss = F.cross_entropy(single(ids).flatten(0, 1), tgt.flatten())
    loss.backward()
    want = {n: p.grad for n, p in single.named_parameters()}

    mesh = mesh_2d()
    x, y = local_batch((ids, tgt), mesh, ("dp",))
    theirs = parallelize_module(copy.deepcopy(model), mesh["tp"], toy_plan())
    with loss_parallel():
        their_loss = F.cross_entropy(theirs(x).flatten(0, 1), y.flatten())
        their_loss.backward()
    their_grads = {
        n: ff.all_reduce(p.grad.full_tensor(), mesh, ("dp",), op="mean")
        for n, p in theirs.named_parameters()
    }
    their_loss = ff.all_reduce(their_loss.full_tensor().detach(), mesh, ("dp",), op="mean")

    tp = ff.parallelize_module(model, mesh["tp"], toy_plan())
    f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)

    def loss_fn(params, x, y):
        return ff.vocab_parallel_cross_entropy(f.apply(params, x), y, mesh)

    grads, mine = torch.func.grad_and_value(loss_fn)(f.shard(), x, y)
    grads = ff.gather(grads)
    mine = ff.all_reduce(mine.detach(), mesh, f.data_axes, op="mean")
    return {
        "loss_vs_single": abs(mine.item() - loss.item()),
        "loss_vs_torch": abs(mine.item() - their_loss.item()),
        "grad_vs_single": _rel(grads, want),
        "grad_vs_torch": _rel(grads, their_grads),
        "styles": sorted({type(s).__name__ for s in tp.styles.values()}),
    }
