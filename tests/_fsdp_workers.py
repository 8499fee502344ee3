"""Worker functions for the real multi-process FSDP tests (imported by the gloo workers)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss
from functional_fsdp.train import local_batch

CFG = GPTConfig(n_layer=2, vocab_size=61, n_embd=36, n_head=3, block_size=16)
BATCH = 8


def gpt_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, 12), generator=g)
    return idx, torch.randint(0, CFG.vocab_size, (BATCH, 12), generator=g)


def reference(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor):
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads, loss = torch.func.grad_and_value(
        lambda p: lm_loss(torch.func.functional_call(model, p, (idx,)), tgt)
    )(params)
    return loss, grads


def fsdp_vs_reference(axes: dict, policy_kwargs: dict, use_func: bool = True):
    """Loss and gathered grads of ff.fsdp vs the single-process reference; also the live memory."""
    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch()
    ref_loss, ref_grads = reference(model, idx, tgt)
    mesh = ff.make_mesh(axes)
    f = ff.fsdp(model, mesh, policy=ff.Policy(**policy_kwargs))
    params = f.shard()
    x, y = local_batch((idx, tgt), mesh, f.data_axes)
    with ff.count_comms() as comms:
        if use_func:
            grads, loss = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(params)
        else:
            leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
            ps = {k: v.replace(leaves[k]) for k, v in params.items()}
            loss = lm_loss(f.apply(ps, x), y)
            loss.backward()
            grads = {k: v.replace(leaves[k].grad) for k, v in params.items()}
    full = ff.gather(grads)
    loss_mean = ff.all_reduce(loss.detach(), mesh, f.data_axes, op="mean")
    err = max((full[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    return {
        "loss": loss_mean.item(),
        "ref_loss": ref_loss.item(),
        "grad_err": err,
        "comms": comms.by_kind_and_axis(),
        "psi": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def fsdp2_reference(n_layers_units: bool = True):
    """Loss and full grads from torch FSDP2 fully_shard on the same model and batch."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    x, y = local_batch((idx, tgt), mesh, ("dp",))
    loss = lm_loss(ref(x), y)
    loss.backward()
    fsdp2 = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
    f = ff.fsdp(model, mesh)
    grads, ours = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(f.shard())
    full = ff.gather(grads)
    return {
        "loss_diff": abs(loss.item() - ours.item()),
        "grad_err": max((full[k] - fsdp2[k]).abs().max().item() for k in fsdp2),
    }


# --------------------------------------------------------------------------- issue 3's edge cases

CFG4 = GPTConfig(n_layer=4, vocab_size=61, n_embd=36, n_head=3, block_size=16)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def memory_proof(policy_kwargs: dict) -> dict:
    """Real storage of the gathered parameters while a 4-block GPT runs, and the tracker's view.

    A forward pre-hook on each block's MLP (inside the unit, where the unit's parameters are
    the gathered tensors) records every unit's gathered tensors seen so far and how many
    bytes of storage each unit still holds. Plain autograd, so tensors are not wrapped.
    """
    from functional_fsdp.fsdp.memory import track_memory

    torch.manual_seed(0)
    model = GPT(CFG4)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    f = ff.fsdp(model, mesh, policy=ff.Policy(**policy_kwargs))
    params = f.shard()
    idx, tgt = gpt_batch()
    x, y = local_batch((idx, tgt), mesh, ("dp",))
    seen: dict[str, list[torch.Tensor]] = {}
    snapshots: list[dict] = []
    running: dict[str, torch.nn.Module] = {}  # the per-call copies FSDP.apply runs

    def enter(key: str):
        def hook(module, args):
            running[key] = module

        return hook

    def probe(unit: str):
        def hook(module, args):
            if "" not in seen:  # the root's gathered tensors, as set on the call's copy
                root = running[""]
                seen[""] = [root.tok_emb.weight, root.pos_emb.weight, *root.ln_f.parameters()]
            seen[unit] = list(running[unit].parameters())
            snapshots.append(
                {
                    "unit": unit,
                    "real": {u: _storage_bytes(ts) for u, ts in seen.items()},
                    "tracked": tracker.live_units,
                    "tracked_bytes": tracker.live_bytes,
                }
            )

        return hook

    handles = [model.register_forward_pre_hook(enter(""))]
    for i, b in enumerate(model.blocks):
        handles.append(b.register_forward_pre_hook(enter(f"blocks.{i}")))
        handles.append(b.mlp.register_forward_pre_hook(probe(f"blocks.{i}")))
    try:
        with track_memory() as tracker:
            leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
            loss = lm_loss(f.apply({k: v.replace(leaves[k]) for k, v in params.items()}, x), y)
            after_forward = {u: _storage_bytes(ts) for u, ts in seen.items()}
            tracked_after_forward = tracker.live_units
            loss.backward()
            after_backward = {u: _storage_bytes(ts) for u, ts in seen.items()}
    finally:
        for h in handles:
            h.remove()
    unit_bytes = {e.unit: e.bytes for e in tracker.events if e.kind == "gather"}
    grads = ff.gather({k: v.replace(leaves[k].grad) for k, v in params.items()})
    _, ref_grads = reference(model, idx, tgt)
    return {
        "snapshots": snapshots,
        "unit_bytes": unit_bytes,
        "after_forward": after_forward,
        "tracked_after_forward": tracked_after_forward,
        "after_backward": after_backward,
        "tracked_after_backward": tracker.live_units,
        "peak_forward": tracker.peak_units("forward", exclude=("",)),
        "peak_backward": tracker.peak_units("backward", exclude=("",)),
        "backward_alive": [
            e.live_units for e in tracker.events if e.phase == "backward" and e.kind == "compute"
        ],
        "grad_err": max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
        "unwaited": torch._C._distributed_c10d._get_work_registry_size(),
    }


