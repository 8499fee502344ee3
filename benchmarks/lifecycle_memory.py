"""Peak memory per rank over a model's lifecycle: functional_fsdp vs FSDP2 vs naive.

A ``transformers`` Llama built from a config (untied, fp32 Ψ >= 1 GiB by default) goes
through these phases on every rank of a gloo job, with three systems:

* **create**: sharded parameters for a freshly initialised model;
* **load**: sharded parameters from the safetensors checkpoint that ``save_pretrained`` wrote;
* **train**: one AdamW step on the loaded parameters (the optimizer state is created then:
  before the step by ``TrainState.create``, lazily inside ``step()`` by torch), and a second
  step, the steady state, in which every system holds Adam's state through backward; then
  three more steps, each under ``ff.tensor_peak`` (the least of their peaks of tensor memory
  is printed: exact where resident memory also counts what is not a tensor);
* **export**: a plain safetensors checkpoint written from the trained shards.

Systems:

* ``ff``: the model on meta; ``ff.init_sharded`` (one unit at a time), ``load_safetensors``
  (each rank reads only its rows), ``train_step(donate=True)`` with ``ff.adamw``,
  ``export_safetensors`` (streamed to the first rank);
* ``fsdp2``: torch FSDP2's meta-device recipe: ``fully_shard`` per decoder layer and the root on
  the meta model, ``to_empty``, then the HF init on the local shards (``init_weights``) or DCP's
  ``HuggingFaceStorageReader`` (DCP's planner: each rank reads its chunks); ``torch.optim.AdamW``;
  export with ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` and
  ``save_file`` on rank 0, the documented way to a full checkpoint;
* ``naive``: full materialisation: the model built (or ``from_pretrained``) whole on every rank
  and then sharded with ``ff``; export gathers the full state dict on every rank
  (``full_state_dict``) and rank 0 saves it. Its training step is not run: a replicated step
  holds params, grads and Adam's two moments, 4Ψ per rank (17 GiB over 4 ranks), which this
  shared machine cannot spare; the table shows that figure, computed.

**Method.** Resident memory (RSS) is what the operating system reports in
``/proc/self/status``. Before each phase a rank collects garbage, trims the heap and resets its
peak (``VmHWM``, via ``/proc/self/clear_refs``); after it, the phase's peak is ``VmHWM`` minus
the rank's *baseline*: its RSS once warmed up and holding no model. So a phase's figure counts
everything the model holds then (the shards loaded before a train step, the trained shards
during export) plus the phase's transients, and nothing that does not scale with the model.
Large blocks are mmapped (``M_MMAP_THRESHOLD`` pinned at 64 KiB), so freed tensors leave RSS
at once instead of staying in the heap. Each system first runs all its phases on a tiny model
of the same architecture: the first random init on the meta device imports sympy and the
decompositions (about 28 MiB per process), the first collective sets up gloo, and so on; these
one-time costs are paid before the baseline. Files are read from the page cache, which is not
RSS unless mapped (``from_pretrained`` and ``safe_open`` map the file: mapped pages that are
touched count, as they should). The table shows the maximum over ranks.

Target: Ψ/N + the largest unit + 15% for create, load and export. A train step cannot meet it
with Adam: params, grads and two moments are 4Ψ/N before any gather; its line says
4Ψ/N + 2 units (a unit gathered and the next one prefetched, or a unit and its full gradient in
backward) + 15%.

    torchrun --nproc-per-node 4 benchmarks/lifecycle_memory.py [--layers 23] [--hidden 1024]

The checkpoint (Ψ bytes, twice with the exports) goes to ``--dir`` (a temporary directory by
default, removed afterwards). At the default size the run needs about 8 GiB of host memory at
its peak (naive creation and export: Ψ and more on every rank) and takes about 6 minutes on
two busy cores: check ``free -g`` first.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import functional_fsdp as ff

MiB = 2**20
PHASES = ("create", "load", "train", "train2", "train3", "export")
LABELS = {
    "create": "create",
    "load": "load",
    "train": "train: 1st step",
    "train2": "train: 2nd step",
    "train3": "train: steps 3 to 5, resident under the profiler",
    "export": "export",
}
SYSTEMS = ("ff", "fsdp2", "naive")
LR = 1e-4


# --------------------------------------------------------------------------- measuring


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


_LIBC = ctypes.CDLL("libc.so.6")


def _settle() -> int:
    """Free what can be freed, return the resident size."""
    gc.collect()
    _LIBC.malloc_trim(0)
    return _status("VmRSS")


def _exact_rss() -> None:
    _LIBC.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, large blocks are mmapped
    _LIBC.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD


def _measure(fn: Callable[[], Any], base: int) -> tuple[Any, dict[str, float]]:
    """Run one phase on every rank: its peak RSS above ``base`` and what it leaves held."""
    start_rss = _settle()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    dist.barrier()
    return out, {
        "peak": (peak - base) / MiB,
        "start": (start_rss - base) / MiB,
        "seconds": seconds,
    }


def _least(step: Callable[[], Any], steps: int = 3) -> ff.TensorPeak:
    """The least tensor peak of ``steps`` steps: the profiler misses frees made on gloo's
    worker thread, which can only overstate a peak."""
    return min((ff.tensor_peak(step) for _ in range(steps)), key=lambda p: p.added_bytes)


# --------------------------------------------------------------------------- the model


def _config(layers: int, hidden: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=(hidden * 11) // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _meta_model(config: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _rotary_buffers(config: Any) -> dict[str, torch.Tensor]:
    """The non-persistent rotary tables, which no checkpoint holds."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return {f"model.rotary_emb.{n}": b for n, b in rotary.named_buffers()}


