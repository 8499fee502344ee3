"""Peak allocated memory per rank for QLoRA: load, train step and export, four systems.

A ``transformers`` Llama (untied; ``--size 118m``: hidden 512, 8 layers, vocab 8192, 118 MiB
in fp32; ``--size 1g``: hidden 1536, 8 layers, vocab 32000, 1149 MiB in fp32) is saved in fp32
with ``save_pretrained``. Per rank of a gloo job:

* ``ff 4-bit``: the model on meta, its linear layers made bitsandbytes NF4 with double
  quantization (``replace_with_bnb_linear``), peft LoRA (r=8, all seven projections);
  ``load_safetensors(dtype=bfloat16)`` quantizes each rank's blocks from bf16 while reading
  and holds the unquantized weights (embedding, head, norms) in bf16, as (b) does;
  ``train_step`` (AdamW); ``export_merged`` (streamed, written dequantized);
* ``ff bf16``: the same LoRA on a bf16 base (``load_safetensors(dtype=bfloat16)``), the same
  step and export;
* ``FSDP2 + quant_storage``: torch FSDP2 over bitsandbytes' ``bnb_4bit_quant_storage``
  recipe, the one accelerate documents for FSDP-QLoRA: every rank ``from_pretrained(dir,
  quantization_config=BitsAndBytesConfig(..., bnb_4bit_quant_storage=bfloat16),
  dtype=bfloat16)``, the same peft LoRA, ``fully_shard`` per decoder layer then the root,
  plain autograd on the rank's share of the batch, ``torch.optim.AdamW`` on the adapters;
  export: rank 0 gathers the full state dict (``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)``: packed base and adapters, not merged: peft's ``merge_and_unload`` needs
  whole ``Params4bit``) and saves it. If it fails, its error is printed and the other columns
  are kept;
* ``peft+bnb``: one process (rank 0), the seed recipe as written: ``from_pretrained(dir,
  quantization_config=...)``, ``get_peft_model``, ``torch.optim.AdamW`` steps on the global
  batch, ``merge_and_unload()`` and ``save_pretrained``.

**Method.** Load and export: allocated bytes, not resident memory: torch's ``MemTracker`` (a
dispatch mode that records every op's outputs by storage and forgets a storage when it is
freed) gives the most bytes of CPU tensors alive at once during the phase, counting what the
rank holds from before (``track_external``). The train step: MemTracker cannot follow a step
under ``torch.func`` (its module hooks meet the transform's wrapped parameters), so the row is
the rise of resident memory (``VmHWM``) above its level when the steps start, for every
column, next to the bytes the state holds then (parameters, optimizer state). peft's and
FSDP2's steps have no optimizer state before their first step (torch creates it inside
``opt.step()``), so it shows in their growth. ``projections at rest`` counts only the seven
projections (the layers that are quantized; quantization state included: for ff, the code
tables every rank holds whole as well as the sharded blocks), ``base at rest`` also the
embedding, head and norms. ``step seconds``: wall time of the last step.

    torchrun --nproc-per-node 4 benchmarks/qlora_memory.py [--size 118m|1g] [--steps 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

import functional_fsdp as ff
from functional_fsdp.formats import replicated_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIB = 2**20
ROWS = (
    "base at rest",
    "projections at rest",
    "load (allocated peak)",
    "state before the step",
    "train step (RSS growth)",
    "export (allocated peak)",
    "step seconds",
)


def peak(fn, held=()):
    """``fn()`` and the peak bytes of CPU tensors alive while it ran (``held`` counted)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*held)
    with tracker:
        out = fn()
    snap = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    return out, int(snap.get("Total", 0))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_growth(fn):
    """``fn()`` and how far resident memory rose above where it was when ``fn`` started
    (``VmHWM`` reset through ``/proc/self/clear_refs``). MemTracker cannot follow a step
    under ``torch.func`` (its module hooks meet the transform's wrapped parameters)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    return out, max(0, _status("VmHWM") - start)


def bnb_config(**extra):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        **extra,
    )


def timed_steps(step, steps: int):
    """Run ``step()`` ``steps`` times; the last result and the last step's seconds."""
    out, seconds = None, 0.0
    for _ in range(steps):
        start = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - start
    return out, seconds


def figures(*values: float) -> dict[str, float]:
    """One column: the rows in the table's order."""
    return dict(zip(ROWS, values, strict=True))


