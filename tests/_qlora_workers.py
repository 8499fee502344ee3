"""Worker functions for the 4-bit (QLoRA) tests: real gloo processes and one-process references.

Every model here is a tiny Llama saved in fp32 to a directory and loaded back quantized by
``from_pretrained(dir, quantization_config=..., device_map="cpu")``, then wrapped by peft's
``get_peft_model``: the bytes a rank holds are the bytes bitsandbytes produced.

The references run in training mode, as a trainer runs them: ``from_pretrained`` returns a
model in eval mode, and in eval mode (no grad on the input, a CPU with avx512_bf16)
bitsandbytes' ``Linear4bit.forward`` repacks the weight in place into its CPU inference layout,
which fails for layers narrower than 64 inputs (these tiny ones) and is not what a training
step computes. None of these models has dropout, so training mode changes no value.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
from torch import nn

import functional_fsdp as ff

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 96
LR = 1e-2


def bnb_config(
    quant_type: str = "nf4", double: bool = True, compute: torch.dtype = torch.bfloat16
) -> Any:
    """The seed recipe's BitsAndBytesConfig (``quant_type``/``double``/``compute`` varied)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=compute,
    )


def save_tiny_llama(path: str, seed: int = 0, **overrides: Any) -> str:
    """A tiny fp32 Llama saved with ``save_pretrained`` to ``path`` (in one process:
    transformers writes the config only from the main process of a process group)."""
    from transformers import LlamaForCausalLM

    from ._hf import tiny_llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, **overrides))
    model.save_pretrained(path)
    return path


def quantized(
    path: str, quant_type: str = "nf4", double: bool = True, compute: torch.dtype = torch.bfloat16
) -> nn.Module:
    """The model at ``path`` loaded 4-bit by transformers + bitsandbytes, in training mode."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=bnb_config(quant_type, double, compute), device_map="cpu"
        )
    return model.train()


def qlora(
    path: str,
    quant_type: str = "nf4",
    double: bool = True,
    seed: int = 1,
    compute: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """peft LoRA (the seed's targets, r=8, alpha=16, no dropout) over the 4-bit model."""
    return with_lora(quantized(path, quant_type, double, compute), seed)


def with_lora(base: nn.Module, seed: int = 1, dropout: float = 0.0) -> nn.Module:
    """peft LoRA (the seed's targets, r=8, alpha=16) over ``base``, random A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=dropout, init_lora_weights=False
    )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.simplefilter("ignore")
        return get_peft_model(base, lora)


def bf16_base_gather_bytes(path: str, b: torch.Tensor) -> int:
    """All-gather bytes of the projections' weights (the layers a 4-bit load quantizes) in
    one ff.train_step on this rank, with the model at ``path`` loaded in bf16: the same base
    in bf16, the same LoRA, the same step. Only those weights are sharded (the rest is
    replicated), so every all-gather is theirs."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    model = with_lora(base.train())

    def specs(name: str, t: torch.Tensor) -> ff.P | None:
        return ff.P("dp") if name.endswith("base_layer.weight") else None

    sm = ff.fsdp(model, ff.make_mesh({"dp": 2}), specs=specs)
    opt = ff.adamw(LR, weight_decay=0.0)
    step = ff.train_step(lambda p, x: sm.apply(p, input_ids=x, labels=x).loss, opt, model=sm)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    with ff.count_comms() as comms:
        step(state, b)
    gathers = [r for r in comms.records if r.kind == "all_gather"]
    if {r.dtype for r in gathers} != {torch.bfloat16}:
        raise ValueError(f"expected bf16 all-gathers only, got {gathers}")
    return sum(r.bytes for r in gathers)


def batches(steps: int, rows: int = 4, length: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (rows, length), generator=g) for _ in range(steps)]