def _batch(config: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (dist.get_world_size(), 128), generator=g)


def _sizes(config: Any, mesh: Any) -> dict[str, float]:
    sm = ff.fsdp(_meta_model(config), mesh)
    psi = sum(p.numel() * p.element_size() for p in sm.module.parameters())
    owned = {n for u in sm.units for n, _ in sm.module.get_submodule(u).named_parameters(u)}
    root = sum(p.numel() * 4 for n, p in sm.module.named_parameters() if n not in owned)
    units = [
        sum(p.numel() * p.element_size() for p in sm.module.get_submodule(u).parameters())
        for u in sm.units
    ]
    return {"psi": psi / MiB, "unit": max([root, *units]) / MiB}


# --------------------------------------------------------------------------- the systems


def run_ff(config: Any, src: str, out: str, mesh: Any) -> dict[str, Callable[[], Any]]:
    sm = ff.fsdp(_meta_model(config), mesh)
    held: dict[str, Any] = {}

    def create() -> None:
        torch.manual_seed(0)  # the same model on every rank (init_sharded checks)
        params, _ = ff.init_sharded(sm)
        del params

    def load() -> None:
        held["params"] = ff.checkpoint.load_safetensors(sm, src)

    def train() -> None:
        buffers = _rotary_buffers(config)
        opt = ff.adamw(LR, weight_decay=0.01)

        def loss_fn(p: dict, b: torch.Tensor) -> torch.Tensor:
            return sm.apply(p, input_ids=b, labels=b, buffers=buffers).loss

        held["step"] = ff.train_step(loss_fn, opt, model=sm, donate=True)
        state = ff.TrainState.create(held.pop("params"), opt)
        held["state"], _ = held["step"](state, _batch(config))

    def train2() -> None:
        held["state"], _ = held["step"](held.pop("state"), _batch(config))

    def train3() -> ff.TensorPeak:
        step, batch = held.pop("step"), _batch(config)
        found = _least(lambda: held.update(state=step(held.pop("state"), batch)[0]))
        held["params"] = held.pop("state").params  # the optimizer state is dropped with it
        return found

    def export() -> None:
        ff.checkpoint.export_safetensors(sm, held.pop("params"), out)

    return {
        "create": create,
        "load": load,
        "train": train,
        "train2": train2,
        "train3": train3,
        "export": export,
    }


