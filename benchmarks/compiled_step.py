"""A whole compiled training step (``ff.jit``) against eager steps and torch's compile recipes.

One GPT training step (forward, backward, gradient clipping, AdamW) run six ways in the same
processes on the same batches, in rotation step by step (each system in every position, so
machine noise hits them alike):

* ``ff.train_step`` eager, and the same step under ``ff.jit`` (traced once, compiled by
  inductor, replayed): FSDP (ZeRO-3) over all ranks;
* torch FSDP2 (``fully_shard`` per block and the root, ``torch.optim.AdamW``), eager, and with
  ``torch.compile`` per block before sharding (torchtitan's recipe; the collectives and the
  optimizer stay outside the compiled code);
* local eager and local compiled (``torch.compile`` of the model): one process's model on this
  rank's share of the batch, no communication, as a floor.

Prints a Markdown table: median step time and ratios, compile time (the first call's extra
time), the peak memory one step adds (resident) and the peak of tensor memory it adds
(``ff.tensor_peak``; ``--where`` lists the tensors live at each system's peak, by the
operator or compiled region that allocated them). Run it twice: the second run reuses inductor's
caches (``TORCHINDUCTOR_CACHE_DIR``, by default under ``/tmp``), so its compile times are
those of a warm cache.

    torchrun --nproc-per-node 2 benchmarks/compiled_step.py [--steps 30] [--layers 4] [--width 128]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from step_vs_fsdp2 import _markdown, _step_peak_mib
from torch.distributed.fsdp import fully_shard

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

LR, CLIP = 3e-3, 1.0

Batch = tuple[torch.Tensor, torch.Tensor]


def _torch_step(model: torch.nn.Module) -> Callable[[Batch], None]:
    """``loss.backward()``, clipping and ``torch.optim.AdamW`` on a torch module."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=True)

    def step(b: Batch) -> None:
        lm_loss(model(b[0]), b[1]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _fsdp2(model: torch.nn.Module, mesh: Any, compiled: bool) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        if compiled:  # torchtitan: compile each block, then shard it
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    return ref


def _peak_mib(step: Callable[[], None], device: torch.device) -> float:
    """Peak memory one step adds: resident memory on the CPU, allocated memory on a GPU."""
    if device.type != "cuda":
        return _step_peak_mib(step)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument(
        "--where", action="store_true", help="list the tensors live at each system's peak"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="record the figures in benchmarks/results/compiled_step.json (for plot_results.py)",
    )
    args = parser.parse_args()

    device = ff.init_distributed()  # cuda:LOCAL_RANK with NCCL where there is a GPU
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    model = GPT(cfg).to(device)
    mesh = ff.make_mesh({"dp": world}, device_type=device.type)

    sharded_model = ff.fsdp(model, mesh)
    opt = ff.chain(ff.clip_by_global_norm(CLIP, eps=1e-6), ff.adamw(LR, weight_decay=0.1))
    step = ff.train_step(
        lambda p, b: lm_loss(sharded_model.apply(p, b[0]), b[1]),
        opt,
        model=sharded_model,
        batch="local",
        donate=True,
    )
    jitted = ff.jit(step)
    held = {
        "eager": ff.TrainState.create(sharded_model.shard(), opt),
        "jit": ff.TrainState.create(sharded_model.shard(), opt),
    }

    def ours(which: str, fn: Callable[..., Any]) -> Callable[[Batch], None]:
        def run(b: Batch) -> None:
            held[which], metrics = fn(held[which], b)
            metrics["loss"].item()  # the step's end, as a training loop reads its loss

        return run

    local = copy.deepcopy(model)
    local_compiled = copy.deepcopy(model)
    local_compiled.compile()
    systems: dict[str, Callable[[Batch], None]] = {
        "ff eager": ours("eager", step),
        "ff.jit": ours("jit", jitted),
        "FSDP2 eager": _torch_step(_fsdp2(model, mesh, compiled=False)),
        "FSDP2 + compile per block": _torch_step(_fsdp2(model, mesh, compiled=True)),
        "local eager": _torch_step(local),
        "local compiled": _torch_step(local_compiled),
    }
    g = torch.Generator().manual_seed(rank)

    def batch() -> Batch:
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        idx = idx.to(device)
        return idx[:, :-1], idx[:, 1:]

    first: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(args.steps + 2):
        b = batch()
        order = list(systems)[i % len(systems) :] + list(systems)[: i % len(systems)]
        for name in list(systems) if i == 0 else order:
            dist.barrier()
            t0 = time.perf_counter()
            systems[name](b)
            dist.barrier()
            if i == 0:
                first[name] = time.perf_counter() - t0
            elif i >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    compiled = jitted.lower(held["jit"], batch())
    alone = _collectives_alone(jitted.comms(held["jit"], batch()).records, mesh, device)
    alone()  # warm-up
    comm_ms = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        alone()
        comm_ms.append((time.perf_counter() - t0) * 1e3)
    b = batch()
    peak = {name: _peak_mib(lambda f=fn: f(b), device) for name, fn in systems.items()}
    # The tensors alone (ff.tensor_peak): the least of three steps, each system in turn.
    found: dict[str, list[ff.TensorPeak]] = {name: [] for name in systems}
    for _ in range(3):
        for name, fn in systems.items():
            found[name].append(ff.tensor_peak(lambda f=fn: f(b), device.type))
    tensors = {name: min(v, key=lambda p: p.added_bytes) for name, v in found.items()}
    if rank == 0:
        _report(args, cfg, model, world, times, first, peak, compiled, tensors)
        gap = (
            statistics.median(times["ff.jit"]) - statistics.median(times["local compiled"])
        ) * 1e3
        print(
            f"The step's {len(compiled.records)} collectives alone (those of ff.jit's graph, "
            f"back to back, each waited): {statistics.median(comm_ms):.1f} ms (median); "
            f"ff.jit minus local compiled: {gap:.1f} ms."
        )
        if args.where:
            for name, at in tensors.items():
                print(f"\nLive at {name}'s peak ({at.added_mib:.2f} MiB added):")
                print(at.describe(12), end="")
    dist.barrier()
    dist.destroy_process_group()


def _report(
    args: argparse.Namespace,
    cfg: GPTConfig,
    model: torch.nn.Module,
    world: int,
    times: dict[str, list[float]],
    first: dict[str, float],
    peak: dict[str, float],
    compiled: Any,
    tensors: dict[str, ff.TensorPeak],
) -> None:
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    names = list(times)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    quart = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
    rows: list[list[str]] = [["per rank, per step", *names]]

    def row(label: str, fn: Callable[[str], str]) -> None:
        rows.append([label, *(fn(n) for n in names)])

    row("median step time (ms)", lambda n: f"{med[n]:.1f}")
    row("interquartile range (ms)", lambda n: f"{quart[n][0] * 1e3:.0f} – {quart[n][2] * 1e3:.0f}")
    row("step time / ff eager", lambda n: f"{med[n] / med['ff eager']:.3f}")
    row("step time / local eager", lambda n: f"{med[n] / med['local eager']:.3f}")
    row("first call, minus a step (s)", lambda n: f"{first[n] - med[n] / 1e3:.1f}")
    row("peak memory added by a step (MiB)", lambda n: f"{peak[n]:.1f}")
    row("peak tensor memory added by a step (MiB)", lambda n: f"{tensors[n].added_mib:.2f}")
    row(
        "tensor peak / FSDP2 eager",
        lambda n: f"{tensors[n].added_bytes / tensors['FSDP2 eager'].added_bytes:.3f}",
    )
    print(
        f"GPT: {cfg.n_layer} layers, width {cfg.n_embd}, vocab {cfg.vocab_size}, "
        f"{psi / 2**20:.1f} MiB of fp32 parameters; {world} ranks ({dist.get_backend()}, "
        f"{_where()}); batch {args.batch}×{args.seq} per rank; "
        f"AdamW with clipping; median of {args.steps} steps, taken in rotation.\n"
    )
    if args.json:
        from _results import record

        systems = {
            n: {
                "time_ratio": round(med[n] / med["ff eager"], 3),
                "median_ms": round(med[n], 1),
                "tensor_peak_mib": round(tensors[n].added_mib, 2),
                "resident_mib": round(peak[n], 1),
            }
            for n in names
        }
        figures = {"width": cfg.n_embd, "param_mib": round(psi / 2**20, 1), "systems": systems}
        record("compiled_step", f"width={cfg.n_embd}", figures, nproc=world)
    print(_markdown(rows))
    print(
        f"\nff.jit's first call: trace {compiled.trace_seconds:.1f} s, inductor "
        f"{compiled.compile_seconds:.1f} s. 'local' runs one process's model on this rank's "
        f"share of the batch, with no communication.\n"
        f"Command: torchrun --nproc-per-node {world} benchmarks/compiled_step.py "
        + " ".join(sys.argv[1:])
    )


def _collectives_alone(records: Any, mesh: Any, device: torch.device) -> Callable[[], None]:
    """The collectives ``records`` lists (as ``count_comms`` records them), issued one after
    the other and each waited, on buffers of their sizes: what the communication of a step
    costs with nothing to overlap it."""
    from functional_fsdp.distributed import collectives as C

    calls: list[Callable[[], object]] = []
    for r in records:
        n = r.group_size
        elems = r.bytes * n // ((n - 1) * r.dtype.itemsize)  # the gathered or input buffer
        if r.kind == "all_gather":
            x = torch.zeros(elems // n, dtype=r.dtype, device=device)
            calls.append(lambda x=x, a=r.axis: C.wait(C.raw_all_gather_parts([x], mesh, a)))
        elif r.kind == "reduce_scatter":
            x = torch.zeros(n, elems // n, dtype=r.dtype, device=device)
            calls.append(lambda x=x, a=r.axis: C.wait(C.raw_reduce_scatter(x, mesh, a)))
        else:  # an all-reduce sends its buffer twice
            x = torch.zeros(max(elems // 2, 1), dtype=r.dtype, device=device)
            calls.append(lambda x=x, a=r.axis: C.wait(C.raw_all_reduce(x, mesh, a)))

    def run() -> None:
        for call in calls:
            call()

    return run


def _where() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU, {torch.get_num_threads()} thread each"


if __name__ == "__main__":
    main()