def train_vs_peft(
    path: str, quant_type: str, double: bool, steps: int, compute: torch.dtype = torch.bfloat16
) -> dict:
    """``steps`` AdamW steps of ff.train_step on 2 gloo ranks (global batch split by rank) vs
    peft + bitsandbytes with torch.optim.AdamW in this process on the global batch (both
    computing the base in ``compute``, bnb_4bit_compute_dtype)."""
    model = qlora(path, quant_type, double, compute=compute)
    ref = qlora(path, quant_type, double, compute=compute)
    mesh = ff.make_mesh({"dp": 2})
    sm = ff.fsdp(model, mesh)
    opt = ff.adamw(LR, weight_decay=0.0)

    def loss_fn(p: dict, b: torch.Tensor) -> torch.Tensor:
        return sm.apply(p, input_ids=b, labels=b).loss

    step = ff.train_step(loss_fn, opt, model=sm)
    params = sm.shard()
    state = ff.TrainState.create(params, opt, trainable=sm)
    names = state.trainable
    base = sorted(k for k in params if k.endswith("base_layer.weight"))
    out: dict = {
        "base_dtypes": sorted({str(params[k].dtype) for k in base}),
        "base_local_rows": {k: tuple(params[k].local.shape) for k in base[:2]},
        "base_global": {k: tuple(params[k].global_shape) for k in base[:2]},
        "base_trainable": [k for k in base if k in names],
        "mu_base": [k for k in state.opt_state[0].mu if k in base],
    }
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0
    )
    theirs = dict(ref.named_parameters())
    out["loss"], out["ref_loss"], out["grad_diff"] = [], [], None
    for i, b in enumerate(batches(steps)):
        if i == 0:  # gradients of the first step, before any update
            tr, fr = ff.partition(params, names)
            grads = torch.func.grad(
                lambda t: loss_fn(ff.combine(t, fr), b.chunk(2)[torch.distributed.get_rank()])
            )(tr)
        with ff.count_comms() as comms:
            state, metrics = step(state, b)
        ref_loss = ref(input_ids=b, labels=b).loss
        ref_loss.backward()
        if i == 0:
            full = ff.gather(grads)
            out["grad_diff"] = max((full[k] - theirs[k].grad).abs().max().item() for k in names)
            out["grad_scale"] = max(theirs[k].grad.abs().max().item() for k in names)
            out["base_gather_bytes"] = sum(  # the packed rows are the only uint8 values
                r.bytes for r in comms.records if r.kind == "all_gather" and r.dtype == torch.uint8
            )
            out["rs_bytes"] = sum(r.bytes for r in comms.records if r.kind == "reduce_scatter")
        torch_opt.step()
        torch_opt.zero_grad()
        if i == 0:
            out["step1_loss_diff"] = abs(float(metrics["loss"]) - ref_loss.item())
        out["loss"].append(float(metrics["loss"]))
        out["ref_loss"].append(ref_loss.item())
    full = ff.gather(state.params)
    out["param_diff"] = max((full[k] - theirs[k].detach()).abs().max().item() for k in names)
    out["base_bitwise"] = all(
        torch.equal(state.params[k].local, params[k].local) and state.params[k] is params[k]
        for k in base
    )
    # The same base in bf16, for the all-gather bytes: measured on the same first batch.
    out["bf16_base_gather_bytes"] = bf16_base_gather_bytes(path, batches(1)[0])
    out["bf16_base_bytes"] = sum(  # by formula, for the test's message
        m.weight.quant_state.shape.numel() * 2
        for n, m in model.named_modules()
        if n.endswith("base_layer")
    )
    out["user_module_untouched"] = all(
        type(m.weight).__name__ == "Params4bit"
        for n, m in model.named_modules()
        if n.endswith("base_layer")
    )
    return out


# --------------------------------------------------------------------------- the seed recipe