def _fsdp2_model(config: Any, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _meta_model(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, value in _rotary_buffers(config).items():
            model.get_buffer(name).copy_(value)
    return model


def run_fsdp2(config: Any, src: str, out: str, mesh: Any) -> dict[str, Callable[[], Any]]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    held: dict[str, Any] = {}

    def create() -> None:
        model = _fsdp2_model(config, mesh)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", UserWarning)  # DTensor random ops on a CPU mesh
            model.init_weights()  # the HF init, on each rank's local shards
        del model

    def load() -> None:
        model = _fsdp2_model(config, mesh)
        state_dict = model.state_dict()
        dcp.load(state_dict, storage_reader=dcp.HuggingFaceStorageReader(src))
        held["model"] = model

    def train() -> None:
        model = held["model"]
        held["opt"] = opt = torch.optim.AdamW(model.parameters(), lr=LR)
        ids = _batch(config)[dist.get_rank() :: dist.get_world_size()]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step() -> None:
        model, opt = held["model"], held["opt"]
        ids = _batch(config)[dist.get_rank() :: dist.get_world_size()]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def train3() -> ff.TensorPeak:
        found = _least(step)
        del held["opt"]
        return found

    def export() -> None:
        model = held.pop("model")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(model, options=options)
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            save_file(state_dict, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        del state_dict, model

    return {
        "create": create,
        "load": load,
        "train": train,
        "train2": step,
        "train3": train3,
        "export": export,
    }


def run_naive(config: Any, src: str, out: str, mesh: Any) -> dict[str, Callable[[], Any]]:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    held: dict[str, Any] = {}

    def create() -> None:
        torch.manual_seed(0)  # the same full model on every rank, as shard() checks
        model = LlamaForCausalLM(config)
        params = ff.fsdp(model, mesh).shard()
        del model, params

    def load() -> None:
        model = LlamaForCausalLM.from_pretrained(src)
        held["sm"] = ff.fsdp(_meta_model(config), mesh)
        held["params"] = ff.fsdp(model, mesh).shard()
        del model

    def export() -> None:
        sm, params = held.pop("sm"), held.pop("params")
        state_dict = ff.checkpoint.full_state_dict(sm, params)
        del params
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            kept = {k: v for k, v in state_dict.items() if "rotary" not in k}
            save_file(kept, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        del state_dict

    return {"create": create, "load": load, "export": export}


RUNNERS = {"ff": run_ff, "fsdp2": run_fsdp2, "naive": run_naive}


# --------------------------------------------------------------------------- main


def _save_source(config: Any, folder: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    del model


def _one_system(system: str, config: Any, tiny: Any, root: str, mesh: Any) -> dict[str, Any]:
    """Warm up on the tiny model, then measure every phase on the big one."""
    warm = RUNNERS[system](tiny, f"{root}/tiny", f"{root}/out-tiny-{system}", mesh)
    for phase in PHASES:
        if phase in warm:
            warm[phase]()
    del warm
    base = _settle()
    dist.barrier()
    phases = RUNNERS[system](config, f"{root}/src", f"{root}/out-{system}", mesh)
    results: dict[str, Any] = {"base": base / MiB}
    for phase in PHASES:
        if phase in phases:
            out, results[phase] = _measure(phases[phase], base)
            if isinstance(out, ff.TensorPeak):
                results["tensors"] = out.added_bytes / MiB
                results["where"] = out.describe(10)
    del phases
    results["after"] = (_settle() - base) / MiB
    return results


def main() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=23)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    _exact_rss()
    mesh = ff.make_mesh({"dp": int(os.environ.get("WORLD_SIZE", "1"))})
    n, rank = dist.get_world_size(), dist.get_rank()
    config, tiny = _config(args.layers, args.hidden), _config(2, 64)
    root = args.dir or (tempfile.mkdtemp(prefix="lifecycle-") if rank == 0 else "")
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    if rank == 0:
        _save_source(tiny, f"{root}/tiny")
        if not os.path.exists(f"{root}/src/config.json"):
            _save_source(config, f"{root}/src")
    dist.barrier()
    sizes = _sizes(config, mesh)
    all_results: dict[str, list[dict[str, Any]]] = {}
    for system in args.systems.split(","):
        mine = _one_system(system, config, tiny, root, mesh)
        gathered: list[Any] = [None] * n
        dist.all_gather_object(gathered, mine)
        all_results[system] = gathered
    if rank == 0:
        _print(all_results, sizes, n, config)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _print(results: dict[str, list[dict]], sizes: dict[str, float], n: int, config: Any) -> None:
    psi, unit = sizes["psi"], sizes["unit"]
    target = (psi / n + unit) * 1.15
    train_target = (4 * psi / n + 2 * unit) * 1.15
    print(
        f"Llama {config.num_hidden_layers} layers x {config.hidden_size} (vocab "
        f"{config.vocab_size}, untied): Ψ = {psi:.0f} MiB fp32, largest unit {unit:.0f} MiB, "
        f"{n} gloo ranks, Ψ/N = {psi / n:.0f} MiB\n"
        f"target (Ψ/N + unit) x 1.15 = {target:.0f} MiB; train step (4Ψ/N + 2 units) x 1.15 "
        f"= {train_target:.0f} MiB\n"
    )
    names = {"ff": "functional_fsdp", "fsdp2": "FSDP2 meta recipe", "naive": "naive"}
    systems = list(results)
    print(
        "| phase (peak MiB per rank, max over ranks) | "
        + " | ".join(names[s] for s in systems)
        + " | target |"
    )
    print("|---|" + "---|" * (len(systems) + 1))
    for phase in PHASES:
        cells = []
        for s in systems:
            rows = [r[phase] for r in results[s] if phase in r]
            if rows:
                peak = max(r["peak"] for r in rows)
                secs = max(r["seconds"] for r in rows)
                cells.append(f"{peak:.0f} ({secs:.1f} s)")
            else:
                cells.append(f"not run (4Ψ = {4 * psi:.0f}, computed)")
        goal = train_target if phase.startswith("train") else target
        print(f"| {LABELS[phase]} | " + " | ".join(cells) + f" | {goal:.0f} |")
    tensors = {s: [r["tensors"] for r in results[s] if "tensors" in r] for s in systems}
    if any(tensors.values()):
        print(
            "| train: steps 3 to 5, least peak tensor memory a step adds (ff.tensor_peak) | "
            + " | ".join(f"{max(tensors[s]):.0f}" if tensors[s] else "not run" for s in systems)
            + " | |"
        )
    for s in systems:
        if results[s][0].get("where"):
            print(f"\nLive at {names[s]}'s least peak, rank 0:\n" + results[s][0]["where"], end="")
    print("\nbaseline RSS per rank (MiB, max) and what stayed resident after the last phase:")
    for s in systems:
        base = max(r["base"] for r in results[s])
        after = max(r["after"] for r in results[s])
        starts = {
            p: max(r[p]["start"] for r in results[s] if p in r)
            for p in PHASES
            if p in results[s][0]
        }
        print(
            f"  {names[s]}: baseline {base:.0f}, after {after:+.0f}, held at phase starts "
            + ", ".join(f"{p} {v:+.0f}" for p, v in starts.items())
        )


if __name__ == "__main__":
    main()
