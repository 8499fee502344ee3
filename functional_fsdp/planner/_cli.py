"""The planner on the command line: size a job before it starts, from shapes alone.

    python -m functional_fsdp.planner llama3-70b --mesh dp=1024 --param-dtype bf16 --checkpoint
    ff-plan path/to/config.json --mesh dp=128,tp=8 --gib 80
    ff-plan llama3-8b --mesh replicate=2,shard=8 --strategies zero3,hsdp --json
    ff-plan llama3-8b --mesh dp=16,cp=4 --seq 131072 --checkpoint

The model is a ``transformers`` config (a ``config.json`` file, or a directory holding one)
or a built-in shape (``--list``); it is built on the ``meta`` device, so nothing is
allocated. The mesh gives the device count, and its ``tp`` or ``shard`` axis the
tensor-parallel or HSDP group size; a ``cp`` axis splits each sequence over that many
devices (context parallelism: the model is built with ``ff.cp.register_attention()``, and
every strategy's mesh gets the axis); every figure comes from :func:`functional_fsdp.compare_strategies`
(so from :func:`functional_fsdp.plan`) with the same arguments, and ``--json`` prints its
reports' ``to_dict()``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ._compare import NAMES, STRATEGIES, Comparison, compare_strategies

# Well-known shapes, as transformers configs: {name: (model_type, description, config)}.
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3-8b": (
        "llama",
        "Llama 3 8B (8.0B parameters)",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
    ),
    "llama3-70b": (
        "llama",
        "Llama 3 70B (70.6B parameters)",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
    ),
    "llama3-405b": (
        "llama",
        "Llama 3.1 405B (405.9B parameters)",
        dict(
            hidden_size=16384,
            intermediate_size=53248,
            num_hidden_layers=126,
            num_attention_heads=128,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
    ),
    "llama2-7b": (
        "llama",
        "Llama 2 7B (6.7B parameters)",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
        ),
    ),
    "llama2-70b": (
        "llama",
        "Llama 2 70B (69.0B parameters)",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
    ),
    "gpt2": ("gpt2", "GPT-2 small (124M parameters)", {}),
    "zero-7.5b": (
        "gpt2",
        "the ZeRO paper's 7.5B model: GPT-2 shape, 36 layers of width 4096 (7.5B parameters)",
        dict(n_embd=4096, n_layer=36, n_head=32, n_positions=1024),
    ),
}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parse_mesh(text: str) -> dict[str, int]:
    """``dp=8,tp=2`` -> ``{"dp": 8, "tp": 2}``."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name or not size.strip().isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: write axis=size pairs separated by commas, e.g. dp=8,tp=2 "
                f"or replicate=4,shard=8 (sizes are positive integers)."
            )
        if name in mesh:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: axis {name!r} appears twice.")
        mesh[name] = int(size)
    unknown = [a for a in mesh if a not in ("dp", "cp", "tp", "replicate", "shard")]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: unknown axis {unknown[0]!r}. The axes are dp (data parallel), "
            f"cp (context parallel: splits each sequence), tp (its size is the "
            f"tensor-parallel group of fsdp+tp) and replicate/shard (HSDP; the size of shard "
            f"is the sharding group of hsdp)."
        )
    if "dp" in mesh and ("replicate" in mesh or "shard" in mesh):
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: use dp (with optional tp) or replicate,shard (HSDP), not both."
        )
    return mesh


def _parse_strategies(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--strategies {text!r}: choose from {', '.join(NAMES)} (comma-separated)."
        )
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m functional_fsdp.planner",
        description=(
            "Memory and communication per device of one training step, for each strategy, "
            "from shapes alone (no GPU, nothing allocated)."
        ),
        epilog=(
            "Figures are those of ff.compare_strategies (ff.plan) with the same arguments. "
            "Example: python -m functional_fsdp.planner llama3-70b --mesh dp=128,tp=8 "
            "--param-dtype bf16 --checkpoint --gib 80"
        ),
    )
    p.add_argument(
        "model",
        nargs="?",
        help="a transformers config.json, a directory holding one, or a built-in shape (--list)",
    )
    p.add_argument("--list", action="store_true", help="list the built-in shapes and exit")
    p.add_argument(
        "--mesh",
        type=_parse_mesh,
        default=None,
        help="the devices as axes, e.g. dp=1024, dp=128,tp=8, dp=256,cp=4 or "
        "replicate=128,shard=8 (default dp=8); tp sets the fsdp+tp group size, shard the hsdp "
        "group size, cp splits each sequence over that many devices in every strategy",
    )
    p.add_argument(
        "--strategies",
        type=_parse_strategies,
        default=None,
        help=f"comma-separated, from {','.join(NAMES)} (default: the "
        f"exact ones the mesh allows: hsdp needs a shard axis, fsdp+tp a tp axis and a "
        f"Llama-like model; zero++ takes shard's size, default 8, as the GPUs per node)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch in sequences (default: one per device; with cp, one per cp group)",
    )
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--no-activations", action="store_true", help="leave activations out (no batch)")
    p.add_argument(
        "--param-dtype",
        choices=sorted(_DTYPES),
        default="fp32",
        help="compute dtype of the gathered parameters (masters stay fp32; default fp32)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="dtype of the gradient reduction (default: fp32)",
    )
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per unit")
    p.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (default 1)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "momentum", "none"),
        default="adamw",
        help="whose state is counted (default adamw)",
    )
    p.add_argument("--gib", type=float, default=None, help="device memory: say which fit")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    return p


