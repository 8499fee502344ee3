"""Turn the benchmarks' figures (``benchmarks/results/*.json``) into docs/results.md's plots
and tables.

Each benchmark's block of ``docs/results.md`` sits between
``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` and is rewritten from
``benchmarks/results/NAME.json``: where every figure comes from (command, commit, date,
machine), its table, and its plot (``docs/images/NAME.png``). The prose between the blocks
is the page's own. ``tests/test_results_page.py`` checks that the page is what this script
writes.

    python benchmarks/plot_results.py           # rewrite docs/results.md and docs/images/
    python benchmarks/plot_results.py --check   # exit 1 if the page differs from the JSON
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
IMAGES = ROOT / "docs" / "images"
BLOCK = re.compile(r"<!-- generated: (\w+) -->\n.*?<!-- end generated: \1 -->", re.S)

# One colour per system, the same in every plot.
COLOURS = {
    "ff eager": "#1f77b4",
    "torch.func": "#1f77b4",
    "ff.jit": "#2ca02c",
    "autograd": "#17becf",
    "train_step(donate=True)": "#9467bd",
    "FSDP2 eager": "#d62728",
    "torch FSDP2": "#d62728",
    "FSDP2 + compile per block": "#ff7f0e",
    "local eager": "#7f7f7f",
    "local compiled": "#bcbd22",
    "exact": "#1f77b4",
    "int8 weights + int8 grads": "#ff7f0e",
    "int8 weights + 4-bit grads": "#2ca02c",
    "float8 weights": "#9467bd",
    "exact, no collectives": "#7f7f7f",
    "exact, ff.jit": "#17becf",
    "int8 weights + int8 grads, ff.jit": "#bcbd22",
}


def _size_axis(ax: Any, sizes: list[float]) -> None:
    """A log axis of model sizes, labelled at the sizes measured."""
    ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("fp32 parameters (MiB)")


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _num(x: Any, digits: int) -> str:
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    align = align or ":--" + "|--:" * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "|" + align + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _source(run: dict[str, Any]) -> str:
    return (
        f"`{run['command']}` at {run['commit']}, {run['date']}, on {run['machine']} "
        f"({run['source']})."
    )


def _sources(data: dict[str, Any]) -> str:
    runs = data["runs"]
    if len({(r["commit"], r["date"], r["machine"], r["source"]) for r in runs}) == 1:
        commands = ", ".join(f"`{r['command']}`" for r in runs)
        r = runs[0]
        return (
            f"*{data['description']}*\n\nMeasured with {commands} at {r['commit']}, "
            f"{r['date']}, on {r['machine']} ({r['source']})."
        )
    return f"*{data['description']}*\n\n" + "\n".join(f"- {_source(r)}" for r in runs)


def _image(name: str, alt: str) -> str:
    return f"![{alt}](images/{name}.png)"


# --------------------------------------------------------------------------- benchmarks


def step_vs_fsdp2(data: dict[str, Any]) -> str:
    names = ["torch.func", "autograd", "train_step(donate=True)", "torch FSDP2"]
    rows = []
    for run in data["runs"]:
        f, s = run["figures"], run["figures"]["systems"]
        ref = s["torch FSDP2"]
        time = [f"{s[n]['time_ratio']:.3f}" for n in names]
        time[-1] += f" ({ref['median_ms']} ms)"
        rows.append([f"{f['width']} ({f['param_mib']} MiB)", "step time / torch FSDP2", *time])
        rows.append(
            [
                "",
                "tensor peak, MiB (/ FSDP2)",
                *(
                    f"{s[n]['tensor_peak_mib']:.2f}"
                    + (
                        f" ({s[n]['tensor_peak_mib'] / ref['tensor_peak_mib']:.3f})"
                        if n != "torch FSDP2"
                        else ""
                    )
                    for n in names
                ),
            ]
        )
        rows.append(["", "resident peak, MiB", *(f"{s[n]['resident_peak_mib']}" for n in names)])
    header = ["width (fp32 Ψ)", "per rank, per step", "torch.func", "autograd"]
    header += ["`train_step(donate=True)`", "torch FSDP2"]
    table = _table(header, rows, ":--|:--" + "|--:" * 4)
    return "\n\n".join(
        [
            _image("step_vs_fsdp2", "step time and tensor memory against torch FSDP2"),
            _sources(data),
            table,
        ]
    )


def plot_step_vs_fsdp2(data: dict[str, Any], plt: Any) -> Any:
    names = ["torch.func", "autograd", "train_step(donate=True)", "torch FSDP2"]
    sizes = [r["figures"]["param_mib"] for r in data["runs"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for n in names:
        s = [r["figures"]["systems"] for r in data["runs"]]
        style = dict(marker="o", label=n, color=COLOURS[n])
        a.plot(sizes, [x[n]["time_ratio"] for x in s], **style)
        b.plot(
            sizes,
            [x[n]["tensor_peak_mib"] / x["torch FSDP2"]["tensor_peak_mib"] for x in s],
            **style,
        )
    a.set(title="step time / torch FSDP2")
    b.set(title="tensor peak a step adds / FSDP2")
    for ax in (a, b):
        _size_axis(ax, sizes)
    a.legend(fontsize=8)
    return fig


def compiled_step(data: dict[str, Any]) -> str:
    time = ["ff.jit", "FSDP2 eager", "FSDP2 + compile per block", "local eager"]
    time += ["local compiled"]
    mem = ["ff eager", "ff.jit", "FSDP2 eager", "FSDP2 + compile per block"]
    rows = []
    for run in data["runs"]:
        f, s = run["figures"], run["figures"]["systems"]
        cells = [f"{s[n]['time_ratio']:.3f}" for n in time]
        for other in f.get("other_runs", []):
            cells = [f"{c}, {other['time_ratio'][n]:.3f}" for c, n in zip(cells, time, strict=True)]
        tensors = " / ".join(f"{s[n]['tensor_peak_mib']:.2f}" for n in mem)
        resident = " / ".join(f"{s[n]['resident_mib']}" for n in mem)
        for other in f.get("other_runs", []):
            resident += "; " + " / ".join(f"{other['resident_mib'][n]}" for n in mem)
        label = f"{f['width']} ({f['param_mib']} MiB)"
        if f.get("other_runs"):
            label += ", the example's"
            cells[0] += f" ({1 + len(f['other_runs'])} runs)"
        rows.append([label, *cells, tensors, resident])
    header = ["width (fp32 parameters)", "`ff.jit`", "FSDP2 eager", "FSDP2 + compile per block"]
    header += ["local eager", "local compiled"]
    header += ["tensors: ff eager / `ff.jit` / FSDP2 / FSDP2 + compile", "resident, same order"]
    return "\n\n".join(
        [
            _image("compiled_step", "step time relative to this library's eager step"),
            _sources(data),
            _table(header, rows, "---" + "|---" * 7),
        ]
    )


def plot_compiled_step(data: dict[str, Any], plt: Any) -> Any:
    names = ["ff eager", "ff.jit", "FSDP2 eager", "FSDP2 + compile per block"]
    names += ["local eager", "local compiled"]
    sizes = [r["figures"]["param_mib"] for r in data["runs"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for n in names:
        s = [r["figures"]["systems"][n] for r in data["runs"]]
        style = dict(marker="o", label=n, color=COLOURS[n])
        a.plot(sizes, [x["time_ratio"] for x in s], **style)
        if "tensor_peak_mib" in s[0]:
            fsdp2 = [r["figures"]["systems"]["FSDP2 eager"] for r in data["runs"]]
            ratio = [x["tensor_peak_mib"] / f["tensor_peak_mib"] for x, f in zip(s, fsdp2)]
            b.plot(sizes, ratio, **style)
    a.set(title="step time / this library's eager step")
    b.set(title="tensor memory a step adds / FSDP2 eager")
    for ax in (a, b):
        _size_axis(ax, sizes)
    a.legend(fontsize=8)
    return fig


def zero_vs_ddp(data: dict[str, Any]) -> str:
    (run,) = data["runs"]
    s = run["figures"]["systems"]
    other = run["figures"]["other_runs"][0]
    rows = [
        [n, f"{v['time_ratio']:.3f}" + (f", {other[n]:.3f}" if n in other else "")]
        for n, v in s.items()
    ]
    return "\n\n".join([_sources(data), _table(["system", "step time / DDP (train_step)"], rows)])


def step_2d_vs_fsdp2_tp(data: dict[str, Any]) -> str:
    (run,) = data["runs"]
    s = run["figures"]["systems"]
    names = list(s)
    ref = s[names[-1]]["median_ms"]
    rows = [
        ["median step", *(f"{s[n]['median_ms']} ms" for n in names)],
        ["ratio", *(f"{s[n]['median_ms'] / ref:.3f}".rstrip("0").rstrip(".") for n in names)],
    ]
    for kind in s[names[0]]["comms"]:
        rows.append(
            [
                kind + (" (count)" if kind == "all-gather dp" else ""),
                *(
                    f"{s[n]['comms'][kind][0]:,} B ({s[n]['comms'][kind][1]})"
                    if s[n]["comms"][kind][0]
                    else "0"
                    for n in names
                ),
            ]
        )
    return "\n\n".join([_sources(data), _table(["", *names], rows, "---" + "|---" * 2)])


def _phases(data: dict[str, Any], digits: int, first: str = "phase") -> str:
    out = [_sources(data)]
    for run in data["runs"]:
        f = run["figures"]
        if "model" in f:
            out.append(f"**{f['model']}** (`{run['command']}`):")
        rows = [[k, *(_num(v, digits) for v in vals)] for k, vals in f["rows"].items()]
        out.append(_table([first, *f["columns"]], rows, "---" + "|--:" * len(f["columns"])))
        for other in f.get("other_runs", []):
            for k, vals in other.items():
                out.append(f"Another run, {k}: " + ", ".join(_num(v, digits) for v in vals) + ".")
    return "\n\n".join(out)


def lifecycle_memory(data: dict[str, Any]) -> str:
    return _image("lifecycle_memory", "peak memory per phase, MiB") + "\n\n" + _phases(data, 0)


def plot_phases(data: dict[str, Any], plt: Any, run: int = 0, skip: tuple[str, ...] = ()) -> Any:
    f = data["runs"][run]["figures"]
    phases = [k for k in f["rows"] if k not in skip]
    columns = f["columns"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(columns)
    for i, c in enumerate(columns):
        values = [f["rows"][p][i] for p in phases]
        xs = [j + i * width for j, v in enumerate(values) if isinstance(v, (int, float)) and v]
        ys = [v for v in values if isinstance(v, (int, float)) and v]
        ax.bar(xs, ys, width, label=c.strip("`"))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))])
    ax.set_xticklabels([p.split(" (")[0] for p in phases], rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def qlora_memory(data: dict[str, Any]) -> str:
    return _image("qlora_memory", "QLoRA memory per phase, MiB") + "\n\n" + _phases(data, 1)


def checkpoint_cost(data: dict[str, Any]) -> str:
    return _phases(data, 1, "per rank, per step")


def _cp_runs(data: dict[str, Any]) -> tuple[list[int], list[str], list[dict[str, Any]]]:
    runs = sorted(data["runs"], key=lambda r: int(r["key"].split("=")[1]))
    lengths = [int(r["key"].split("=")[1]) for r in runs]
    return lengths, list(runs[0]["figures"]), [r["figures"] for r in runs]


def cp_scaling(data: dict[str, Any]) -> str:
    lengths, cps, figs = _cp_runs(data)
    rows = []
    for n, f in zip(lengths, figs):
        base = f[cps[0]]
        rows.append(
            [
                f"{n:,}",
                *(
                    f"{f[c]['tensor_mib']:,.1f} ({f[c]['tensor_mib'] / base['tensor_mib']:.2f})"
                    for c in cps
                ),
                *(f"{f[c]['step_s']:.3f} ({f[c]['step_s'] / base['step_s']:.2f})" for c in cps),
            ]
        )
    header = ["tokens", *(f"MiB, {c}" for c in cps), *(f"step s, {c}" for c in cps)]
    table = _table(header, rows, "--:" + "|--:" * (2 * len(cps)))
    image = _image("cp_scaling", "tensor memory and step time per rank against sequence length")
    return "\n\n".join([image, _sources(data), table])


def plot_cp_scaling(data: dict[str, Any], plt: Any) -> Any:
    lengths, cps, figs = _cp_runs(data)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for c in cps:
        a.plot(lengths, [f[c]["tensor_mib"] for f in figs], marker="o", label=c)
        b.plot(lengths, [f[c]["step_s"] for f in figs], marker="o", label=c)
    for ax, label in ((a, "tensor memory a step adds, MiB per rank"), (b, "step time, s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths)
        ax.set_xticklabels([f"{n:,}" for n in lengths])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    return fig


def quantized_gather(data: dict[str, Any]) -> str:
    """One table per run: the weights' runs (all-gather bytes) and the gradients' (the
    reduction's bytes: reduce-scatter, or qgZ's all-to-all)."""
    tables = []
    for run in sorted(data["runs"], key=lambda r: "runs=" in r["key"]):
        f = run["figures"]
        grads = any("gradients" in name for name in f)
        column = "reduce_bytes" if grads else "all_gather_bytes"
        rows = [
            [
                name,
                f"{v['final_loss']:.4f} ({v['final_loss_ratio']:.4f})",
                f"{v[column]:,} ({v[column] / f['exact'][column]:.3f})",
                f"{v['step_s']:.3f}",
            ]
            for name, v in f.items()
        ]
        header = [
            "gradients" if grads else "all-gather",
            "loss, last 50 steps (/ exact)",
            "reduction bytes (/ exact)" if grads else "all-gather bytes (/ exact)",
            "step s",
        ]
        tables.append(f"`{run['command']}`:\n\n" + _table(header, rows, ":--|--:|--:|--:"))
    image = _image("quantized_gather", "loss curves with exact and quantized collectives")
    return "\n\n".join([image, _sources(data), *tables])


def _loss_curves(curves: dict[str, tuple[list[int], list[float]]], plt: Any) -> Any:
    """Training loss against step, one line per run."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    return fig


