"""Models whose buffers ``init_sharded`` cannot initialise by itself (tests/test_init_advice.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import functional_fsdp as ff


class CachedRoPE(nn.Module):
    """A rotary cache computed by a method of its own (non-persistent buffer)."""

    def __init__(self, dim: int = 8, length: int = 16) -> None:
        super().__init__()
        self.dim, self.length = dim, length
        self.register_buffer("cache", torch.empty(length, dim), persistent=False)
        self._build_cache()

    def _build_cache(self) -> None:
        inv = 1.0 / 10000 ** (torch.arange(0, self.dim, 2, device=self.cache.device) / self.dim)
        angles = torch.outer(torch.arange(self.length, device=self.cache.device), inv)
        self.cache = torch.cat([angles.cos(), angles.sin()], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cache[: x.shape[-2]]


class WithRoPE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rope = CachedRoPE()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.rope(x))


class PlainRoPE(nn.Module):
    """A rotary cache computed in ``__init__`` alone, as most hand-written ones are."""

    def __init__(self, dim: int = 8, length: int = 16) -> None:
        super().__init__()
        inv = 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)
        angles = torch.outer(torch.arange(length), inv)
        self.register_buffer("cache", torch.cat([angles.cos(), angles.sin()], -1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cache[: x.shape[-2]]


class InitWeights(nn.Module):
    """The model's own ``_init_weights(module)`` writes the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.rope, self.proj = PlainRoPE(), nn.Linear(8, 8)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, PlainRoPE):
            module.cache = torch.full_like(module.cache, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.rope(x))


def init_message_and_fix() -> dict[str, Any]:
    """On real processes: the error for a meta model's rotary cache, then its own advice
    followed: the cache equals the eagerly built model's."""
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    torch.manual_seed(0)  # the same on every rank (the Linear's init draws)
    with torch.device("meta"):
        model = WithRoPE()
    try:
        ff.init_sharded(ff.fsdp(model, mesh))
        message = None
    except ValueError as e:
        message = str(e)
    torch.manual_seed(0)
    _, buffers = ff.init_sharded(
        ff.fsdp(model, mesh),
        init_fn=lambda m: m._build_cache() if isinstance(m, CachedRoPE) else None,
    )
    return {"message": message, "equal": torch.equal(buffers["rope.cache"], WithRoPE().rope.cache)}