def bf16_vs_fsdp2() -> dict:
    """Loss and grads with a bf16 param dtype and fp32 reduction: ours vs FSDP2's policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch()
    ref_loss, ref_grads = reference(model, idx, tgt)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    x, y = local_batch((idx, tgt), mesh, ("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    other = copy.deepcopy(model)
    for block in other.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(other, mesh=mesh, mp_policy=mp)
    fsdp2_loss = lm_loss(other(x), y)
    fsdp2_loss.backward()
    fsdp2 = {n: p.grad.full_tensor() for n, p in other.named_parameters()}
    policy = ff.Policy(
        mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    f = ff.fsdp(model, mesh, policy=policy)
    with ff.count_comms() as comms:
        grads, loss = torch.func.grad_and_value(lambda p: lm_loss(f.apply(p, x), y))(f.shard())
    full = ff.gather(grads)
    scale = max(g.abs().max().item() for g in fsdp2.values())
    return {
        "loss_vs_fsdp2": abs(loss.item() - fsdp2_loss.item()),
        "loss_vs_fp32": abs(
            ff.all_reduce(loss.detach(), mesh, ("dp",), op="mean").item() - ref_loss.item()
        ),
        "grad_err_vs_fsdp2": max((full[k] - fsdp2[k]).abs().max().item() for k in fsdp2) / scale,
        "grad_err_vs_fp32": max((full[k] - ref_grads[k]).abs().max().item() for k in fsdp2) / scale,
        "grad_dtypes": sorted({str(g.dtype) for g in full.values()}),
        "gather_dtypes": sorted({str(r.dtype) for r in comms.records if r.kind == "all_gather"}),
    }


class Reuse(torch.nn.Module):
    """``blocks[0]`` runs twice per forward (both times on an input that needs a gradient, so
    its backward needs the gathered weight of each call), ``blocks[2]`` only without ``skip``;
    ``blocks[1]`` holds a parameter that no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
        self.blocks[1].register_parameter("unused", torch.nn.Parameter(torch.ones(4)))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        x = torch.tanh(self.blocks[1](x))
        x = torch.tanh(self.blocks[0](x))
        if not skip:
            x = torch.tanh(self.blocks[2](x))
        x = torch.tanh(self.blocks[0](x))
        return self.head(x)