def autograd_steps(model, batch: torch.Tensor, steps: int):
    """``steps`` plain-autograd AdamW steps on ``model``'s trainable parameters; the
    resident growth and the last step's seconds (peft's and FSDP2's steps)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def train():
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()

    (_, seconds), growth = rss_growth(lambda: timed_steps(train, steps))
    return growth, seconds


def lora(model):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


def run_ff(
    path: str, out: str, quantize: bool, batch: torch.Tensor, steps: int
) -> dict[str, float]:
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    if quantize:
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        base = replace_with_bnb_linear(
            base, modules_to_not_convert=["lm_head"], quantization_config=bnb_config()
        )
    model = lora(base)
    mesh = ff.make_mesh({"dp": dist.get_world_size()})
    bf16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sm = ff.fsdp(model, mesh, policy=ff.Policy(mixed_precision=bf16))

    def init(m):
        if isinstance(m, LoraLayer):
            for name in m.lora_A:
                m.reset_lora_parameters(name, True)

    torch.manual_seed(0)  # the same adapters on every rank (init_sharded checks)
    params, buffers = ff.init_sharded(sm, init_fn=init)
    frozen = set(params) - sm.trainable
    rename = lambda n: n.removeprefix("base_model.model.").replace(".base_layer", "")  # noqa: E731
    adapters = [v.local for k, v in params.items() if k in sm.trainable]
    loaded, load_peak = peak(
        lambda: ff.checkpoint.load_safetensors(
            sm, path, rename=rename, names=frozen, dtype=torch.bfloat16
        ),
        adapters,
    )
    params.update(loaded)
    tables = replicated_bytes(sm.module)  # a 4-bit base's code tables, whole on every rank
    at_rest = sum(params[k].local.nbytes for k in frozen) + tables
    proj = sum(params[k].local.nbytes for k in frozen if "_proj" in k) + tables
    opt = ff.adamw(1e-3, weight_decay=0.01)
    step = ff.train_step(
        lambda p, b: sm.apply(p, input_ids=b, labels=b, buffers=buffers).loss, opt, model=sm
    )
    state = ff.TrainState.create(params, opt, trainable=sm)
    held = [v.local for v in state.params.values()]
    held += [t for t in ff.tree_leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    state_bytes = sum(t.nbytes for t in held)

    def train():
        nonlocal state
        state, _ = step(state, batch)

    (_, seconds), step_peak = rss_growth(lambda: timed_steps(train, steps))
    held = [v.local for v in state.params.values()]
    _, export_peak = peak(lambda: ff.checkpoint.export_merged(sm, state.params, out), held)
    return figures(at_rest, proj, load_peak, state_bytes, step_peak, export_peak, seconds)


def run_fsdp2(path: str, out: str, batch: torch.Tensor, steps: int) -> dict[str, float]:
    """torch FSDP2 over bitsandbytes' ``bnb_4bit_quant_storage`` recipe (accelerate's
    FSDP-QLoRA): every rank ``from_pretrained`` in 4 bits stored as bf16, peft LoRA,
    ``fully_shard`` per decoder layer then the root, plain autograd, AdamW on the adapters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = lora(
                AutoModelForCausalLM.from_pretrained(
                    path,
                    quantization_config=bnb_config(bnb_4bit_quant_storage=torch.bfloat16),
                    dtype=torch.bfloat16,
                    device_map="cpu",
                )
            )
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    model, load_peak = peak(load)
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    quant_state = [
        t
        for m in model.modules()
        if getattr(m, "quant_state", None) is not None
        for t in m.quant_state.as_dict().values()
        if isinstance(t, torch.Tensor)
    ]
    frozen = [(n, local(p)) for n, p in model.named_parameters() if not p.requires_grad]
    at_rest = sum(t.nbytes for _, t in frozen) + sum(t.nbytes for t in quant_state)
    proj = sum(t.nbytes for n, t in frozen if "_proj" in n) + sum(t.nbytes for t in quant_state)
    held = [local(p) for p in model.parameters()] + quant_state
    state_bytes = sum(t.nbytes for t in held)
    mine = batch.chunk(dist.get_world_size())[dist.get_rank()]
    step_peak, seconds = autograd_steps(model, mine, steps)
    held = [local(p) for p in model.parameters()] + quant_state

    def export():
        # FSDP2 has no merged export of a 4-bit base (peft's merge_and_unload needs the whole
        # Params4bit with its quant_state): rank 0 gathers the full state dict (packed base
        # and adapters) to CPU and saves it, as accelerate's FULL_STATE_DICT does.
        from safetensors.torch import save_file

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/model.safetensors")

    _, export_peak = peak(export, held)
    return figures(at_rest, proj, load_peak, state_bytes, step_peak, export_peak, seconds)


