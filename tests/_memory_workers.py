"""Workers for tests/test_memory.py: the tensor memory a step adds, against torch FSDP2."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import functional_fsdp as ff
from functional_fsdp.distributed import collectives as C
from functional_fsdp.models import GPT, GPTConfig, lm_loss


def gather_holds_its_output_once() -> dict[str, Any]:
    """A bucketed all-gather on gloo: the tensor memory it adds, its output's size, and
    whether each row holds that rank's parts."""
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = [torch.full((1000,), float(rank)), torch.full((24, 10), float(rank) + 0.5)]
    C.wait(C.raw_all_gather_parts(parts, mesh, "dp"))  # warm-up: the group's first use
    out: list[torch.Tensor] = []
    found = ff.tensor_peak(lambda: out.append(C.wait(C.raw_all_gather_parts(parts, mesh, "dp"))))
    gathered = out[0]
    expected = torch.stack(
        [torch.cat([torch.full((1000,), float(r)), torch.full((240,), r + 0.5)]) for r in range(n)]
    )
    return {
        "added": found.added_bytes,
        "output": gathered.numel() * gathered.element_size(),
        "equal": torch.equal(gathered, expected),
    }


def _gpt() -> tuple[nn.Module, list[nn.Module], Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    return model, list(model.blocks), lambda m, x: m(x)


def _llama() -> tuple[nn.Module, list[nn.Module], Any]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    return model, list(model.model.layers), lambda m, x: m(input_ids=x).logits


def step_peaks(model_name: str, repeats: int = 3, compiled: bool = False) -> dict[str, float]:
    """The least tensor peak of ``repeats`` SGD steps of this library under ``torch.func``
    (plain and ``train_step(donate=True)``; with ``compiled``, that step under ``ff.jit``
    instead) and of torch FSDP2, on one model and batch."""
    model, blocks, forward = {"gpt": _gpt, "llama": _llama}[model_name]()
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    g = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, 512, (4, 129), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]

    sharded = ff.fsdp(model, mesh)
    opt = ff.sgd(1e-3)

    def loss_fn(p: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm_loss(forward(_Apply(sharded, p), b[0]), b[1])

    state = {"params": sharded.shard()}
    state["opt"] = opt.init(state["params"])

    def ours() -> None:
        params = state["params"]
        grads = torch.func.grad(loss_fn)(params, (x, y))
        updates, state["opt"] = opt.update(grads, state["opt"], params)
        state["params"] = ff.apply_updates(params, updates)

    step = ff.train_step(loss_fn, opt, model=sharded, batch="local", donate=True)
    donated = {"state": ff.TrainState.create(sharded.shard(), opt)}

    def ours_donated() -> None:
        donated["state"], _ = step(donated["state"], (x, y))

    jitted = ff.jit(step)

    def ours_compiled() -> None:
        donated["state"], _ = jitted(donated["state"], (x, y))

    ref = copy.deepcopy(model)
    for block in _same_blocks(ref, model, blocks):
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)

    def fsdp2() -> None:
        lm_loss(forward(ref, x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)

    systems = {"ours": ours, "ours_donated": ours_donated, "fsdp2": fsdp2}
    if compiled:
        systems = {"ours_compiled": ours_compiled, "fsdp2": fsdp2}
    for fn in systems.values():  # warm-up: first calls build caches and groups
        fn()
    peaks = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            peaks[name].append(ff.tensor_peak(fn).added_bytes)
    return {name: float(min(v)) for name, v in peaks.items()}


class _Apply:
    """A callable module stand-in: ``sharded.apply(params, ...)``."""

    def __init__(self, sharded: ff.FSDP, params: Any) -> None:
        self.sharded, self.params = sharded, params

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.sharded.apply(self.params, *args, **kwargs)


def _same_blocks(ref: nn.Module, model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks of ``ref`` (a deep copy of ``model``) at the paths ``blocks`` have there."""
    paths = {id(m): name for name, m in model.named_modules()}
    return [ref.get_submodule(paths[id(b)]) for b in blocks]
