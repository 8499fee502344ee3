"""Worker functions for the Hugging Face / safetensors I/O tests (real gloo processes)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.models import GPT, lm_loss

from ._deferred_workers import big_llama_config, model_bytes, peak_allocated
from ._fsdp_workers import CFG
from ._train_workers import LR, OPT, adamw_trajectory, batches

# Tiny Llama; vocab 122 does not divide by 4, so world size 4 pads the embedding's rows.
LLAMA = dict(
    vocab_size=122,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def llama(meta: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**LLAMA))
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def lora_model(seed: int = 1) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    base = llama()
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    config.init_lora_weights = False  # random B as well as A: a non-trivial adapter
    return get_peft_model(base, config)


def _rank0(x):
    return x if dist.get_rank() == 0 else None


def _padding_is_zero(params: dict[str, ff.Sharded]) -> bool:
    for v in params.values():
        slices, _ = v.layout.owned(
            {a: int(c) for a, c in zip(v.mesh.mesh_dim_names, v.mesh.get_coordinate())}
        )
        rest = v.local.clone()
        rest[tuple(slice(0, s.stop - s.start) for s in slices)] = 0
        if rest.abs().sum() != 0:
            return False
    return True


def load_export_llama(axes: dict, src: str, out: str, max_shard_size: str) -> dict | None:
    """Load a save_pretrained directory shard-wise into a meta-device Llama, export it again."""
    model = llama(meta=True)
    sm = ff.fsdp(model, ff.make_mesh(axes))
    params = ff.checkpoint.load_safetensors(sm, src)
    local_numel = sum(v.local.numel() for v in params.values())
    padding_zero = _padding_is_zero(params)
    ff.checkpoint.export_safetensors(sm, params, out, max_shard_size=max_shard_size)
    full = ff.gather(params)
    return _rank0(
        {
            "full": full,
            "local_numel": local_numel,
            "padding_zero": padding_zero,
            "meta": all(p.is_meta for p in model.parameters()),
        }
    )


def _trajectory(sm, params: dict, steps: int) -> tuple[list[float], dict]:
    opt = ff.adamw(LR, **OPT)
    step = ff.train_step(lambda p, b: lm_loss(sm.apply(p, b[:, :-1]), b[:, 1:]), opt, model=sm)
    state = ff.TrainState.create(params, opt)
    losses = []
    for b in batches(steps):
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses, ff.gather(state.params)


def gpt_shardwise_vs_eager(file: str, out: str, steps: int) -> dict | None:
    """Train from a shard-wise load and from an eager load (full file, then shard)."""
    from safetensors.torch import load_file

    torch.manual_seed(123)  # a different init: every value must come from the file
    model = GPT(CFG)
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    shardwise = ff.checkpoint.load_safetensors(sm, file)
    full = load_file(file)
    eager = sm.shard({n: full.get(n, full.get("head.weight")) for n in sm.param_specs()})
    same_locals = all(torch.equal(shardwise[k].local, eager[k].local) for k in eager)
    losses_a, params_a = _trajectory(sm, shardwise, steps)
    losses_b, params_b = _trajectory(sm, eager, steps)
    ff.checkpoint.export_safetensors(sm, shardwise, out)
    state_dict = ff.checkpoint.full_state_dict(sm, shardwise)
    fresh = GPT(CFG)
    missing = fresh.load_state_dict(state_dict, strict=True)
    return _rank0(
        {
            "same_locals": same_locals,
            "losses": (losses_a, losses_b),
            "params": (params_a, params_b),
            "state_dict": state_dict,
            "strict_ok": not missing.missing_keys and not missing.unexpected_keys,
            "tied_after_load": fresh.head.weight is fresh.tok_emb.weight,
        }
    )


def reference_from_file(file: str, steps: int) -> tuple[list[float], dict]:
    """Single process, full global batch, from the file's weights."""
    from safetensors.torch import load_file

    model = GPT(CFG)
    full = load_file(file)
    params = {n: full.get(n, full.get("head.weight")).clone() for n, _ in model.named_parameters()}
    return adamw_trajectory(model, params, steps)