def reuse_and_skip(use_func: bool) -> list[dict]:
    """Two steps of ``Reuse`` (all units, then ``skip=True``) against the single-process grads."""
    torch.manual_seed(0)
    model = Reuse()
    x_all = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    f = ff.fsdp(model, mesh)
    params = f.shard()
    x = local_batch(x_all, mesh, ("dp",))
    out = []
    for skip in (False, True):
        ref = torch.func.grad(
            lambda p: torch.func.functional_call(model, p, (x_all,), {"skip": skip}).pow(2).mean()
        )({k: v.detach() for k, v in model.named_parameters()})
        with ff.count_comms() as comms:
            if use_func:
                grads = torch.func.grad(lambda p: f.apply(p, x, skip=skip).pow(2).mean())(params)
            else:
                leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
                f.apply({k: v.replace(leaves[k]) for k, v in params.items()}, x, skip=skip).pow(
                    2
                ).mean().backward()
                local = {
                    k: v.replace(leaves[k].grad)
                    for k, v in params.items()
                    if leaves[k].grad is not None
                }
        full = ff.gather(grads) if use_func else {k: None for k in params} | ff.gather(local)
        out.append(
            {
                "err": max(
                    (g - ref[k]).abs().max().item() for k, g in full.items() if g is not None
                ),
                "none": sorted(k for k, g in full.items() if g is None),
                "zero": sorted(k for k, g in full.items() if g is not None and not g.any()),
                "comms": comms.by_kind_and_axis(),
                "unwaited": torch._C._distributed_c10d._get_work_registry_size(),
            }
        )
    return out


def mlp_uneven(sizes: tuple[int, ...]) -> dict:
    """An MLP with dims that do not divide the world size, under torch.func and autograd."""
    from functional_fsdp.models import MLPModel

    torch.manual_seed(0)
    model = MLPModel(sizes)
    x_all = torch.randn(8, sizes[0], generator=torch.Generator().manual_seed(2))
    ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x_all,)).pow(2).mean())(
        {k: v.detach() for k, v in model.named_parameters()}
    )
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    f = ff.fsdp(model, mesh, units=["layers.*"])
    params = f.shard()
    x = local_batch(x_all, mesh, ("dp",))
    grads = ff.gather(torch.func.grad(lambda p: f.apply(p, x).pow(2).mean())(params))
    leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
    f.apply({k: v.replace(leaves[k]) for k, v in params.items()}, x).pow(2).mean().backward()
    autograd = ff.gather({k: v.replace(leaves[k].grad) for k, v in params.items()})
    return {
        "func_err": max((grads[k] - ref[k]).abs().max().item() for k in ref),
        "autograd_err": max((autograd[k] - ref[k]).abs().max().item() for k in ref),
        "padding_only": [
            k for k, v in params.items() if v.global_shape[0] <= dist.get_rank() * v.local.shape[0]
        ],
    }


def memory_proofs(policies: list[dict]) -> list[dict]:
    """:func:`memory_proof` for several policies in one call (one round trip to the pool)."""
    return [memory_proof(p) for p in policies]


def autograd_step_frees_without_gc() -> dict:
    """Whether a plain-autograd step lets go of its inputs when the caller drops them, without
    Python's cycle collector (a reference cycle through autograd nodes would keep the step's
    shards, gradients and gathered tensors alive)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    f = ff.fsdp(model, mesh)
    params = f.shard()
    idx, tgt = gpt_batch()
    gc.disable()
    try:
        # The second step is probed: torch's first call of some ops leaves a cycle of its own.
        for _ in range(2):
            leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
            probe = weakref.ref(leaves["blocks.1.mlp.fc1.weight"])
            loss = lm_loss(f.apply({k: v.replace(leaves[k]) for k, v in params.items()}, idx), tgt)
            loss.backward()
            had_grad = probe().grad is not None  # type: ignore[union-attr]
            del loss, leaves
        return {"had_grad": had_grad, "collected": probe() is None}
    finally:
        gc.enable()


def single_parameter_units() -> dict:
    """Units of one parameter (a one-piece gather), torch.func and autograd: shards untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6, bias=False), torch.nn.Tanh(), torch.nn.Linear(6, 2, bias=False)
    )
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    f = ff.fsdp(model, mesh)
    params = f.shard()
    before = {k: v.local.clone() for k, v in params.items()}
    x_all = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    x = local_batch(x_all, mesh, ("dp",))
    ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x_all,)).sum())(
        {k: v.detach() for k, v in model.named_parameters()}
    )
    grads = ff.gather(
        torch.func.grad(lambda p: f.apply(p, x).sum() * dist.get_world_size())(params)
    )
    leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
    loss = f.apply({k: v.replace(leaves[k]) for k, v in params.items()}, x).sum()
    (loss * dist.get_world_size()).backward()
    autograd = ff.gather({k: v.replace(leaves[k].grad) for k, v in params.items()})
    return {
        "units": f.units,
        "shards_intact": all(torch.equal(before[k], v.local) for k, v in params.items()),
        "err": max(
            max((grads[k] - ref[k]).abs().max().item(), (autograd[k] - ref[k]).abs().max().item())
            for k in ref
        ),
    }