def seed_recipe_model(path: str, dropout: float) -> nn.Module:
    """The seed recipe's lines, unmodified: the 4-bit load with its BitsAndBytesConfig,
    ``gradient_checkpointing_enable()``, ``prepare_model_for_kbit_training``, and LoRA r=8,
    alpha=16 on every projection with ``lora_dropout``; then ``train()``, as a trainer does."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=bnb_config(), device_map="cpu"
        )
        model.gradient_checkpointing_enable()
        model = prepare_model_for_kbit_training(model)
        torch.manual_seed(1)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=dropout)
        model = get_peft_model(model, config)
    return model.train()


def seed_recipe(path: str, steps: int, dropout: float) -> dict:
    """``steps`` AdamW steps of ff.train_step (engine 'auto', randomness 'global_batch') on
    2 gloo ranks vs peft + bitsandbytes with torch.optim.AdamW in one process on the global
    batch, drawing its dropout masks from the key the step uses for the global batch. The
    first step's gradients are read where the optimizer receives them."""
    model, ref = seed_recipe_model(path, dropout), seed_recipe_model(path, dropout)
    sm = ff.fsdp(model, ff.make_mesh({"dp": 2}))
    seen: list = []

    def record(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        seen.append(updates)  # the gradients of this step, sharded
        return updates, state

    opt = ff.chain(ff.GradientTransformation(lambda p: (), record), ff.adamw(LR, weight_decay=0))
    step = ff.train_step(
        lambda p, b: sm.apply(p, input_ids=b, labels=b).loss,
        opt,
        model=sm,
        randomness="global_batch",
    )
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm, rng=7)
    names = state.trainable
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0
    )
    theirs = dict(ref.named_parameters())
    b = batches(1, rows=4)[0]  # one batch, again each step: the loss must fall
    out: dict = {"loss": [], "ref_loss": [], "notices": []}
    for i in range(steps):
        with warnings.catch_warnings(record=True) as notices:
            warnings.simplefilter("always")
            state, metrics = step(state, b)
        out["notices"] += [
            str(w.message) for w in notices if issubclass(w.category, ff.AutogradFallbackWarning)
        ]
        with warnings.catch_warnings():  # the recipe's checkpointing leaves use_reentrant unset
            warnings.filterwarnings("ignore", "torch.utils.checkpoint: the use_reentrant")
            if i == 1:  # other masks give another loss (once lora_B, zero at first, is not)
                with ff.seeded(ff.rng_key(8)), torch.no_grad():
                    out["other_masks_loss"] = ref(input_ids=b, labels=b).loss.item()
            with ff.seeded(ff.fold_in(ff.fold_in(ff.rng_key(7), i), 0)):  # step i, micro-batch 0
                ref_loss = ref(input_ids=b, labels=b).loss
                ref_loss.backward()
        if i == 0:
            grads = ff.gather(seen[0])
            out["grad_diff"] = max((grads[k] - theirs[k].grad).abs().max().item() for k in names)
            out["grad_scale"] = max(theirs[k].grad.abs().max().item() for k in names)
        torch_opt.step()
        torch_opt.zero_grad()
        out["loss"].append(float(metrics["loss"]))
        out["ref_loss"].append(ref_loss.item())
    full = ff.gather(state.params)
    out["param_diff"] = max((full[k] - theirs[k].detach()).abs().max().item() for k in names)
    out["trainable"] = sorted(names)
    out["dropout"] = sorted(
        {
            getattr(m, "p", 0.0)
            for n, m in model.named_modules()
            if n.endswith("lora_dropout.default")
        }
    )
    out["checkpointing"] = model.get_base_model().is_activation_checkpointing
    out["base_dtypes"] = sorted(
        {str(v.dtype) for k, v in state.params.items() if k.endswith("base_layer.weight")}
    )
    return out


# --------------------------------------------------------------------------- loading

# Layers of 256 and 512 blocks: double quantization's nested absmax has 1 and 2 groups of 256.
LOAD_CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4)


def _local_equal(a: dict, b: dict) -> list[str]:
    """Names whose local shards differ (bitwise)."""
    return sorted(k for k in b if k not in a or not torch.equal(a[k].local, b[k].local))


