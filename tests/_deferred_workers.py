"""Workers for the deferred-initialisation tests (run on real gloo processes).

Each worker builds the same model twice with the same seed: eagerly (the reference) and on
the meta device, then creates the meta model's sharded parameters with ``init_sharded`` and
compares them with the eager model's, bitwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import functional_fsdp as ff
from functional_fsdp.fsdp.materialize import init_sharded
from functional_fsdp.models import GPT, GPTConfig, gpt_plan, lm_loss
from functional_fsdp.tp.plan import tensor_parallel
from functional_fsdp.train import local_batch

from ._hf import tiny_llama_config

GPT_CFG = GPTConfig(n_layer=2, vocab_size=64, n_embd=32, n_head=4, block_size=16)


def llama(tied: bool = True) -> nn.Module:
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


class ConvNet(nn.Module):
    """Plain torch modules with running-statistics buffers and a ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv1d(3, 8, 3)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.MultiheadAttention(8, 2))
            for _ in range(2)
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x).mean(-1)
        for layer in self.layers:
            h = layer[1](layer[0](h))
            h = h + layer[2](h[None], h[None], h[None], need_weights=False)[0][0]
        return self.head(h)


MODELS: dict[str, tuple[Callable[[], nn.Module], Any]] = {
    "gpt": (lambda: GPT(GPT_CFG), GPT._init),
    "llama": (lambda: llama(tied=False), None),
    "llama_tied": (lambda: llama(tied=True), None),
    "convnet": (ConvNet, None),
}


def _sharding(model: nn.Module, mesh: Any, tp: bool) -> ff.FSDP:
    if tp:
        plan = tensor_parallel(model, mesh, gpt_plan(GPT_CFG, loss_parallel=False))
        return ff.fsdp(model, mesh, specs=plan.specs, wrappers=plan.wrappers)
    return ff.fsdp(model, mesh)


def init_matches_eager(kind: str, axes: dict[str, int], tp: bool = False) -> dict[str, Any]:
    """Bitwise comparison of ``init_sharded`` on a meta model with the eager model."""
    build, init_fn = MODELS[kind]
    torch.manual_seed(0)
    eager = build()
    rng_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = build()
    mesh = ff.make_mesh(axes)
    sm = _sharding(meta, mesh, tp)
    params, buffers = init_sharded(sm, init_fn=init_fn)
    rng_same = torch.equal(torch.get_rng_state(), rng_after_eager)
    expected = _sharding(eager, mesh, tp).shard()
    full = ff.gather(params)
    ref = dict(eager.named_parameters())
    out: dict[str, Any] = {
        "keys": list(params) == list(expected),
        "local_mismatch": [
            k
            for k in expected
            if params[k].spec != expected[k].spec
            or not torch.equal(params[k].local, expected[k].local)
        ],
        "full_mismatch": [k for k in full if not torch.equal(full[k], ref[k].detach())],
        "buffer_mismatch": [n for n, b in eager.named_buffers() if not torch.equal(buffers[n], b)],
        "buffers": sorted(buffers),
        "rng_same": rng_same,
        "module_untouched": all(t.device.type == "meta" for t in meta.state_dict().values()),
    }
    if kind.startswith("llama"):
        ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(1))
        (x,) = local_batch((ids,), mesh, sm.data_axes)
        logits = sm.apply(params, x, buffers=buffers).logits
        reference = eager(x).logits
        out["forward_equal"] = torch.equal(logits, reference)
    if kind == "gpt":
        ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(1))
        (x,) = local_batch((ids,), mesh, sm.data_axes)
        loss = lm_loss(sm.apply(params, x), x)
        out["loss_close"] = abs(loss.item() - lm_loss(eager(x), x).item()) < 1e-5
    return out


