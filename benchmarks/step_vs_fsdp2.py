"""One GPT training step (forward, backward, SGD update): functional_fsdp vs torch FSDP2,
and the ZeRO paper's ZeRO-1/2 vs DDP.

The library's step (under ``torch.func.grad_and_value``, and under plain ``loss.backward()``)
and torch FSDP2's run in the same processes on the same model, batch and mesh, in rotation
step by step (each in every position) so that machine noise hits them alike. With ``--zero``
the rotation also holds ``ff.train_step`` with replicated parameters as DDP, ZeRO-1 and ZeRO-2
(optimizer state sharded, gradients reduce-scattered, parameters all-gathered) and torch's
``DistributedDataParallel``. Prints, as a Markdown table (``--json``: into benchmarks/results/): the median step
time and the ratios, the collectives and bytes each rank sends per step, and the peak memory
a step adds on top of the resting process (the median of ``--memory-steps`` steps, and their
range), and the peak of tensor memory a step adds (``ff.tensor_peak``: exact, the figure a
GPU's allocator reports; ``--where`` lists the tensors live at each system's peak).

    torchrun --nproc-per-node 2 benchmarks/step_vs_fsdp2.py [--steps 30] [--layers 4] [--width 256]
    torchrun --nproc-per-node 2 benchmarks/step_vs_fsdp2.py --zero     # + DDP, ZeRO-1, ZeRO-2
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import functional_fsdp as ff
from functional_fsdp.models import GPT, GPTConfig, lm_loss

# Ring-algorithm bytes a rank sends, as a fraction of the buffer: matches ff.count_comms.
_C10D_KINDS = {
    "_allgather_base_": ("all_gather", 1, 0),  # output buffer
    "allgather_into_tensor_coalesced_": ("all_gather", 1, 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 1),  # input buffer
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
    "allreduce_": ("all_reduce", 2, 0),
}


_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class _CountC10d(TorchDispatchMode):
    """Count the c10d collectives torch FSDP2 issues, with the bytes of a ring algorithm."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.counts: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d" and name in _C10D_KINDS:
            kind, factor, arg = _C10D_KINDS[name]
            tensors = args[arg] if isinstance(args[arg], list) else [args[arg]]
            tensors = [t for x in tensors for t in (x if isinstance(x, list) else [x])]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            entry = self.counts.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += factor * nbytes * (self.world - 1) // self.world
        return func(*args, **(kwargs or {}))


def _rotation(names: list[str], step: int) -> list[str]:
    """``names`` rotated by ``step``: over ``len(names)`` steps each takes every position."""
    k = step % len(names)
    return names[k:] + names[:k]


def _rss_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")  # pragma: no cover - not Linux