def load_shardwise(path: str, saved_4bit: str, quant_type: str, double: bool) -> dict:
    """Shard-wise quantized loading from an fp32 directory on 2 gloo ranks, into (a) the
    description of a model quantized by from_pretrained on every rank and (b) a model on the
    meta device made 4-bit by transformers' replace_with_bnb_linear; both against the bytes
    of from_pretrained(quantization_config=...) sharded by FSDP.shard(). ``saved_4bit`` holds
    the same model saved already quantized (save_pretrained of the 4-bit model)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from ._deferred_workers import peak_allocated

    mesh = ff.make_mesh({"dp": 2})
    sm = ff.fsdp(quantized(path, quant_type, double), mesh)
    ref = sm.shard()
    out: dict = {"names": sorted(ref)}
    out["from_quantized"] = _local_equal(ff.checkpoint.load_safetensors(sm, path), ref)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    meta = replace_with_bnb_linear(  # from_pretrained leaves the head unquantized too
        meta, modules_to_not_convert=["lm_head"], quantization_config=bnb_config(quant_type, double)
    )
    sm_meta = ff.fsdp(meta, mesh)
    loaded, peak = peak_allocated(lambda: ff.checkpoint.load_safetensors(sm_meta, path))
    out["from_meta"] = _local_equal(loaded, ref)
    saved = ff.checkpoint.load_safetensors(sm_meta, saved_4bit)
    out["from_saved_4bit"] = _local_equal(saved, ref)
    out["peak"] = peak
    out["shards"] = sum(v.local.numel() * v.local.element_size() for v in loaded.values())
    out["whole_stored"] = sum(
        math.prod(v.global_shape) * v.local.element_size() for v in loaded.values()
    )
    fp32 = {n: p for n, p in AutoModelForCausalLM.from_config(meta.config).named_parameters()}
    out["largest_fp32"] = max(p.numel() * 4 for p in fp32.values())
    out["whole_fp32"] = sum(p.numel() * 4 for p in fp32.values())
    return out


# --------------------------------------------------------------------------- export


def export_4bit(path: str, adapter_dir: str, merged_dir: str) -> dict:
    """3 steps on 2 gloo ranks, then the peft adapter and the merged model exported; rank 0
    loads them back with peft + bitsandbytes and compares."""
    from peft import PeftModel
    from safetensors.torch import load_file

    mesh = ff.make_mesh({"dp": 2})
    sm = ff.fsdp(qlora(path), mesh)
    opt = ff.adamw(LR, weight_decay=0.01)
    step = ff.train_step(lambda p, b: sm.apply(p, input_ids=b, labels=b).loss, opt, model=sm)
    state = ff.TrainState.create(sm.shard(), opt, trainable=sm)
    for b in batches(3):
        state, _ = step(state, b)
    x = batches(4)[3]
    ours = sm.apply(state.params, input_ids=x).logits.detach()
    ff.checkpoint.export_peft_adapter(sm, state.params, adapter_dir)
    ff.checkpoint.export_merged(sm, state.params, merged_dir)
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(quantized(path), adapter_dir)
    loaded.train()  # peft loads an adapter in eval mode; see the module docstring
    out = {"adapter_logits_diff": (loaded(input_ids=x).logits - ours).abs().max().item()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged_peft = loaded.merge_and_unload()  # dequantize, add B @ A, quantize again
    written = load_file(os.path.join(merged_dir, "model.safetensors"))
    out["keys"] = sorted(written) == sorted(
        k for k in merged_peft.state_dict() if "weight." not in k
    )
    import bitsandbytes.functional as F

    requantized, plain = [], []
    for name, m in merged_peft.named_modules():
        if type(m).__name__ == "Linear4bit":
            qs = m.weight.quant_state
            packed, mine = F.quantize_4bit(
                written[name + ".weight"],
                blocksize=qs.blocksize,
                compress_statistics=qs.nested,
                quant_type=qs.quant_type,
            )
            requantized.append(
                torch.equal(packed, m.weight.data) and torch.equal(mine.absmax, qs.absmax)
            )
    for name, p in merged_peft.named_parameters():
        if type(p).__name__ != "Params4bit":
            plain.append(torch.equal(written[name], p.detach()))
    out["merged_requantized_bitwise"] = requantized
    out["merged_plain_bitwise"] = plain
    return out


# --------------------------------------------------------------------------- the user's module state


def user_state(path: str, simulated: bool = False) -> dict:
    """``sm.apply`` after changing the *user's* peft model (``.eval()``, ``.train()``,
    ``disable_adapter()``, ``set_adapter``) against the same model in one process.

    The base at ``path`` has attention dropout 0.5, read from the (copied) attention modules'
    ``training``: in training mode the logits are random, in eval mode they equal the
    reference's, a second model whose attention dropout is set to 0 (run in training mode:
    see the module docstring). The view keeps what was set on ``sm.module`` itself while the
    user's module does not change it. ``simulated``: on a simulated mesh of 2 ranks, the
    global batch; else on 2 gloo ranks, each rank its half. Returns the largest differences.
    """
    from peft import LoraConfig

    other = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = with_lora(quantized(path))
    model.add_adapter("other", other)  # with_lora seeds: the same random A and B in both
    ref = with_lora(quantized(path))
    ref.add_adapter("other", other)
    for m in ref.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.0
    b = batches(1, rows=4)[0]
    x = b if simulated else b.chunk(2)[torch.distributed.get_rank()]
    with torch.no_grad():
        on = ref(input_ids=x).logits
        with ref.disable_adapter():
            off = ref(input_ids=x).logits
        ref.set_adapter("other")
        switched = ref(input_ids=x).logits
        ref.set_adapter("default")
    ctx = ff.simulated_mesh({"dp": 2}) if simulated else None
    mesh = ctx.__enter__() if ctx is not None else ff.make_mesh({"dp": 2})
    sm = ff.fsdp(model, mesh)
    params = sm.shard()

    def run() -> torch.Tensor:
        with torch.no_grad():
            y = sm.apply(params, input_ids=x).logits
        return ff.rank_values(y)[0] if simulated else y

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item()

    out: dict = {"adapters_matter": diff(on, off), "other_matters": diff(on, switched)}
    out["train"] = diff(run(), on)  # dropout: random
    model.eval()
    out["eval"] = diff(run(), on)
    with model.disable_adapter():
        out["disabled"] = diff(run(), off)
    out["enabled_again"] = diff(run(), on)
    model.set_adapter("other")
    out["set_adapter"] = diff(run(), switched)
    model.set_adapter("default")
    out["default_again"] = diff(run(), on)
    model.train()
    out["train_again"] = diff(run(), on)
    sm.module.eval()  # set on the view itself: kept while the user's model does not change it
    out["view_eval"] = diff(run(), on)
    with sm.module.disable_adapter():
        out["view_disabled"] = diff(run(), off)
    model.eval()
    model.train()  # a change made between two calls: the view's eval stays (same value)
    out["user_training"] = model.training
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return out