def plot_quantized_gather(data: dict[str, Any], plt: Any) -> Any:
    curves = {}
    for run in sorted(data["runs"], key=lambda r: "runs=" in r["key"]):
        for name, v in run["figures"].items():
            if name not in curves:  # "exact" once, from the first run
                steps = [10 * i for i in range(len(v["losses_every_10"]))]
                curves[name] = (steps, v["losses_every_10"])
    return _loss_curves(curves, plt)


def _quantized_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs by ranks, then width."""
    return sorted(data["runs"], key=lambda r: (r["figures"]["ranks"], r["figures"]["n_embd"]))


def quantized_step(data: dict[str, Any]) -> str:
    kinds = ["all_gather", "reduce_scatter", "all_to_all", "all_reduce"]
    rows, shares = [], []
    for run in _quantized_runs(data):
        f = run["figures"]
        size = f"{f['n_embd']} ({f['param_mib']} MiB)"
        for name, v in f["systems"].items():
            rows.append(
                [
                    str(f["ranks"]),
                    size,
                    name,
                    f"{v['median_ms']:.1f}",
                    f"{v['time_ratio_exact']:.3f}",
                    f"{v['time_ratio_fsdp2']:.3f}",
                    *(f"{v['bytes'][k]:,}" for k in kinds),
                    f"{v['bytes_ratio_exact']:.3f}",
                ]
            )
        s = f["systems"]
        shares.append(
            [
                str(f["ranks"]),
                size,
                f"{s['exact']['median_ms']:.1f}",
                f"{s['exact, no collectives']['median_ms']:.1f}",
                f"{f['collective_share']:.1%}",
            ]
        )
    header = ["ranks", "n_embd (fp32 Ψ)", "system", "step ms", "/ exact", "/ FSDP2"]
    header += [f"{k.replace('_', '-')} B" for k in kinds] + ["bytes / exact"]
    table = _table(header, rows, ":--|:--|:--" + "|--:" * 8)
    header = ["ranks", "n_embd (fp32 Ψ)", "exact ms", "without collectives ms"]
    share = _table([*header, "collectives' share"], shares, ":--|:--|--:|--:|--:")
    image = _image("quantized_step", "step time and bytes of exact, quantized FSDP and FSDP2")
    return "\n\n".join([image, _sources(data), table, share])


def plot_quantized_step(data: dict[str, Any], plt: Any) -> Any:
    runs = _quantized_runs(data)
    names = list(dict.fromkeys(n for r in runs for n in r["figures"]["systems"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        present = [
            (j, r["figures"]["systems"][name])
            for j, r in enumerate(runs)
            if name in r["figures"]["systems"]  # --compiled runs have two systems more
        ]
        xs = [j + (i - (len(names) - 1) / 2) * width for j, _ in present]
        style = dict(label=name, color=COLOURS[name])
        a.bar(xs, [v["median_ms"] for _, v in present], width, **style)
        b.bar(xs, [v["bytes_ratio_exact"] for _, v in present], width, **style)
    labels = [f"{r['figures']['ranks']} ranks\nn_embd {r['figures']['n_embd']}" for r in runs]
    for ax in (a, b):
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(labels, fontsize=7)
    a.set_yscale("log")
    a.set_ylabel("step time, ms (median)")
    b.set_ylabel("bytes a rank sends per step / exact")
    b.set_ylim(0, 1.45)  # room for the legend above the bars
    b.legend(fontsize=7, ncol=2, loc="upper center")
    return fig


MUON_NAMES = {
    "adamw": "AdamW",
    "muon": "Muon (owners)",
    "muon_everywhere": "Muon, gathered everywhere",
}


def _muon_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs by date, then by size and batch."""
    return sorted(data["runs"], key=lambda r: (r["date"], len(r["key"]), r["key"]))