def fsdp2_meta_recipe(world: int) -> dict[str, Any]:
    """torch FSDP2's recipe on the same meta GPT: fully_shard, to_empty, reset_parameters."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    eager = GPT(GPT_CFG)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPT_CFG)
    mesh = ff.make_mesh({"dp": world})
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with warnings.catch_warnings():  # "DTensor random operators may not have complete support"
        warnings.simplefilter("ignore", UserWarning)
        _reset_all(model)  # the recipe: every module's reset_parameters() on the DTensors
        model.apply(GPT._init)  # then the model's own init
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    ref = dict(eager.named_parameters())
    return {
        "mismatch": sorted(k for k in full if not torch.equal(full[k], ref[k].detach())),
        "numel": len(full),
    }


def _reset_all(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


# --------------------------------------------------------------------------- memory


def peak_allocated(fn: Callable[[], Any], held: Sequence[torch.Tensor] = ()) -> tuple[Any, int]:
    """``fn()``, and the most bytes of CPU tensors alive at once while it ran: ``held`` (the
    tensors the caller keeps throughout, e.g. the shards an export reads) plus every tensor
    ``fn`` makes.

    Measured with torch's ``MemTracker``, a dispatch mode that records every op's outputs by
    storage and forgets a storage when it is freed: exact allocated bytes, unlike resident
    memory, which the allocator and one-time imports blur.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*held)
    with tracker:
        out = fn()
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    return out, int(peak.get("Total", 0))


def model_bytes(sm: ff.FSDP) -> tuple[int, int]:
    """Ψ (parameter bytes, tied ones once) and the largest unit's bytes (the root included)."""
    sizes = {n: p.numel() * p.element_size() for n, p in sm.module.named_parameters()}
    units = {u: 0 for u in ["", *sm.units]}
    for name, nbytes in sizes.items():
        owner = max((u for u in sm.units if name.startswith(u + ".")), key=len, default="")
        units[owner] += nbytes
    return sum(sizes.values()), max(units.values())


def big_gpt_cfg(n_embd: int = 512, n_layer: int = 12) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, vocab_size=128, n_embd=n_embd, n_head=8, block_size=64)


def big_llama_config() -> Any:
    """An untied Llama of 81 MiB: 6 layers of 10.8 MiB, embedding and head 16 MiB."""
    return tiny_llama_config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


BIG: dict[str, tuple[Callable[[], nn.Module], Any]] = {
    "gpt": (lambda: GPT(big_gpt_cfg(n_embd=512, n_layer=6)), GPT._init),
    "llama": (lambda: _llama_from(big_llama_config()), None),
}


def _llama_from(config: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config)


def create_allocated(kind: str, eager_too: bool = False) -> dict[str, int]:
    """Bytes allocated at the peak of ``init_sharded`` on a meta model (and, optionally, of
    building the model eagerly and sharding it, which the same tracker must see whole)."""
    build, init_fn = BIG[kind]
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = build()
    sm = ff.fsdp(meta, ff.make_mesh({"dp": dist.get_world_size()}))
    psi, largest = model_bytes(sm)
    (params, _), peak = peak_allocated(lambda: init_sharded(sm, init_fn=init_fn))
    out = {
        "peak": peak,
        "psi": psi,
        "largest_unit": largest,
        "held": sum(p.local.numel() * p.local.element_size() for p in params.values()),
    }
    del params
    if eager_too:
        mesh = sm.mesh
        _, out["eager_peak"] = peak_allocated(lambda: ff.fsdp(build(), mesh).shard())
    dist.barrier()
    return out


# --------------------------------------------------------------------------- errors


class Scaled(nn.Module):
    """A module whose parameter nothing initialises on meta (no reset_parameters)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class ResetsChildren(nn.Module):
    """A root whose reset_parameters() writes a parameter of another unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.layers[0].bias)


ERROR_MODELS: dict[str, Callable[[], nn.Module]] = {
    "no_init": lambda: nn.Sequential(Scaled(4), Scaled(4)),
    "other_unit": ResetsChildren,
}


def init_error(kind: str) -> str:
    """The message init_sharded raises for a bad meta model (``"no error"`` if none)."""
    return _init_message(ERROR_MODELS[kind])


def init_seeded_per_rank(kind: str) -> str:
    """init_sharded's message on a meta model with every rank seeded differently
    (``"no error"`` if none)."""
    torch.manual_seed(dist.get_rank())
    return _init_message(SEEDED_MODELS[kind])


SEEDED_MODELS: dict[str, Callable[[], nn.Module]] = {
    "draws": lambda: nn.Linear(4, 4),
    "no_draws": lambda: nn.LayerNorm(4),
    "llama": lambda: llama(tied=False),  # transformers' own _init_weights draws
}


def _init_message(make: Callable[[], nn.Module]) -> str:
    """The message init_sharded raises for ``make()`` built on meta (``"no error"`` if none)."""
    with torch.device("meta"):
        model = make()
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    try:
        init_sharded(sm)
    except ValueError as e:
        return str(e)
    return "no error"