def _step_peak_mib(step: Callable[[], None]) -> float:
    """Peak resident memory one step adds on top of the process before it (Linux only).

    Allocations of 64 KiB and more are served by mmap, so freed memory leaves the process at
    once and the resident set follows the live tensors; the high-water mark is reset first.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)  # hand back the heap's free memory, so that reuse shows as growth
    dist.barrier()
    before = _rss_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    step()
    return _rss_mib("VmHWM") - before


def _replicated_steps(
    model: torch.nn.Module, mesh: Any, lr: float
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    """``ff.train_step`` with replicated parameters as DDP, ZeRO-1 and ZeRO-2, and torch DDP."""
    from torch.nn.parallel import DistributedDataParallel

    replicated = ff.fsdp(model, mesh, specs=ff.P())
    opt = ff.sgd(lr)

    def loss_fn(p: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm_loss(replicated.apply(p, b[0]), b[1])

    out: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {}
    for name, opt_specs, mode in (
        ("DDP (train_step)", None, "reduce_each"),
        ("ZeRO-1 (train_step)", ff.P("dp"), "local"),
        ("ZeRO-2 (train_step)", ff.P("dp"), "reduce_each"),
    ):
        step = ff.train_step(loss_fn, opt, model=replicated, batch="local", accumulate_mode=mode)
        holder = {"state": ff.TrainState.create(replicated.shard(), opt, opt_specs=opt_specs)}

        def run(x: torch.Tensor, y: torch.Tensor, step: Any = step, holder: Any = holder) -> None:
            holder["state"], _ = step(holder["state"], (x, y))

        out[name] = run
    ddp = DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=lr)

    def torch_ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        lm_loss(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)

    out["torch DDP"] = torch_ddp_step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--zero", action="store_true", help="add DDP, ZeRO-1 and ZeRO-2")
    parser.add_argument(
        "--memory-steps", type=int, default=5, help="steps per system whose peak is measured"
    )
    parser.add_argument(
        "--where", action="store_true", help="list the tensors live at each system's peak"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="record the figures in benchmarks/results/step_vs_fsdp2.json (for plot_results.py)",
    )
    args = parser.parse_args()

    ff.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width
    )
    model = GPT(cfg)
    mesh = ff.make_mesh({"dp": world})
    lr = 1e-3

    # functional_fsdp: a pure step over Sharded params, with the library's optimizer.
    sharded_model = ff.fsdp(model, mesh)
    state: dict[str, Any] = {"params": sharded_model.shard()}
    opt = ff.sgd(lr)
    state["opt"] = opt.init(state["params"])

    def ours_step(x: torch.Tensor, y: torch.Tensor) -> None:
        params = state["params"]
        grads, _loss = torch.func.grad_and_value(lambda p: lm_loss(sharded_model.apply(p, x), y))(
            params
        )
        updates, state["opt"] = opt.update(grads, state["opt"], params)
        state["params"] = ff.apply_updates(params, updates)

    def ours_autograd_step(x: torch.Tensor, y: torch.Tensor) -> None:
        # The same library under plain autograd: leaves that require grad, loss.backward().
        params = state["params"]
        leaves = {k: v.local.detach().requires_grad_() for k, v in params.items()}
        lm_loss(
            sharded_model.apply({k: v.replace(leaves[k]) for k, v in params.items()}, x), y
        ).backward()
        grads = {k: v.replace(leaves[k].grad) for k, v in params.items()}
        updates, state["opt"] = opt.update(grads, state["opt"], params)
        state["params"] = ff.apply_updates(params, updates)

    # The same step as ff.train_step runs it, with the state donated (updated in place).
    def loss_fn(p: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm_loss(sharded_model.apply(p, b[0]), b[1])

    donated_step = ff.train_step(loss_fn, opt, model=sharded_model, batch="local", donate=True)
    donated = {"state": ff.TrainState.create(sharded_model.shard(), opt)}

    def ours_donated_step(x: torch.Tensor, y: torch.Tensor) -> None:
        donated["state"], _ = donated_step(donated["state"], (x, y))

    # torch FSDP2 on a copy of the same model, one unit per block plus the root.
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=lr)

    def fsdp2_step(x: torch.Tensor, y: torch.Tensor) -> None:
        lm_loss(ref(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)

    systems = {
        "functional_fsdp (torch.func)": ours_step,
        "functional_fsdp (autograd)": ours_autograd_step,
        "functional_fsdp (train_step, donated)": ours_donated_step,
        "torch FSDP2": fsdp2_step,
    }
    if args.zero:
        systems.update(_replicated_steps(model, mesh, lr))
    g = torch.Generator().manual_seed(rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]

    times: dict[str, list[float]] = {name: [] for name in systems}
    for step in range(args.steps + 2):
        x, y = batch()
        order = _rotation(list(systems), step)
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            systems[name](x, y)
            dist.barrier()
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)

    # Collectives per step, then memory per step (after the timing: mmap-only allocation).
    x, y = batch()
    comms: dict[str, dict[str, list[int]]] = {}
    for name, fn in systems.items():
        if name.startswith("torch"):
            counting = _CountC10d(world)
            with counting:
                fn(x, y)
            comms[name] = counting.counts
        else:
            with ff.count_comms() as counter:
                fn(x, y)
            comms[name] = {k: [counter.count(k), counter.bytes(k)] for k in _KINDS}
    # One step's peak is noisy (a few MiB on a shared machine): each system's is taken on
    # --memory-steps steps, in rotation as above, and the median is reported with the range.
    peaks: dict[str, list[float]] = {name: [] for name in systems}
    for step in range(args.memory_steps):
        order = _rotation(list(systems), step)
        for name in order:
            peaks[name].append(_step_peak_mib(lambda f=systems[name]: f(x, y)))
    peak = {name: statistics.median(v) for name, v in peaks.items()}
    spread = {name: (min(v), max(v)) for name, v in peaks.items()}
    # The tensors alone (torch's profiler): the figure a GPU's allocator would show. A free
    # made on gloo's thread goes unrecorded, which can only overstate a peak: the least of
    # --memory-steps steps is reported.
    found: dict[str, list[ff.TensorPeak]] = {name: [] for name in systems}
    for step in range(args.memory_steps):
        order = _rotation(list(systems), step)
        for name in order:
            found[name].append(ff.tensor_peak(lambda f=systems[name]: f(x, y)))
    tensors = {name: min(v, key=lambda p: p.added_bytes) for name, v in found.items()}

    if rank == 0:
        _report(args, cfg, model, world, times, comms, peak, spread, tensors)
        if args.where:
            for name, found in tensors.items():
                print(f"\nLive at {name}'s peak ({found.added_mib:.2f} MiB added):")
                print(found.describe(16), end="")
    dist.barrier()
    dist.destroy_process_group()


def _report(
    args: argparse.Namespace,
    cfg: GPTConfig,
    model: torch.nn.Module,
    world: int,
    times: dict[str, list[float]],
    comms: dict[str, dict[str, list[int]]],
    peak: dict[str, float],
    spread: dict[str, tuple[float, float]],
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
    row("step time / torch FSDP2", lambda n: f"{med[n] / med['torch FSDP2']:.3f}")
    if "DDP (train_step)" in med:
        row("step time / DDP (train_step)", lambda n: f"{med[n] / med['DDP (train_step)']:.3f}")
    for kind in _KINDS:
        if any(comms[n].get(kind, [0, 0])[0] for n in names):
            count = {n: comms[n].get(kind, [0, 0]) for n in names}
            row(
                f"{kind.replace('_', '-')}s: count, MiB sent",
                lambda n, c=count: f"{c[n][0]}, {c[n][1] / 2**20:.2f}",  # type: ignore[misc]
            )
    row(
        f"peak memory added by a step (MiB, median of {args.memory_steps})",
        lambda n: f"{peak[n]:.1f}",
    )
    row("its range over those steps (MiB)", lambda n: f"{spread[n][0]:.1f} – {spread[n][1]:.1f}")
    row(
        f"peak tensor memory added by a step (MiB, least of {args.memory_steps})",
        lambda n: f"{tensors[n].added_mib:.2f}",
    )
    row(
        "tensor peak / torch FSDP2",
        lambda n: f"{tensors[n].added_bytes / tensors['torch FSDP2'].added_bytes:.3f}",
    )
    print(
        f"GPT: {cfg.n_layer} layers, width {cfg.n_embd}, vocab {cfg.vocab_size}, "
        f"{psi / 2**20:.1f} MiB of fp32 parameters (Ψ); {world} ranks (gloo, CPU, "
        f"{torch.get_num_threads()} thread each); batch {args.batch}×{args.seq} per rank; "
        f"median of {args.steps} steps, taken in rotation.\n"
    )
    if args.json:
        from _results import record

        systems = {
            n: {
                "time_ratio": round(med[n] / med["torch FSDP2"], 3),
                "median_ms": round(med[n], 1),
                "tensor_peak_mib": round(tensors[n].added_mib, 2),
                "resident_peak_mib": round(peak[n], 1),
            }
            for n in names
        }
        figures = {"width": cfg.n_embd, "param_mib": round(psi / 2**20, 1), "systems": systems}
        record("step_vs_fsdp2", f"width={cfg.n_embd}", figures, nproc=world)
    print(_markdown(rows))
    print(
        f"\nBytes are those a rank sends in a ring algorithm. Full sharding expects "
        f"all-gather 2Ψ(N-1)/N = {2 * psi * (world - 1) / world / 2**20:.2f} MiB and "
        f"reduce-scatter Ψ(N-1)/N = {psi * (world - 1) / world / 2**20:.2f} MiB; torch FSDP2 "
        f"keeps the root unit gathered between forward and backward.\n"
        f"Command: torchrun --nproc-per-node {world} benchmarks/step_vs_fsdp2.py "
        + " ".join(sys.argv[1:])
    )


def _markdown(rows: list[list[str]]) -> str:
    """A GitHub Markdown table, columns padded; the first column left-aligned, others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ":" + "-" * (w + 1) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


if __name__ == "__main__":
    main()
