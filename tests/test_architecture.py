"""The import graph of ``functional_fsdp``: no circles, layers look down, one c10d caller.

Every module is parsed with ``ast`` (function-local imports included: a late import is still
a dependency; so are ``importlib.import_module`` calls, whose names must be literal). The
layers, lowest first, are :data:`LAYERS`; a module may import its own layer and the layers
below. ``torch.distributed`` is found however it is reached: ``import torch.distributed``,
``from torch import distributed``, or an attribute of ``torch`` (or of an alias of it).
docs/architecture.md explains them.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "functional_fsdp"

# Lowest first. A module belongs to the first entry that is its name or a package above it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("spec", "_tree", "_partition", "_modules", "_fx")),  # specs, layouts, pytrees, FX
    ("distributed", ("distributed",)),  # meshes, collectives, simulation, c10d
    ("values", ("sharded",)),  # Sharded: a local block and its layout
    ("moves", ("_buckets", "resharding", "dtensor", "rng")),  # shard/gather/reshard, DTensor, keys
    (
        "engines",
        ("formats", "fsdp", "tp", "cp", "optim", "contrib", "ft"),
    ),  # FSDP.apply, TP, context parallelism, optimizers (contrib: optax.contrib's names), formats,
    # fault-tolerant replica groups (torchft)
    (
        "steps",
        (
            "grad_engine",
            "_loss",
            "_lm_losses",
            "_dpo",
            "train",
            "checkpoint",
            "models",
            "compiled",
            "_inductor_passes",
        ),
    ),
    ("planner", ("planner",)),  # prices strategies by running the engines
    ("tools", ("display", "plot", "launcher")),  # pictures, the process launcher
    ("api", ("",)),  # functional_fsdp/__init__.py: re-exports everything
)

# Circles still present, each with its reason. None today; an entry here is deleted once its
# circle is gone (test_cycles fails on a stale entry).
PENDING_CYCLES: tuple[frozenset[str], ...] = ()

# Imports of torch.distributed outside functional_fsdp/distributed/, each with its reason.
# Keys: (module, or a package prefix ending in "."; the imported name or a prefix ending in ".").
TORCH_DISTRIBUTED_ALLOWED: dict[tuple[str, str], str] = {
    ("", "torch.distributed.device_mesh.DeviceMesh"): (
        "the mesh is a value every layer passes and annotates; importing its type calls no c10d"
    ),
    ("dtensor", "torch.distributed.tensor."): (
        "the DTensor bridge: converting to and from torch's DTensor is its job"
    ),
    ("checkpoint.", "torch.distributed.checkpoint."): (
        "DCP is the checkpoint format; its collectives run inside dcp.save/load over the "
        "process group the distributed layer hands it"
    ),
    ("checkpoint.dcp", "torch.distributed.tensor."): "DCP state dicts hold DTensors",
    ("ft.", "torch.distributed."): (
        "torchft's Manager is built from this replica group's c10d rank and world size, and "
        "its own process group (not the distributed layer's) sums over the groups"
    ),
    ("tp.torch_styles", "torch.distributed.tensor."): (
        "reads plans written with torch's TP styles and DTensor placements to translate them"
    ),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class _Imports(ast.NodeVisitor):
    """Every imported name in a module, and every ``torch.distributed.x`` read outside
    annotations (a call through ``torch.distributed`` needs no import of its own)."""

    def __init__(self, package: str, module: str) -> None:
        self.package = package  # the dotted package the module sits in ("" at the top)
        self.module = module  # the module's own dotted name below the package
        self.names: list[tuple[str, list[str]]] = []  # (module imported, names from it)
        self.attributes: set[str] = set()
        self.torch = {"torch"}  # the names torch itself is bound to (import torch as t)
        self.dynamic: list[str] = []  # import_module calls whose name is not a literal

    def _absolute(self, level: int, name: str | None, base: str) -> str:
        parts = ["functional_fsdp", *filter(None, base.split("."))]
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([name] if name else []))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.names.append((alias.name, []))
            if alias.name == "torch" and alias.asname:
                self.torch.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            module = self._absolute(node.level, node.module, self.package)
        else:
            module = node.module or ""
        self.names.append((module, [a.name for a in node.names]))

    def visit_Call(self, node: ast.Call) -> None:
        """``importlib.import_module(name, package)`` (or ``import_module``, ``__import__``)
        imports ``name``: a literal one joins the graph, any other is reported."""
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called in ("import_module", "__import__") and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                text = name.value
                level = len(text) - len(text.lstrip("."))
                if level:  # relative to the package argument: __name__ or __package__
                    anchor = node.args[1] if len(node.args) > 1 else None
                    base = (
                        self.module if getattr(anchor, "id", None) == "__name__" else self.package
                    )
                    text = self._absolute(level, text[level:] or None, base)
                self.names.append((text, []))
            else:
                self.dynamic.append(ast.unparse(node))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in self.torch:
            dotted = ".".join(["torch", *reversed(chain)])
            if dotted == "torch.distributed" or dotted.startswith("torch.distributed."):
                self.attributes.add(dotted)
                return
        self.generic_visit(node)

    def _skip_annotation(self, node: ast.AST, annotations: list[ast.AST | None]) -> None:
        for child in ast.iter_child_nodes(node):
            if child not in annotations:
                self.visit(child)

    def visit_arg(self, node: ast.arg) -> None:
        pass  # only an annotation below

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._skip_annotation(node, [node.annotation])

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        for child in [*node.decorator_list, *node.body]:
            self.visit(child)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]


def import_graph(
    sources: dict[str, str], dynamic: dict[str, list[str]] | None = None
) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``({module: the package's modules it imports}, {module: torch.distributed names})``.

    ``dynamic``, if given, receives ``{module: import_module calls with a computed name}``.

    ``sources`` maps each module's name below the package (``"fsdp.api"``; ``"fsdp"`` for
    ``fsdp/__init__.py``, ``""`` for the package's own) to its source text.
    ``from .fsdp import api`` points at ``fsdp.api``, not at ``fsdp``.
    """
    modules = {f"functional_fsdp.{m}".rstrip("."): m for m in sources}
    graph: dict[str, set[str]] = {}
    torch_distributed: dict[str, set[str]] = {}
    for name, source in sources.items():
        package = name if name in _packages(sources) else name.rpartition(".")[0]
        visitor = _Imports(package, name)
        visitor.visit(ast.parse(source))
        if dynamic is not None and visitor.dynamic:
            dynamic[name] = visitor.dynamic
        found: set[str] = set()
        reads: set[str] = set(visitor.attributes)
        for module, imported in visitor.names:
            for full in [f"{module}.{n}" for n in imported] if imported else [module]:
                if full == "torch.distributed" or full.startswith("torch.distributed."):
                    reads.add(full)
            subs = [f"{module}.{n}" for n in imported if f"{module}.{n}" in modules]
            if subs and len(subs) == len(imported):  # from pkg import submodule
                found.update(modules[s] for s in subs)
            elif module in modules:
                found.add(modules[module])
                found.update(modules[s] for s in subs)
        found.discard(name)
        graph[name] = found
        if reads:
            torch_distributed[name] = reads
    return graph, torch_distributed