def shape_list() -> str:
    """The built-in shapes, one per line."""
    width = max(map(len, SHAPES))
    return "\n".join(f"{name:<{width}}  {desc}" for name, (_, desc, _) in SHAPES.items())


def load_config(model: str) -> tuple[Any, str]:
    """A ``transformers`` config for ``model`` (a built-in name, a config.json or a
    directory), and how to name it."""
    try:
        import transformers
    except ImportError as e:
        raise SystemExit(
            "the planner's command line builds models from transformers configs: pip install "
            "'functional_fsdp[hf]' (or pip install transformers)."
        ) from e
    if model in SHAPES:
        model_type, desc, kwargs = SHAPES[model]
        return transformers.AutoConfig.for_model(model_type, **kwargs), desc
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(
            f"{model!r} is neither a built-in shape nor a config.json (or a directory holding "
            f"one). Built-in shapes:\n{shape_list()}"
        )
    data = json.loads(path.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"{path}: no 'model_type' key; is it a transformers config.json?")
    return transformers.AutoConfig.for_model(model_type, **data), str(path)


def build_model(config: Any, cp: bool = False) -> torch.nn.Module:
    """The causal LM of ``config`` on ``meta``: shapes only; with ``cp``, its attention is
    :func:`functional_fsdp.cp.attention` (context parallelism)."""
    import transformers

    kwargs: dict[str, Any] = {}
    if cp:
        from ..cp import register_attention

        kwargs["attn_implementation"] = register_attention()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)


