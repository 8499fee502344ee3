"""Peak allocated memory per rank for QLoRA: load, train step and export, three systems.

A ``transformers`` Llama (untied; by default hidden 512, 8 layers, vocab 8192: about 150 MiB in
fp32, well under the issue's 1 GiB, which this shared 2-core machine could not run in time)
is saved in fp32 with ``save_pretrained``. Per rank of a gloo job:

* ``ff 4-bit``: the model on meta, its linear layers made bitsandbytes NF4 with double
  quantization (``replace_with_bnb_linear``), peft LoRA (r=8, all seven projections);
  ``load_safetensors`` quantizes each rank's blocks while reading; one ``train_step``
  (AdamW); ``export_merged`` (streamed, written dequantized);
* ``ff bf16``: the same LoRA on a bf16 base (``load_safetensors(dtype=bfloat16)``), the same
  step and export;
* ``peft+bnb``: one process (rank 0), the seed recipe as written: ``from_pretrained(dir,
  quantization_config=...)``, ``get_peft_model``, one ``torch.optim.AdamW`` step on the global
  batch, ``merge_and_unload()`` and ``save_pretrained``.

torch FSDP2 with ``bnb_4bit_quant_storage`` (the recipe accelerate documents for FSDP-QLoRA) is
not run here: it was not attempted in the time this benchmark was written (see the README).

**Method.** Load and export: allocated bytes, not resident memory: torch's ``MemTracker`` (a
dispatch mode that records every op's outputs by storage and forgets a storage when it is
freed) gives the most bytes of CPU tensors alive at once during the phase, counting what the
rank holds from before (``track_external``). The train step: MemTracker cannot follow a step
under ``torch.func`` (its module hooks meet the transform's wrapped parameters), so the row is
the rise of resident memory (``VmHWM``) above its level when the step starts, next to the bytes
the state holds then (parameters, optimizer state). peft's step has no optimizer state yet
before its first step (torch creates it inside ``opt.step()``), so it shows in its growth.

    torchrun --nproc-per-node 4 benchmarks/qlora_memory.py [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import torch.distributed as dist

import functional_fsdp as ff

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIB = 2**20


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


def bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def lora(model):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


def run_ff(path: str, out: str, quantize: bool, batch: torch.Tensor) -> dict[str, float]:
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

    params, buffers = ff.init_sharded(sm, init_fn=init)
    frozen = set(params) - sm.trainable
    rename = lambda n: n.removeprefix("base_model.model.").replace(".base_layer", "")  # noqa: E731
    adapters = [v.local for k, v in params.items() if k in sm.trainable]
    loaded, load_peak = peak(
        lambda: ff.checkpoint.load_safetensors(
            sm, path, rename=rename, names=frozen, dtype=None if quantize else torch.bfloat16
        ),
        adapters,
    )
    params.update(loaded)
    at_rest = sum(params[k].local.nbytes for k in frozen)
    opt = ff.adamw(1e-3)
    step = ff.train_step(
        lambda p, b: sm.apply(p, input_ids=b, labels=b, buffers=buffers).loss, opt, model=sm
    )
    state = ff.TrainState.create(params, opt, trainable=sm)
    held = [v.local for v in state.params.values()]
    held += [t for t in ff.tree_leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    state_bytes = sum(t.nbytes for t in held)
    (state, _), step_peak = rss_growth(lambda: step(state, batch))
    held = [v.local for v in state.params.values()]
    _, export_peak = peak(lambda: ff.checkpoint.export_merged(sm, state.params, out), held)
    return {
        "base at rest": at_rest,
        "load (allocated peak)": load_peak,
        "state before the step": state_bytes,
        "train step (RSS growth)": step_peak,
        "export (allocated peak)": export_peak,
    }


def run_peft(path: str, out: str, batch: torch.Tensor) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_pretrained(
                path, quantization_config=bnb_config(), device_map="cpu"
            )

    base, load_peak = peak(load)
    model = lora(base)
    at_rest = sum(
        p.nbytes
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
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    held = list(model.parameters())
    state_bytes = sum(p.nbytes for p in held)

    def train():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    _, step_peak = rss_growth(train)

    def export():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.merge_and_unload().save_pretrained(out)

    _, export_peak = peak(export, held)
    return {
        "base at rest": at_rest,
        "load (allocated peak)": load_peak,
        "state before the step": state_bytes,
        "train step (RSS growth)": step_peak,
        "export (allocated peak)": export_peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences of 64)")
    args = p.parse_args()
    ff.init_distributed(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tempfile.mkdtemp(prefix="qlora_memory_") if rank == 0 else None
    shared = [root]
    dist.broadcast_object_list(shared)
    root = shared[0]
    path = os.path.join(root, "fp32")
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    psi = sum(p.numel() * 4 for p in LlamaForCausalLM(config).to("meta").parameters())
    batch = torch.randint(
        0, args.vocab, (args.batch, 64), generator=torch.Generator().manual_seed(1)
    )
    results = {}
    results["ff 4-bit"] = run_ff(path, os.path.join(root, "ff4"), True, batch)
    dist.barrier()
    results["ff bf16"] = run_ff(path, os.path.join(root, "ff16"), False, batch)
    dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        results["peft+bnb (1 process)"] = run_peft(path, os.path.join(root, "peft"), batch)
        systems = list(results)
        rows = list(results["ff 4-bit"])
        print(
            f"Llama {psi / MIB:.0f} MiB fp32 ({args.layers} layers, hidden {args.hidden}), "
            f"{world} gloo ranks; MiB, max over ranks"
        )
        print("| phase | " + " | ".join(systems) + " |")
        print("|---|" + "--:|" * len(systems))
        for row in rows:
            vals = []
            for s in systems:
                if s.startswith("peft"):
                    vals.append(results[s][row])
                else:
                    vals.append(max(g[s][row] for g in gathered))
            print(f"| {row} | " + " | ".join(f"{v / MIB:.1f}" for v in vals) + " |")
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