def _packages(sources: dict[str, str]) -> set[str]:
    names = set(sources)
    return {m for m in names if m == "" or any(o.startswith(m + ".") for o in names)}


@functools.cache
def _sources() -> dict[str, str]:
    return {_module_name(p, ROOT): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


@functools.cache
def _real() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return import_graph(_sources())


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a module named below the package (``"fsdp.api"``)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                return i
    raise ValueError(f"functional_fsdp.{module} is in no layer; add it to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> Iterator[str]:
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            if layer_of(other) > layer_of(module):
                yield (
                    f"functional_fsdp.{module} ({LAYERS[layer_of(module)][0]}) imports "
                    f"functional_fsdp.{other} ({LAYERS[layer_of(other)][0]}), a layer above it"
                )


def _allowed_by(key: tuple[str, str], module: str, name: str) -> bool:
    where, what = key
    here = module == where or where == "" or (where.endswith(".") and module.startswith(where))
    return here and (name == what.rstrip(".") or (what.endswith(".") and name.startswith(what)))


def c10d_callers(torch_distributed: dict[str, set[str]]) -> Iterator[str]:
    for module, names in sorted(torch_distributed.items()):
        if module == "distributed" or module.startswith("distributed."):
            continue
        for name in sorted(names):
            if not any(_allowed_by(key, module, name) for key in TORCH_DISTRIBUTED_ALLOWED):
                yield f"functional_fsdp.{module} uses {name}"


# --------------------------------------------------------------------------- the package


def test_every_module_is_in_a_layer():
    graph, _ = _real()
    for module in graph:
        layer_of(module)  # raises naming the module


def test_no_import_cycles():
    graph, _ = _real()
    found = set(cycles(graph))
    new = [sorted(c) for c in found - set(PENDING_CYCLES)]
    assert not new, f"import cycles (function-local imports count): {new}"
    gone = [sorted(c) for c in set(PENDING_CYCLES) - found]
    assert not gone, f"these cycles are gone: delete them from PENDING_CYCLES: {gone}"


def test_layers_import_only_layers_below():
    graph, _ = _real()
    pending = {(m, o) for c in PENDING_CYCLES for m in c for o in c}  # go with their circles
    graph = {m: {o for o in imported if (m, o) not in pending} for m, imported in graph.items()}
    problems = list(upward_imports(graph))
    assert not problems, "\n".join(problems)


def test_only_the_distributed_layer_calls_torch_distributed():
    _, torch_distributed = _real()
    problems = list(c10d_callers(torch_distributed))
    assert not problems, "route these through functional_fsdp.distributed:\n" + "\n".join(problems)


def test_every_import_can_be_read():
    """An ``import_module`` whose name is computed would hide an edge from these checks."""
    dynamic: dict[str, list[str]] = {}
    import_graph(_sources(), dynamic)
    assert not dynamic, f"import a literal module name instead: {dynamic}"


def test_the_lazy_checkpoint_import_is_an_edge():
    graph, _ = _real()
    assert "checkpoint" in graph[""]  # ff.checkpoint: importlib.import_module(".checkpoint", ...)


def test_allowances_are_used():
    """An allowance nothing needs any more is deleted (it would hide a new caller)."""
    _, torch_distributed = _real()
    used = {
        key
        for module, names in torch_distributed.items()
        for name in names
        for key in TORCH_DISTRIBUTED_ALLOWED
        if _allowed_by(key, module, name)
    }
    assert set(TORCH_DISTRIBUTED_ALLOWED) == used, set(TORCH_DISTRIBUTED_ALLOWED) - used


# --------------------------------------------------------------------------- the checks can fail


SYNTHETIC = {
    "": "from .fsdp import api\n",
    "spec": "import math\n",
    "sharded": "from .spec import P\n\ndef to_html(x):\n    from .display import to_html\n",
    "display": "from .sharded import Sharded\n",
    "fsdp": "",
    "fsdp.api": "from ..distributed import collectives as C\nimport torch.distributed as dist\n",
    "distributed": "",
    "distributed.collectives": "import torch.distributed as dist\n",
    "checkpoint": "",
    "checkpoint.manager": (
        "import torch\n\ndef rank():\n    return torch.distributed.get_rank()\n\n"
        "def f(mesh: torch.distributed.device_mesh.DeviceMesh) -> None:\n    pass\n"
    ),
}


def test_a_function_local_import_cycle_is_found():
    graph, _ = import_graph(SYNTHETIC)
    assert graph["sharded"] == {"spec", "display"}
    assert cycles(graph) == [frozenset({"sharded", "display"})]


def test_an_upward_import_is_found():
    graph, _ = import_graph(SYNTHETIC)
    assert list(upward_imports(graph)) == [
        "functional_fsdp.sharded (values) imports functional_fsdp.display (tools), a layer above it"
    ]


def test_a_c10d_call_outside_the_distributed_layer_is_found():
    _, torch_distributed = import_graph(SYNTHETIC)
    assert list(c10d_callers(torch_distributed)) == [
        "functional_fsdp.checkpoint.manager uses torch.distributed.get_rank",
        "functional_fsdp.fsdp.api uses torch.distributed",
    ]
    assert "distributed.collectives" in torch_distributed  # found, and allowed


def test_from_package_import_submodule_points_at_the_submodule():
    graph, _ = import_graph(SYNTHETIC)
    assert graph[""] == {"fsdp.api"}
    assert graph["fsdp.api"] == {"distributed.collectives"}


# Ways to reach torch.distributed and to import that a plain reading of import statements
# misses.
HIDDEN = {
    "": "",
    "display": "",
    "distributed": "",
    "optim": "",
    "optim.late": (
        "import importlib\n\ndef late():\n"
        "    return importlib.import_module('..display', __package__)\n"
    ),
    "optim.computed": (
        "import importlib\n\ndef late(name):\n    return importlib.import_module(name)\n"
    ),
    "tp": "",
    "tp.from_torch": "from torch import distributed as dist\n",
    "tp.bare": "import torch\n\ndef group():\n    d = torch.distributed\n    return d\n",
    "tp.alias": "import torch as t\n\ndef rank():\n    return t.distributed.get_rank()\n",
    "tp.by_name": (
        "import importlib\n\ndef c10d():\n    return importlib.import_module('torch.distributed')\n"
    ),
}


def test_hidden_ways_to_torch_distributed_are_found():
    dynamic: dict[str, list[str]] = {}
    graph, torch_distributed = import_graph(HIDDEN, dynamic)
    assert list(c10d_callers(torch_distributed)) == [
        "functional_fsdp.tp.alias uses torch.distributed.get_rank",
        "functional_fsdp.tp.bare uses torch.distributed",
        "functional_fsdp.tp.by_name uses torch.distributed",
        "functional_fsdp.tp.from_torch uses torch.distributed",
    ]
    assert graph["optim.late"] == {"display"}
    assert list(upward_imports(graph)) == [
        "functional_fsdp.optim.late (engines) imports functional_fsdp.display (tools), a layer "
        "above it"
    ]
    assert dynamic == {"optim.computed": ["importlib.import_module(name)"]}


# --------------------------------------------------------------------------- ambient state

# Context variables, each with its reason (docs/architecture.md, "Where the state of one call
# lives"). Per-step state passes as arguments or in the state; a new one needs a reason here.
CONTEXT_VARIABLES: dict[str, str] = {
    "fsdp.step_inputs": (
        "what train_step tells the apply calls inside the user's loss_fn, which it cannot "
        "pass as arguments; read once per apply and handed to the interpreter"
    ),
    "distributed.accounting": (
        "the count_comms blocks a user opens around a call; and the label the collectives "
        "of a block of library code carry (labelled: the planner books context-parallel "
        "attention's traffic by it)"
    ),
    "fsdp.memory": "the track_memory blocks a user opens around a call",
    "cp.attention": (
        "the sequence split of the FSDP.apply call running now, read by the attention inside "
        "the model's forward, which the library does not call with arguments of its own"
    ),
}


def context_variables(sources: dict[str, str]) -> dict[str, int]:
    """``{module: how many ContextVar objects it creates}``."""
    out: dict[str, int] = {}
    for name, source in sources.items():
        calls = [
            node
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call)
            and (
                getattr(node.func, "attr", None) == "ContextVar"
                or getattr(node.func, "id", None) == "ContextVar"
            )
        ]
        if calls:
            out[name] = len(calls)
    return out


def test_context_variables_are_the_listed_ones():
    found = context_variables(_sources())
    assert set(found) == set(CONTEXT_VARIABLES), found
    two = {"distributed.accounting"}  # the count_comms blocks and the collectives' labels
    assert all(n == (2 if m in two else 1) for m, n in found.items()), found


def test_a_new_context_variable_is_found():
    found = context_variables(
        {
            "fsdp.runtime": "import contextvars\n_X = contextvars.ContextVar('x', default=0)\n",
            "train": "from contextvars import ContextVar\n_Y = ContextVar('y')\n",
        }
    )
    assert found == {"fsdp.runtime": 1, "train": 1}