def _tp_plan(model: torch.nn.Module, config: Any) -> Any:
    """A Megatron plan for Llama-like module names, else ``None``."""
    names = {n for n, _ in model.named_modules()}
    if not {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"} <= names:
        return None
    from ..models.llama import llama_plan

    return llama_plan(config, loss_parallel=False)


def arguments(args: argparse.Namespace, model: torch.nn.Module, config: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`compare_strategies` that ``args`` stand for."""
    from ..fsdp.policy import MixedPrecision

    mesh = args.mesh or {"dp": 8}
    world = math.prod(mesh.values())
    tp, shard, cp = mesh.get("tp"), mesh.get("shard"), mesh.get("cp", 1)
    tp_plan = _tp_plan(model, config) if tp else None
    strategies = args.strategies
    if strategies is None:
        strategies = tuple(
            s
            for s in STRATEGIES
            if (s != "hsdp" or shard) and (s != "fsdp+tp" or tp_plan is not None)
        )
    if "fsdp+tp" in strategies and tp_plan is None:
        raise SystemExit(
            "--strategies fsdp+tp needs a tp axis in --mesh (e.g. dp=128,tp=8) and a Llama-like "
            "model (the built-in TP plan is ff.llama_plan's)."
        )
    if "hsdp" in strategies and not shard:
        raise SystemExit(
            "--strategies hsdp needs --mesh replicate=R,shard=S (S: the sharding group)."
        )
    param = _DTYPES[args.param_dtype]
    reduce = _DTYPES[args.reduce_dtype] if args.reduce_dtype else None
    if param is not torch.float32 and reduce is None:
        reduce = torch.float32
    batch = None
    if not args.no_activations:
        batch = (args.batch if args.batch is not None else world // cp, args.seq)
    kwargs: dict[str, Any] = dict(
        batch=batch,
        strategies=strategies,
        mixed_precision=MixedPrecision(
            param_dtype=None if param is torch.float32 else param, reduce_dtype=reduce
        ),
        checkpoint=args.checkpoint,
        prefetch=args.prefetch,
        optimizer=None if args.optimizer == "none" else args.optimizer,
    )
    if tp_plan is not None:
        kwargs.update(tp_plan=tp_plan, tp=tp)
    if shard:
        kwargs["hsdp_shard"] = shard
    if cp > 1:
        kwargs["cp"] = cp
    return {"world_size": world, **kwargs}


def memory_table(cmp: Comparison, gib: float | None = None) -> Any:
    """Memory per device, by part, one row per strategy."""
    from rich import box
    from rich.table import Table

    from ._render import PARTS, parts, short

    table = Table(
        title="memory per device",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("strategy", no_wrap=True)
    for col in ("params", "grads", "optim", "gathered", "activ", "peak"):
        table.add_column(col, justify="right", no_wrap=True)
    if gib is not None:
        table.add_column(f"in {gib:g}G", no_wrap=True)
    for r in cmp.reports:
        figures = parts(r)
        row = [r.name, *(short(figures[k]) for k in PARTS), short(r.peak_bytes)]
        if gib is not None:
            row.append("fits" if r.fits(gib) else "NO")  # a word, not only a colour
        table.add_row(*row)
    return table


def traffic_table(cmp: Comparison) -> Any:
    """Bytes each rank sends per step, by strategy, collective kind, mesh axis and what
    issued it (``by``: fsdp, tp, cp for context-parallel attention, or the step)."""
    from rich import box
    from rich.table import Table

    from ._render import short

    table = Table(
        title="traffic per step, sent per rank",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("strategy", "mesh", "collective", "axis", "by", "count", "bytes"):
        table.add_column(
            col, no_wrap=True, justify="right" if col in ("count", "bytes") else "left"
        )
    for r in cmp.reports:
        mesh = ",".join(f"{a}={n}" for a, n in r.mesh.items())
        for i, c in enumerate(r.comms):  # one per (kind, axis, source), sorted
            table.add_row(
                r.name if i == 0 else "",
                mesh if i == 0 else "",
                c.kind.replace("_", "-"),
                c.axis,
                c.source,
                str(c.count),
                short(c.bytes),
            )
        table.add_row("", "", "total", "", "", "", short(r.comm_bytes()), end_section=True)
    return table


def run(argv: Sequence[str] | None = None, file: Any = None) -> int:
    """Parse ``argv``, plan, print to ``file`` (default stdout); the exit status."""
    args = parser().parse_args(argv)
    out = file if file is not None else sys.stdout
    if args.list:
        print(shape_list(), file=out)
        return 0
    if args.model is None:
        parser().error("name a model: a config.json, a directory, or a built-in shape (--list)")
    start, start_cpu = time.perf_counter(), time.process_time()
    config, name = load_config(args.model)
    model = build_model(config, cp=(args.mesh or {}).get("cp", 1) > 1)
    kwargs = arguments(args, model, config)
    built, built_cpu = time.perf_counter(), time.process_time()
    world = kwargs.pop("world_size")
    try:
        cmp = compare_strategies(model, world, **kwargs)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    planned, planned_cpu = time.perf_counter(), time.process_time()
    params = sum(p.numel() for p in model.parameters())
    if args.json:
        doc = {
            "model": name,
            "params": params,
            "world_size": world,
            "arguments": {k: _plain(v) for k, v in kwargs.items() if k != "tp_plan"},
            "reports": cmp.to_dict(),
        }
        print(json.dumps(doc, indent=1), file=out)
        return 0
    from rich.console import Console

    from ._render import SOURCE_NOTE, UNIT_NOTE

    console = Console(file=out, highlight=False) if file is not None else Console(highlight=False)
    size = "" if args.model in SHAPES else f", {params / 1e9:.3g}B parameters"
    console.print(f"{name}{size}, on {world} devices")
    console.print(memory_table(cmp, args.gib))
    console.print(traffic_table(cmp))
    console.print(UNIT_NOTE)
    if any(c.source == "cp" for r in cmp.reports for c in r.comms):
        console.print(SOURCE_NOTE)
    console.print(
        f"model built in {built - start:.2f} s, planned in {planned - built:.2f} s "
        f"(CPU: {built_cpu - start_cpu:.2f} s and {planned_cpu - built_cpu:.2f} s)"
    )
    if args.gib is not None:
        console.print(f"fits in {args.gib:g} GiB: {', '.join(cmp.fits(args.gib)) or 'none'}")
    return 0


def _plain(value: Any) -> Any:
    """Arguments as JSON: dtypes and policies as text."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return repr(value)


def main() -> None:
    """The ``ff-plan`` console script."""
    raise SystemExit(run())