def fsdp2_save(path: str, nested: bool) -> dict | None:
    """torch FSDP2 shards a GPT and DCP-saves its model state dict (torchtitan nests it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = GPT(CFG)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state_dict = get_model_state_dict(model)
    dcp.save({"model": state_dict} if nested else state_dict, checkpoint_id=path)
    return _rank0(full)


def dcp_load(axes: dict, path: str, prefix: str) -> dict | None:
    torch.manual_seed(123)
    sm = ff.fsdp(GPT(CFG), ff.make_mesh(axes))
    params = ff.checkpoint.load_dcp_state_dict(sm, path, rename=lambda n: prefix + n)
    return _rank0({"full": ff.gather(params), "padding_zero": _padding_is_zero(params)})


TOKENS = torch.randint(0, LLAMA["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(3))


def lora_loss(logits: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, TOKENS[:, 1:])


def lora_step_and_export(adapter_dir: str, merged_dir: str) -> dict | None:
    """One SGD step on the LoRA parameters only (the base is frozen), then both exports."""
    model = lora_model()
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    params = sm.shard()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    trainable = {k: v for k, v in params.items() if k in names}
    frozen = {k: v for k, v in params.items() if k not in names}
    grads = torch.func.grad(lambda t: lora_loss(sm.apply({**t, **frozen}, TOKENS[:, :-1]).logits))(
        trainable
    )
    trained = {k: v.replace(v.local - LR * grads[k].local) for k, v in trainable.items()}
    params = {**params, **trained}
    ff.checkpoint.export_peft_adapter(sm, params, adapter_dir)
    ff.checkpoint.export_merged(sm, params, merged_dir, max_shard_size="30KB")
    return _rank0({"trained": ff.gather(trained)})


def lora_reference() -> tuple[torch.nn.Module, dict]:
    """The same step on one process; returns the updated peft model and its new weights."""
    model = lora_model()
    params = {n: p.detach() for n, p in model.named_parameters()}
    trainable = {n: params[n] for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.func.grad(
        lambda t: lora_loss(
            torch.func.functional_call(model, {**params, **t}, (TOKENS[:, :-1],)).logits
        )
    )(trainable)
    new = {k: v - LR * grads[k] for k, v in trainable.items()}
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in updated.named_parameters():
            if n in new:
                p.copy_(new[n])
    return updated, new


# --------------------------------------------------------------------------- memory


def memory_load_export(src: str, out: str) -> dict[str, int]:
    """Bytes allocated at the peak of a shard-wise load and of a streamed export (the shards it
    reads included) of an untied 81 MiB Llama on the meta device."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(big_llama_config())
    sm = ff.fsdp(model, ff.make_mesh({"dp": dist.get_world_size()}))
    psi, largest_unit = model_bytes(sm)
    params, load = peak_allocated(lambda: ff.checkpoint.load_safetensors(sm, src))
    shards = [v.local for v in params.values()]
    _, export = peak_allocated(
        lambda p=params: ff.checkpoint.export_safetensors(sm, p, out), held=shards
    )
    dist.barrier()
    return {
        "load": load,
        "export": export,
        "shards": sum(t.numel() * t.element_size() for t in shards),
        "psi": psi,
        "largest_unit": largest_unit,
        "largest_tensor": max(p.numel() * 4 for p in model.parameters()),
    }


def load_linear_error(folder: str) -> str:
    """The error message of a bad load (caught here, so that the pool stays usable)."""
    sm = ff.fsdp(torch.nn.Linear(3, 5), ff.make_mesh({"dp": dist.get_world_size()}))
    try:
        ff.checkpoint.load_safetensors(sm, folder)
    except ValueError as e:
        return str(e)
    return "no error"
