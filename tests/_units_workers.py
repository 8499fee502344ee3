"""Workers for the default units (tests/test_units.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import functional_fsdp as ff


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 2 * dim),
            nn.Linear(2 * dim, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class DictLayers(nn.Module):
    """Blocks kept in an ``nn.ModuleDict``, as torchtitan keeps its layers."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n)})
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.out(x)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def loss_and_grads(model: nn.Module, mesh: Any | None) -> dict[str, Any]:
    """Loss and full gradients: one process (``mesh=None``) or ``ff.fsdp``'s default units."""
    x, y = data()
    if mesh is None:
        params = {n: p.detach() for n, p in model.named_parameters()}
        grads, loss = torch.func.grad_and_value(
            lambda p: F.mse_loss(torch.func.functional_call(model, p, (x,)), y)
        )(params)
        return {"loss": loss.item(), "grads": grads}
    f = ff.fsdp(model, mesh)
    xs, ys = ff.local_batch((x, y), mesh, f.data_axes)

    def loss_fn(p: dict[str, Any]) -> torch.Tensor:
        return F.mse_loss(f.apply(p, xs), ys)  # gradients: averaged over dp by the library

    with ff.count_comms() as comms:
        grads, loss = torch.func.grad_and_value(loss_fn)(f.shard())
    return {
        "loss": ff.all_reduce(loss, mesh, f.data_axes, op="mean").item(),
        "grads": ff.gather(grads),
        "units": f.units,
        "gathers": comms.count("all_gather"),
    }


def gloo_module_dict_units() -> dict[str, Any]:
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    torch.manual_seed(0)
    model = DictLayers()
    ours, ref = loss_and_grads(model, mesh), loss_and_grads(model, None)
    return {
        "units": ours["units"],
        "gathers": ours["gathers"],
        "loss_diff": abs(ours["loss"] - ref["loss"]),
        "grad_err": max((ours["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items()),
        "grad_norm": sum(g.square().sum() for g in ref["grads"].values()).sqrt().item(),
    }