def muon_step(data: dict[str, Any]) -> str:
    rows = []
    for run in _muon_runs(data):
        f = run["figures"]
        base, update = f["adamw"]["step_ms"], f["muon"]["update_ms"]
        for name, v in f.items():
            moved = v["update_all_to_all_bytes"] + v["update_all_gather_bytes"]
            rows.append(
                [
                    run["key"],
                    MUON_NAMES[name],
                    f"{v['step_ms']:.0f} ({v['step_ms'] / base:.2f})",
                    f"{v['update_ms']:.1f} ({v['update_ms'] / update:.2f})",
                    f"{moved:,}",
                ]
            )
    header = ["size", "optimizer", "step ms (/ AdamW)", "update ms (/ Muon)", "update bytes"]
    table = _table(header, rows, ":--|:--|--:|--:|--:")
    image = _image("muon_step", "step and update time of AdamW, Muon and the workaround")
    return "\n\n".join([image, _sources(data), table])


def plot_muon_step(data: dict[str, Any], plt: Any) -> Any:
    runs = _muon_runs(data)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    names = list(runs[0]["figures"])
    width = 0.8 / len(names)
    for ax, part, label in zip(axes, ("step_ms", "update_ms"), ("train step", "optimizer update")):
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(runs))]
            ax.bar(xs, [r["figures"][name][part] for r in runs], width, label=MUON_NAMES[name])
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([r["key"].replace(", ", "\n") for r in runs], fontsize=7)
        ax.set_ylabel(f"{label}, ms (median)")
    axes[0].legend(fontsize=7)
    return fig