def run_peft(path: str, out: str, batch: torch.Tensor, steps: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_pretrained(
                path, quantization_config=bnb_config(), device_map="cpu"
            )

    base, load_peak = peak(load)
    model = lora(base)
    at_rest = {
        n: p.nbytes
        + sum(
            t.nbytes
            for t in (
                p.quant_state.as_dict().values()
                if hasattr(p, "quant_state") and p.quant_state is not None
                else []
            )
            if isinstance(t, torch.Tensor)
        )
        for n, p in model.named_parameters()
        if not p.requires_grad
    }
    proj = sum(v for n, v in at_rest.items() if "_proj" in n)
    at_rest = sum(at_rest.values())
    held = list(model.parameters())
    state_bytes = sum(p.nbytes for p in held)
    step_peak, seconds = autograd_steps(model, batch, steps)

    def export():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.merge_and_unload().save_pretrained(out)

    _, export_peak = peak(export, held)
    return figures(at_rest, proj, load_peak, state_bytes, step_peak, export_peak, seconds)


SIZES = {  # name: (hidden, layers, vocab)
    "118m": (512, 8, 8192),
    "1g": (1536, 8, 32000),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--size",
        choices=SIZES,
        default="118m",
        help="preset Llama: 118m (hidden 512, 8 layers, vocab 8192: 118 MiB in fp32) or "
        "1g (hidden 1536, 8 layers, vocab 32000: 1149 MiB in fp32)",
    )
    p.add_argument("--hidden", type=int, help="overrides the preset")
    p.add_argument("--layers", type=int, help="overrides the preset")
    p.add_argument("--vocab", type=int, help="overrides the preset")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences of 64)")
    p.add_argument("--steps", type=int, default=1, help="train steps; the last one is timed")
    args = p.parse_args()
    hidden, layers, vocab = SIZES[args.size]
    hidden, layers, vocab = args.hidden or hidden, args.layers or layers, args.vocab or vocab
    ff.init_distributed(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tempfile.mkdtemp(prefix="qlora_memory_") if rank == 0 else None
    shared = [root]
    dist.broadcast_object_list(shared)
    root = shared[0]
    path = os.path.join(root, "fp32")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    with torch.device("meta"):
        psi = sum(p.numel() * 4 for p in LlamaForCausalLM(config).parameters())
    batch = torch.randint(0, vocab, (args.batch, 64), generator=torch.Generator().manual_seed(1))
    results = {}
    results["ff 4-bit"] = run_ff(path, os.path.join(root, "ff4"), True, batch, args.steps)
    dist.barrier()
    results["ff bf16"] = run_ff(path, os.path.join(root, "ff16"), False, batch, args.steps)
    dist.barrier()
    fsdp2_error = None
    try:
        results["FSDP2 + quant_storage"] = run_fsdp2(
            path, os.path.join(root, "fsdp2"), batch, args.steps
        )
    except Exception as e:  # reported, and the other columns kept
        fsdp2_error = f"{type(e).__name__}: {e}"
    dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        results["peft+bnb (1 process)"] = run_peft(
            path, os.path.join(root, "peft"), batch, args.steps
        )
        systems = list(results)
        top = {
            s: {
                row: results[s][row]
                if s.startswith("peft")
                else max(g[s][row] for g in gathered if s in g)
                for row in results[s]
            }
            for s in systems
        }
        print(
            f"Llama {psi / MIB:.0f} MiB fp32 ({layers} layers, hidden {hidden}, vocab {vocab}), "
            f"{world} gloo ranks, global batch {args.batch}x64, {args.steps} step(s); "
            "MiB, max over ranks"
        )
        print("| phase | " + " | ".join(systems) + " |")
        print("|---|" + "--:|" * len(systems))
        for row in ROWS:
            scale = 1 if row == "step seconds" else MIB
            vals = [f"{top[s][row] / scale:.1f}" for s in systems]
            print(f"| {row} | " + " | ".join(vals) + " |")
        ours = top["ff 4-bit"]
        for row in ("base at rest", "projections at rest"):
            ratio = ours[row] / top["ff bf16"][row]
            met = "met" if ratio <= 0.3 else "not met"
            print(f"{row}, ff 4-bit / ff bf16 (per rank): {ratio:.2f} (target <= 0.3: {met})")
        if fsdp2_error is not None:
            print(f"FSDP2 + bnb_4bit_quant_storage did not run on CPU: {fsdp2_error}")
        else:
            theirs = top["FSDP2 + quant_storage"]
            rows = (
                "base at rest",
                "projections at rest",
                "train step (RSS growth)",
                "step seconds",
            )
            for row in rows:
                print(f"{row}, ff 4-bit / FSDP2: {ours[row] / theirs[row]:.2f}")
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
