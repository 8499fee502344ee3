"""Worker functions for the DPO tests: a policy and a frozen reference sharded on one mesh,
TRL's sigmoid loss, on one process and on gloo ranks; LoRA's adapters-disabled reference."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

import functional_fsdp as ff

from ._sft_workers import llama, sft_data

BETA = 0.1
PAIRS = 8


def preferences() -> list[dict[str, Any]]:
    """8 conversational preference pairs (TRL's prompt / chosen / rejected format)."""
    import json

    D = sft_data()
    with tempfile.TemporaryDirectory() as folder:
        D.write_preferences(f"{folder}/pairs.jsonl", PAIRS, seed=5)
        with open(f"{folder}/pairs.jsonl") as f:
            return [json.loads(line) for line in f]


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    D = sft_data()
    chats = [[*p["prompt"], *p["chosen"], *p["rejected"]] for p in preferences()]
    with tempfile.TemporaryDirectory() as folder:
        D.chat_tokenizer(chats, folder)
        return AutoTokenizer.from_pretrained(folder)


def data() -> tuple[dict[str, torch.Tensor], int]:
    """The batch of every pair and the vocabulary size."""
    D = sft_data()
    tok = tokenizer()
    pairs = [D.encode_preference(p, tok) for p in preferences()]
    return D.preference_batch(pairs, tok.pad_token_id), -(-len(tok) // 8) * 8


def policy_and_reference(vocab: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two different tiny Llamas (seeds 0 and 1): the policy is not the reference, so the
    log-ratios, rewards and gradients are not trivially zero."""
    policy = llama(vocab)
    reference = llama(vocab)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.requires_grad_(False)
    return policy, reference


def dpo_loss_fn(
    policy: Callable[[Any, torch.Tensor], torch.Tensor], reference: Callable[[torch.Tensor], Any]
) -> Callable[[Any, dict[str, torch.Tensor]], Any]:
    """The loss_fn of a DPO step: chosen and rejected in one forward of each model, the
    reference's without gradients."""

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> Any:
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        logps = ff.sequence_logps(policy(params, ids), labels)
        with torch.no_grad():
            ref = ff.sequence_logps(reference(ids), labels)
        n = len(batch["chosen_input_ids"])
        return ff.dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta=BETA)

    return loss_fn


def one_process(models: tuple[torch.nn.Module, torch.nn.Module] | None = None) -> dict[str, Any]:
    """This library's DPO loss, metrics and gradients on one process, all pairs (with
    :func:`policy_and_reference`'s models, or the ``(policy, reference)`` given)."""
    batch, vocab = data()
    policy, reference = models or policy_and_reference(vocab)
    params = {n: p.detach() for n, p in policy.named_parameters()}
    loss_fn = dpo_loss_fn(
        lambda p, ids: torch.func.functional_call(policy, p, (ids,)).logits,
        lambda ids: reference(ids).logits,
    )

    def mean(p: Any) -> Any:
        (total, count), aux = loss_fn(p, batch)
        return total / count, {k: v.sum / v.count for k, v in aux.items()}

    grads, (loss, aux) = torch.func.grad_and_value(mean, has_aux=True)(params)
    return {"loss": loss, "aux": aux, "grads": grads}


def gloo_dpo(accumulate: int) -> dict[str, Any]:
    """One SGD step (learning rate 1) of DPO with the policy and the frozen reference both
    fully sharded over every rank: the loss, the metrics and the policy's gradients."""
    import torch.distributed as dist

    batch, vocab = data()
    policy, reference = policy_and_reference(vocab)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm, ref_sm = ff.fsdp(policy, mesh), ff.fsdp(reference, mesh)
    ref_params = ref_sm.shard()  # frozen: no gradient, no optimizer state
    assert not ref_sm.trainable
    loss_fn = dpo_loss_fn(
        lambda p, ids: sm.apply(p, input_ids=ids).logits,
        lambda ids: ref_sm.apply(ref_params, input_ids=ids).logits,
    )
    opt = ff.sgd(1.0)
    step = ff.train_step(loss_fn, opt, model=sm, has_aux=True, accumulate=accumulate)
    params = sm.shard()
    new, metrics = step(ff.TrainState.create(params, opt, trainable=sm), batch)
    before, after = ff.gather(params), ff.gather(new.params)
    return {
        "loss": metrics["loss"],
        "aux": metrics["aux"],
        "grads": {n: before[n] - after[n] for n in before},
    }


def gloo_lora_reference() -> dict[str, Any]:
    """A LoRA policy whose reference is the base with its adapters disabled (no second copy),
    on 2 ranks: the disabled forward against a separately sharded frozen copy of the base
    (bitwise), and the DPO step's loss against one process."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    batch, vocab = data()
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(llama(vocab), lora)
    copy = llama(vocab).requires_grad_(False)  # the same base weights (seed 0)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm, copy_sm = ff.fsdp(peft, mesh), ff.fsdp(copy, mesh)
    params, copy_params = sm.shard(), copy_sm.shard()
    with torch.no_grad():
        with peft.disable_adapter():
            disabled = sm.apply(params, input_ids=ids).logits
        separate = copy_sm.apply(copy_params, input_ids=ids).logits
        enabled = sm.apply(params, input_ids=ids).logits

    def reference(x: torch.Tensor) -> torch.Tensor:
        with peft.disable_adapter():
            return sm.apply(params, input_ids=x).logits

    loss_fn = dpo_loss_fn(lambda p, x: sm.apply(p, input_ids=x).logits, reference)
    opt = ff.sgd(1.0)
    step = ff.train_step(loss_fn, opt, model=sm, has_aux=True)
    _, metrics = step(ff.TrainState.create(params, opt, trainable=sm), batch)
    # one process: the peft model as it is, its adapters disabled for the reference
    local = {n: p.detach() for n, p in peft.named_parameters()}

    def ref_local(x: torch.Tensor) -> torch.Tensor:
        with peft.disable_adapter():
            return peft(input_ids=x).logits

    one = dpo_loss_fn(lambda p, x: torch.func.functional_call(peft, p, (x,)).logits, ref_local)
    (total, count), _ = one(local, batch)
    return {
        "bitwise": torch.equal(disabled, separate),
        "adapters_matter": not torch.equal(enabled, separate),
        "loss": metrics["loss"],
        "one_process": total / count,
        "frozen_state": sum(1 for n in params if n not in sm.trainable),
    }


def save_base(path: str) -> str:
    """The tiny Llama of :func:`one_process`'s vocabulary (seed 0), saved in fp32 with
    ``save_pretrained`` (in one process), to be loaded back 4-bit."""
    llama(data()[1]).save_pretrained(path)
    return path


def qlora_and_copy(path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """LoRA (random A and B) over the base at ``path`` loaded 4-bit (nf4, double quantization,
    bf16 compute: the QLoRA recipe), and a separately quantized frozen copy of that base."""
    from . import _qlora_workers as Q

    return Q.with_lora(Q.quantized(path)), Q.quantized(path).requires_grad_(False)


def qlora_reference_one_process(path: str) -> dict[str, Any]:
    """On one process, no sharding: the DPO loss with the adapters-disabled 4-bit base as the
    reference, and with a separately quantized frozen copy."""
    batch, _ = data()
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    peft, copy = qlora_and_copy(path)

    def disabled(x: torch.Tensor) -> torch.Tensor:
        with peft.disable_adapter():
            return peft(input_ids=x).logits

    with torch.no_grad():
        policy = lambda p, x: peft(input_ids=x).logits  # noqa: E731
        (total, count), _ = dpo_loss_fn(policy, disabled)(None, batch)
        (copy_total, copy_count), _ = dpo_loss_fn(policy, lambda x: copy(input_ids=x).logits)(
            None, batch
        )
        return {
            "bitwise": torch.equal(disabled(ids), copy(input_ids=ids).logits),
            "adapters_matter": not torch.equal(peft(input_ids=ids).logits, disabled(ids)),
            "loss": total / count,
            "copy_loss": copy_total / copy_count,
        }


def gloo_qlora_reference(path: str) -> dict[str, Any]:
    """QLoRA DPO on 2 ranks: the reference is the 4-bit base with the adapters disabled on
    the module ``ff.fsdp`` runs (``sm.module``, a storage view of the 4-bit layers); against a
    separately quantized frozen copy sharded on the same mesh (bitwise), and the step's loss."""
    import torch.distributed as dist

    batch, _ = data()
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    peft, copy = qlora_and_copy(path)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    sm, copy_sm = ff.fsdp(peft, mesh), ff.fsdp(copy, mesh)
    params, copy_params = sm.shard(), copy_sm.shard()

    def reference(x: torch.Tensor) -> torch.Tensor:
        with sm.module.disable_adapter():
            return sm.apply(params, input_ids=x).logits

    with torch.no_grad():
        disabled = reference(ids)
        separate = copy_sm.apply(copy_params, input_ids=ids).logits
        enabled = sm.apply(params, input_ids=ids).logits
    loss_fn = dpo_loss_fn(lambda p, x: sm.apply(p, input_ids=x).logits, reference)
    opt = ff.sgd(1.0)
    step = ff.train_step(loss_fn, opt, model=sm, has_aux=True)
    _, metrics = step(ff.TrainState.create(params, opt, trainable=sm), batch)
    return {
        "bitwise": torch.equal(disabled, separate),
        "adapters_matter": not torch.equal(enabled, separate),
        "loss": metrics["loss"],
    }