def muon_loss(data: dict[str, Any]) -> str:
    f = data["runs"][-1]["figures"]
    rows = [
        [
            MUON_NAMES[name],
            f"{v['final_loss']:.4f} ({v['final_loss_ratio']:.4f})",
            f"{v['step_s']:.3f}",
        ]
        for name, v in f.items()
    ]
    table = _table(["optimizer", "loss, last 20 steps (/ AdamW)", "step s"], rows, ":--|--:|--:")
    image = _image("muon_loss", "loss curves of the example GPT with AdamW and with Muon")
    return "\n\n".join([image, _sources(data), table])


def plot_muon_loss(data: dict[str, Any], plt: Any) -> Any:
    run = data["runs"][-1]
    last = int(run["key"].split("=")[1]) - 1  # the last step's loss ends each curve
    curves = {}
    for name, v in run["figures"].items():
        losses = v["losses_every_10"]
        curves[MUON_NAMES[name]] = ([*(10 * i for i in range(len(losses) - 1)), last], losses)
    return _loss_curves(curves, plt)


def ft_overhead(data: dict[str, Any]) -> str:
    runs = sorted(data["runs"], key=lambda r: int(r["key"].split("=")[1]))
    rows = [
        [
            r["key"].split("=")[1],
            _num(r["figures"]["hsdp_step_s"], 3),
            _num(r["figures"]["ft_step_s"], 3),
            _num(r["figures"]["ft_over_hsdp"], 2),
            _num(r["figures"]["death_to_next_commit_s"], 2),
        ]
        for r in runs
    ]
    header = [
        "GPT width",
        "HSDP step, s",
        "2 replica groups (torchft), s",
        "ratio",
        "death to next commit, s",
    ]
    return _table(header, rows) + "\n\n" + _sources(data)


PAGES: dict[str, Callable[[dict[str, Any]], str]] = {
    "step_vs_fsdp2": step_vs_fsdp2,
    "compiled_step": compiled_step,
    "zero_vs_ddp": zero_vs_ddp,
    "step_2d_vs_fsdp2_tp": step_2d_vs_fsdp2_tp,
    "lifecycle_memory": lifecycle_memory,
    "qlora_memory": qlora_memory,
    "checkpoint_cost": checkpoint_cost,
    "cp_scaling": cp_scaling,
    "quantized_gather": quantized_gather,
    "quantized_step": quantized_step,
    "muon_step": muon_step,
    "muon_loss": muon_loss,
    "ft_overhead": ft_overhead,
}
PLOTS: dict[str, Callable[[Any], Any]] = {
    "step_vs_fsdp2": lambda plt: plot_step_vs_fsdp2(load("step_vs_fsdp2"), plt),
    "compiled_step": lambda plt: plot_compiled_step(load("compiled_step"), plt),
    "lifecycle_memory": lambda plt: plot_phases(load("lifecycle_memory"), plt),
    "qlora_memory": lambda plt: plot_phases(load("qlora_memory"), plt, skip=("step seconds",)),
    "cp_scaling": lambda plt: plot_cp_scaling(load("cp_scaling"), plt),
    "quantized_gather": lambda plt: plot_quantized_gather(load("quantized_gather"), plt),
    "quantized_step": lambda plt: plot_quantized_step(load("quantized_step"), plt),
    "muon_step": lambda plt: plot_muon_step(load("muon_step"), plt),
    "muon_loss": lambda plt: plot_muon_loss(load("muon_loss"), plt),
}


def render_page(text: str) -> str:
    """``text`` with every generated block rewritten from the JSON."""

    def block(m: re.Match[str]) -> str:
        name = m.group(1)
        return (
            f"<!-- generated: {name} -->\n{PAGES[name](load(name))}\n<!-- end generated: {name} -->"
        )

    return BLOCK.sub(block, text)


def draw(directory: Path, dpi: int = 110) -> list[Path]:
    """Write every plot as ``directory/NAME.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, plot in PLOTS.items():
        fig = plot(plt)
        fig.tight_layout()
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=dpi, metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    text = PAGE.read_text()
    new = render_page(text)
    if args.check:
        if new != text:
            sys.exit("docs/results.md differs from benchmarks/results/*.json: run plot_results.py")
        return
    PAGE.write_text(new)
    for path in draw(IMAGES):
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
