"""A tensor-parallel plan checked against the unsharded module, once per distinct block.

A wrong plan rarely fails loudly. Attention code that reshapes with its global head count
(``q.view(b, t, self.n_heads, -1)``) splits each rank's block of features into too many,
too small heads and trains on a wrong loss; a rowwise style where a colwise one belongs may
run with shapes that happen to fit. :func:`~functional_fsdp.tensor_parallel` therefore puts a
:class:`BlockCheck` on every *block* of the plan: the smallest module with its own forward
that encloses a whole tensor-parallel region (an attention or MLP module holding colwise
linears and the rowwise linear after them, a vocabulary-parallel embedding, a colwise linear
that gathers its output, an experts module).

The check runs once per distinct block (same class, same styles, same parameter shapes: the
first layer of a 32-layer model stands for all of them), on the first ``FSDP.apply`` that
reaches it, before the block's own forward:

1. It reads the block's input and its tensor-parallel blocks of the parameters (gathered over
   the data axes by the engine), outside any ``torch.func`` transform, and all-gathers the
   parameters over tp: the unsharded block.
2. It runs a copy of the block twice on that input, in float64 and in eval mode (no dropout):
   unsharded, and with the plan's styles on this rank's blocks of the parameters.
3. It compares the outputs; the largest relative difference, taken over every rank, decides.

On a mismatch it tries the likely fixes on the same input: head counts set per rank
(``LocalAttributes(per_rank=...)`` on the module holding them, found through any container),
and single linears given the other one of the colwise and rowwise styles. The error names the block, the
difference and the fix that made the block match; it suggests none that did not.

Cost: one extra forward of each distinct block, twice (sharded and unsharded), its
parameters all-gathered over tp once, and one scalar read on the host per distinct block, at
the first call only. Under ``ff.jit``'s trace (fake tensors) there are no values to compare:
the check waits for an eager call. ``tensor_parallel(..., verify=False)`` turns it off.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import rng
from .._modules import copy_tree
from ..distributed import accounting
from ..distributed import collectives as C
from ..distributed.mesh import axis_names, axis_sizes
from ..distributed.simulate import is_shapes_only, rank_values
from ..spec import P, format_mesh
from .ops import scatter_to
from .styles import (
    ColwiseParallel,
    ExpertParallel,
    Forward,
    LocalAttributes,
    PrepareInput,
    RowwiseParallel,
    Style,
    VocabParallelEmbedding,
    _input,
    _map_input,
)
from .torch_styles import Composed, GatherInput, PrepareInputThen, RedistributeOutput

# (relative path, style, mesh, axis, tp) -> (module, forward) -> forward: plan.StyleWrapper
MakeWrapper = Callable[[str, Style, DeviceMesh, str, int], Callable[[nn.Module, Forward], Forward]]

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # relative; other dtypes: 3e-2


@dataclass(eq=False)
class Checks:
    """What the checks of one plan share.

    Attributes:
        done: the distinct blocks checked (or found to need no check) so far; a block
            whose check failed is not, so every later call raises again.
        running: the blocks being checked now.
        checked: the paths of the blocks compared with their unsharded selves.
        skipped: ``(path, why)`` for blocks that could not be compared (an argument that
            cannot be copied, such as a key-value cache holding ``torch.func``'s tensors).
        seconds: the time the comparisons took, on this rank.
    """

    done: set[Any] = field(default_factory=set)
    running: set[Any] = field(default_factory=set)
    checked: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True, eq=False)
class BlockCheck:
    """``(module, forward) -> forward``: checks the block against its unsharded self once.

    Attributes:
        path: the block's module path.
        block: the user's module at ``path`` (never changed: the check runs on copies).
        plan: ``{path relative to the block: style}`` for the styled modules inside it.
        specs: ``{parameter name relative to the block: P}``, the plan's split over tp.
        shapes: the parameters' global shapes, by the same names.
        input_dim: the sequence dim the block's input arrives split along, or ``None``.
        output_dim: the sequence dim its output leaves split along, or ``None``.
        input_kwarg: the keyword of the block's input, if not its first argument.
        key: the block's identity for "checked once" (class, styles, shapes).
        checks: the state shared by the plan's checks.
        make_wrapper: builds a style's wrapper (``plan.StyleWrapper``).
    """

    path: str
    block: nn.Module
    plan: dict[str, Style]
    specs: dict[str, P]
    shapes: dict[str, tuple[int, ...]]
    input_dim: int | None
    output_dim: int | None
    input_kwarg: str | None
    key: Any
    checks: Checks
    mesh: DeviceMesh
    axis: str
    tp: int
    make_wrapper: MakeWrapper = field(repr=False)

    def __call__(self, module: nn.Module, forward: Forward) -> Forward:
        def checked(*args: Any, **kwargs: Any) -> Any:
            due = self.key not in self.checks.done and self.key not in self.checks.running
            if due and not torch.compiler.is_compiling():
                self.checks.running.add(self.key)  # a call nested in the check skips it
                start = time.perf_counter()
                streams = rng.get_state()  # the styles switch dropout streams: put them back
                try:
                    if not is_shapes_only(self.mesh):
                        with torch.no_grad(), accounting.isolated():
                            self.check(module, args, kwargs)
                    self.checks.done.add(self.key)  # a block that failed is checked again
                finally:
                    rng.set_state(streams)
                    self.checks.running.discard(self.key)
                    self.checks.seconds += time.perf_counter() - start
            return forward(*args, **kwargs)

        return checked

    # ----------------------------------------------------------------- the check

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless the plan's block gives the unsharded block's output."""
        local = {n: _plain(p) for n, p in module.named_parameters(remove_duplicate=False)}
        buffers = {n: _plain(b) for n, b in module.named_buffers(remove_duplicate=False)}
        if any(t.is_meta for t in (*local.values(), *buffers.values())):
            return  # a unit nested in the block is not gathered yet: nothing to compare
        args, kwargs = torch_pytree.tree_map(_plain, (args, kwargs))
        try:
            _fresh((args, kwargs))
        except _CannotCopy as e:  # the runs could change the caller's object: no check
            self.checks.skipped.append((self.path, f"an argument cannot be copied ({e})"))
            return
        if self._input_differs(args, kwargs):  # the plan cannot be judged on it
            self.checks.skipped.append((self.path, "its input differs between tp ranks"))
            return
        full = {n: self._gather(n, t) for n, t in local.items()}
        outcome = None
        for dtype in (torch.float64, None):  # float64 where the module's code allows it
            inputs = _cast((full, buffers, args, kwargs), dtype)
            try:
                reference = self._reference(*inputs)
            except Exception:
                continue
            outcome = self._compare(self.plan, reference, *inputs)
            break
        if outcome is None:
            return  # the block does not run unsharded on its own input: nothing to compare
        error, what, inputs, reference = outcome
        self.checks.checked.append(self.path)
        if error <= self._tolerance(inputs):
            return
        fix = self._find_fix(reference, inputs)
        raise ValueError(self._message(module, error, what, fix, inputs))

    def _input_differs(self, args: Any, kwargs: Any) -> bool:
        """Whether the block's replicated input differs between tp ranks (tensor parallelism
        assumes it does not; random batches drawn on a simulated mesh do)."""
        if self.input_dim is not None:
            return False  # split along the sequence: each rank's own part
        try:
            x = _input(self.plan.get("", _NoStyle()), self.block, self.input_kwarg, args, kwargs)
        except TypeError:
            return False
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return False
        rows = C.all_gather(x.detach().unsqueeze(0), self.mesh, self.axis, 0)
        differs = (rows != rows[:1]).any().to(torch.float64)
        return self._agreed(differs, x.device) > 0

    def _tolerance(self, inputs: tuple[Any, ...]) -> float:
        dtypes = [t.dtype for t in inputs[0].values() if t.is_floating_point()]
        dtype = dtypes[0] if dtypes else torch.float32
        return TOLERANCE.get(dtype, 3e-2)

    def _gather(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter from this rank's block of it."""
        spec = self.specs[name].padded(t.ndim)
        for dim in range(t.ndim):
            if self.axis in spec.entry(dim):
                t = C.all_gather(t, self.mesh, self.axis, dim).narrow(
                    dim, 0, self.shapes[name][dim]
                )
        return t

    def _split(self, name: str, t: torch.Tensor, spec: P) -> torch.Tensor:
        """This rank's block of the unsharded parameter ``t`` under ``spec`` (padded at the end)."""
        spec = spec.padded(t.ndim)
        for dim in range(t.ndim):
            if self.axis in spec.entry(dim):
                n = t.shape[dim]
                pad = -n % self.tp
                if pad:
                    shape = list(t.shape)
                    shape[dim] = pad
                    t = torch.cat([t, t.new_zeros(shape)], dim)
                t = scatter_to(t, self.mesh, self.axis, dim)
        return t

    def _copies(
        self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]
    ) -> dict[str, nn.Module]:
        copies = copy_tree(self.block.named_modules(remove_duplicate=False))
        for tensors, slot in ((params, "_parameters"), (buffers, "_buffers")):
            for name, t in tensors.items():
                path, _, attr = name.rpartition(".")
                getattr(copies[path], slot)[attr] = t
        for c in copies.values():
            c.__dict__["training"] = False  # no dropout: both runs see the same values
            for hooks in _HOOKS:  # the user's hooks observe the real calls, not the check's
                if hooks in c.__dict__:
                    c.__dict__[hooks] = type(c.__dict__[hooks])()
        return copies

    def _reference(
        self,
        full: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        args: Any,
        kwargs: Any,
    ) -> Any:
        args, kwargs = _fresh((args, kwargs))
        if self.input_dim is not None:  # the whole sequence, as the unsharded block reads it
            dim = self.input_dim
            args, kwargs = _map_input(
                self.plan.get("", _NoStyle()),
                self.block,
                self.input_kwarg,
                args,
                kwargs,
                lambda x: C.all_gather(x, self.mesh, self.axis, dim),
            )
        return self._copies(full, buffers)[""](*args, **kwargs)

    def _run_plan(
        self,
        plan: Mapping[str, Style],
        full: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        args: Any,
        kwargs: Any,
    ) -> Any:
        specs = _plan_specs(self.block, plan, self.axis)
        local = {n: self._split(n, t, specs.get(n, P())) for n, t in full.items()}
        copies = self._copies(local, buffers)
        for rel, style in plan.items():
            m = copies[rel]
            own = m.__dict__.get("forward") or types.MethodType(type(m).forward, m)
            wrapper = self.make_wrapper(rel, style, self.mesh, self.axis, self.tp)
            m.__dict__["forward"] = wrapper(m, own)
        args, kwargs = _fresh((args, kwargs))
        return copies[""](*args, **kwargs)

    def _compare(
        self,
        plan: Mapping[str, Style],
        reference: Any,
        full: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        args: Any,
        kwargs: Any,
    ) -> tuple[float, str, tuple[Any, ...], Any]:
        """(largest relative difference over every rank, what differs, inputs, reference)."""
        inputs = (full, buffers, args, kwargs)
        try:
            out = self._run_plan(plan, *inputs)
            error, what = self._difference(out, reference)
        except Exception as e:
            if plan is self.plan and _raised_by_a_style(e):
                raise  # the library's own error about the plan, as a call without the check
            line = str(e).splitlines()[0].rstrip(".") if str(e) else ""
            error, what = math.inf, f"it raises {type(e).__name__}: {line}"
        device = next((t.device for t in full.values()), torch.device(self.mesh.device_type))
        return self._agreed(error, device), what, inputs, reference

    def _difference(self, out: Any, reference: Any) -> tuple[float | torch.Tensor, str]:
        got, want = torch_pytree.tree_leaves(out), torch_pytree.tree_leaves(reference)
        if len(got) != len(want):
            return math.inf, f"it returns {len(got)} values, the unsharded module {len(want)}"
        worst: torch.Tensor | None = None
        for i, (a, b) in enumerate(zip(got, want)):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                continue
            if not (a.is_floating_point() and b.is_floating_point()):
                continue
            d = self.output_dim
            if (
                d is not None
                and b.ndim > d
                and a.ndim == b.ndim
                and b.shape[d] == a.shape[d] * self.tp
            ):
                b = scatter_to(b, self.mesh, self.axis, d)
            if a.shape != b.shape:
                if i == 0:
                    return math.inf, (
                        f"its output has shape {tuple(a.shape)}, the unsharded module's "
                        f"{tuple(b.shape)}"
                    )
                continue  # a per-rank value (attention weights of the local heads)
            diff = (a.double() - b.double()).abs()
            diff = torch.where(a.isnan() & b.isnan(), 0.0, diff).nan_to_num(nan=math.inf)
            scale = b.double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax()
            e = diff.amax() / scale.clamp_min(1e-30) if diff.numel() else diff.new_zeros(())
            worst = e if worst is None else torch.maximum(worst, e)
        if worst is None:
            return 0.0, "no output to compare"
        return worst, "its output differs"

    def _agreed(self, error: float | torch.Tensor, device: torch.device) -> float:
        """The largest of every rank's ``error`` (every rank then decides alike): one scalar
        gathered over each mesh axis, read on the host."""
        if isinstance(error, torch.Tensor):
            t = error.to(torch.float64).reshape(1)
        else:
            t = torch.full((1,), float(error), dtype=torch.float64, device=device)
        for axis in axis_names(self.mesh):
            t = C.all_gather(t, self.mesh, axis, 0).amax().reshape(1)
        return float(rank_values(t)[0].item())

    # ----------------------------------------------------------------- fixes

    def _find_fix(self, reference: Any, inputs: tuple[Any, ...]) -> str | None:
        """The first candidate plan under which the block matches, described; or ``None``."""
        tolerance = self._tolerance(inputs)
        for plan, fix in self._candidates():
            error, _, _, _ = self._compare(plan, reference, *inputs)
            if error <= tolerance:
                return fix
        return None

    def _candidates(self) -> list[tuple[dict[str, Style], str]]:
        out: list[tuple[dict[str, Style], str]] = []
        # Head counts set per rank, on the module holding them (through any container):
        # each alone, then a module's all together (n_heads and n_kv_heads).
        for rel, m in self.block.named_modules():
            style = self.plan.get(rel)
            done = {n for n, _ in getattr(style, "per_rank", ())}
            heads = [n for n in _head_counts(m, self.tp) if n not in done]
            tries = [(n,) for n in heads] + ([tuple(heads)] if len(heads) > 1 else [])
            for names in tries:
                if isinstance(style, (PrepareInput, LocalAttributes)):
                    new: Style = dataclasses.replace(
                        style, per_rank=(*[n for n, _ in style.per_rank], *names)
                    )
                    kind = type(style).__name__
                    extra = ", ..." if kind == "PrepareInput" else ""
                    text = f"{kind}(per_rank={(*sorted(done), *names)!r}{extra})"
                elif style is None:
                    new = LocalAttributes(per_rank=names)
                    text = f"LocalAttributes(per_rank={names!r})"
                else:
                    continue
                values = ", ".join(f"{n}={getattr(m, n)}" for n in names)
                out.append(
                    (
                        {**self.plan, rel: new},
                        f"give {self._where(rel)!r} ({type(m).__name__}) {text} in the plan: "
                        f"its code reads the global {values}, but each of the {self.tp} ranks "
                        f"holds 1/{self.tp} of the heads (a reshape such as q.view(b, t, "
                        f"self.{names[0]}, -1) then splits the local features into too many "
                        f"heads); or read the local count from the shape "
                        f"(q.view(b, t, -1, head_dim))",
                    )
                )
        # Linears given the other one of the colwise and rowwise styles: each, then all.
        flips: dict[str, Style] = {}
        for rel, style in self.plan.items():
            flipped: Style | None = None
            if isinstance(style, ColwiseParallel) and style.input != "prepared":
                flipped = RowwiseParallel()
            elif isinstance(style, RowwiseParallel):
                flipped = ColwiseParallel()
            if (
                flipped is not None
                and flipped.problem(self.block.get_submodule(rel), self.tp) is None
            ):
                flips[rel] = flipped
        tries = [{r: f} for r, f in flips.items()] + ([flips] if len(flips) > 1 else [])
        for change in tries:
            text = ", ".join(
                f"{self._where(r)!r} {type(f).__name__}() instead of {type(self.plan[r]).__name__}"
                for r, f in change.items()
            )
            out.append(({**self.plan, **change}, f"give {text}"))
        return out

    def _where(self, rel: str) -> str:
        return f"{self.path}.{rel}" if self.path and rel else (self.path or rel)

    def _message(
        self, module: nn.Module, error: float, what: str, fix: str | None, inputs: tuple[Any, ...]
    ) -> str:
        name = f"{self.path!r}" if self.path else "the root module"
        styles = ", ".join(f"{self._where(r)!r}: {type(s).__name__}" for r, s in self.plan.items())
        how = (
            f"its output differs by {error:.2g} (relative; tolerance {self._tolerance(inputs):.0e})"
            if what == "its output differs"
            else what
        )
        advice = (
            f"The fix that makes it match (tried on the same input): {fix}."
            if fix
            else "No single change of its styles or head counts made it match: check which "
            "linears split their output features (ColwiseParallel: q/k/v, gate/up) and which "
            "read split features (RowwiseParallel: o, down), and that code reading a global "
            "size (a head count) gets it per rank (LocalAttributes(per_rank=...))."
        )
        return (
            f"tensor_parallel: the plan gives {type(self.block).__name__} {name} a wrong "
            f"result on {format_mesh(axis_sizes(self.mesh))}: checked once against the "
            f"unsharded module on the first call's input, {how}. Its styles: {styles}. "
            f"{advice} (To skip this check: ff.tensor_parallel(..., verify=False).)"
        )


_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


class _NoStyle(Style):
    def wrap(self, module: nn.Module, mesh: DeviceMesh, axis: str) -> Any:  # pragma: no cover
        return lambda forward: forward


def _head_counts(m: nn.Module, tp: int) -> list[str]:
    """``m``'s integer attributes that look like head counts and that tp divides."""
    return [
        n
        for n, v in vars(m).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and not n.startswith(("_", "d_"))
        and "head" in n
        and not any(w in n for w in ("dim", "size"))
        and v > 1
        and v % tp == 0
    ]


def _plain(x: Any) -> Any:
    """``x`` outside any ``torch.func`` transform, detached."""
    if not isinstance(x, torch.Tensor):
        return x
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x.detach()


def _raised_by_a_style(e: BaseException) -> bool:
    """Whether ``e`` comes from this package's tensor-parallel code (a style refusing a
    call), not from the model's code."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    here = os.path.dirname(os.path.abspath(__file__))
    return (
        last is not None
        and os.path.abspath(last).startswith(here)
        and not isinstance(e, RuntimeError)
    )


class _CannotCopy(Exception):
    """An argument the check cannot copy: running the block on it could change it."""


def _fresh(tree: Any) -> Any:
    """``tree`` with its objects other than tensors copied: a run may update them (a key-value
    cache appends to itself), and the caller's must stay as they were. Raises
    :class:`_CannotCopy` for one that cannot be copied (a cache holding ``torch.func``'s
    tensors)."""

    def fresh(x: Any) -> Any:
        if x is None or isinstance(x, (torch.Tensor, int, float, bool, str, torch.dtype)):
            return x
        try:
            return copy.deepcopy(x)
        except Exception as e:
            raise _CannotCopy(f"{type(x).__name__}: {e}") from e

    return torch_pytree.tree_map(fresh, tree)


def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return torch_pytree.tree_map(cast, tree)


def _plan_specs(block: nn.Module, plan: Mapping[str, Style], axis: str) -> dict[str, P]:
    """``{parameter name relative to the block (every alias): P}`` under ``plan``."""
    by_id: dict[int, P] = {}
    for rel, style in plan.items():
        m = block.get_submodule(rel)
        for local, spec in style.param_specs(m, axis).items():
            owner, _, attr = local.rpartition(".")
            try:
                p = m.get_submodule(owner)._parameters.get(attr)
            except AttributeError:
                p = None
            if p is not None:
                by_id[id(p)] = spec
    return {n: by_id.get(id(p), P()) for n, p in block.named_parameters(remove_duplicate=False)}


# --------------------------------------------------------------------------- finding blocks


def _has_forward(m: nn.Module) -> bool:
    return type(m).forward is not nn.Module.forward


def block_checks(
    module: nn.Module,
    chosen: Mapping[str, tuple[str, Style]],
    tp_specs: Mapping[str, P],
    mesh: DeviceMesh,
    axis: str,
    tp: int,
    make_wrapper: MakeWrapper,
    checks: Checks,
) -> list[tuple[str, BlockCheck]]:
    """A :class:`BlockCheck` for every block of the plan (see the module docstring)."""
    modules = dict(module.named_modules())
    styles = {p: s for p, (_, s) in chosen.items()}
    rowwise = [
        q for q, s in styles.items() if isinstance(s, RowwiseParallel) and s.input == "sharded"
    ]

    def inside(q: str, a: str) -> bool:
        return a == "" or q.startswith(a + ".")

    def owner(path: str) -> str | None:
        """The nearest module above ``path`` with a forward of its own (its code calls it)."""
        up = path
        while up:
            up = up.rpartition(".")[0]
            if _has_forward(modules[up]):
                return up
        return None

    split = [
        p
        for p, s in styles.items()
        if isinstance(s, ColwiseParallel) and s.output == "sharded" and not s.padded and p
    ]  # (padded: vocab-sharded logits, read by the loss)
    # A region closes at the nearest module with a forward above a colwise linear that holds
    # a rowwise linear no region below it has taken (an MLP whose first linear sits in a
    # Sequential of its own closes at the MLP; the head beside the layers closes nowhere).
    found: set[str] = set()
    for path in sorted(split, key=lambda p: -p.count(".")):
        up = owner(path)
        while up is not None:
            if up in found:
                break
            free = [
                q
                for q in rowwise
                if inside(q, up)
                and not any(c != up and inside(c, up) and inside(q, c) for c in found)
            ]
            if free:
                found.add(up)
                break
            up = owner(up) if up else None
    for path, style in styles.items():  # regions of one module
        gathers = isinstance(style, ColwiseParallel) and style.output == "replicated"
        scatters = isinstance(style, RowwiseParallel) and style.input == "replicated"
        if gathers or scatters or isinstance(style, (VocabParallelEmbedding, ExpertParallel)):
            found.add(path)
    outer = sorted(
        b for b in found if not any(o != b and (o == "" or b.startswith(o + ".")) for o in found)
    )
    first_name = {id(p): n for n, p in module.named_parameters()}
    out = []
    for path in outer:
        block = modules[path]
        plan = {
            (q[len(path) + 1 :] if path else q) if q != path else "": s
            for q, s in styles.items()
            if q == path or path == "" or q.startswith(path + ".")
        }
        params = dict(block.named_parameters(remove_duplicate=False))
        specs = {n: tp_specs[first_name[id(p)]] for n, p in params.items()}
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        input_dim, output_dim, input_kwarg = _layouts(plan)
        key = (type(block), tuple(plan.items()), tuple(shapes.items()))
        out.append(
            (
                path,
                BlockCheck(
                    path=path,
                    block=block,
                    plan=plan,
                    specs=specs,
                    shapes=shapes,
                    input_dim=input_dim,
                    output_dim=output_dim,
                    input_kwarg=input_kwarg,
                    key=key,
                    checks=checks,
                    mesh=mesh,
                    axis=axis,
                    tp=tp,
                    make_wrapper=make_wrapper,
                ),
            )
        )
    return out


def _own_styles(style: Style | None) -> list[Style]:
    """The parts of a block's own style, input side first: a :class:`Composed` style's
    styles, and a :class:`PrepareInputThen`'s output style after its input part (torch's
    ``PrepareModuleInputOutput``)."""
    if style is None:
        return []
    if isinstance(style, Composed):
        return [part for s in style.styles for part in _own_styles(s)]
    then = style.output if isinstance(style, PrepareInputThen) else None
    return [style, *_own_styles(then)]


def _layouts(plan: Mapping[str, Style]) -> tuple[int | None, int | None, str | None]:
    """(input sequence dim, output sequence dim, input keyword) of a block under ``plan``."""
    own = _own_styles(plan.get(""))
    input_dim = output_dim = None
    kwarg = next((k for s in own if (k := getattr(s, "input_kwarg", None))), None)
    for style in own:
        if isinstance(style, PrepareInput):
            input_dim = style.sequence_dim
        elif isinstance(style, GatherInput):
            input_dim = style.dim
    for style in plan.values():
        if isinstance(style, ColwiseParallel) and style.input == "sequence":
            input_dim = style.sequence_dim
        if (
            isinstance(style, (RowwiseParallel, VocabParallelEmbedding))
            and style.output == "sequence"
        ):
            output_dim = style.sequence_dim
    for style in own:  # the block's own output style has the last word
        if isinstance(style, RedistributeOutput):
            output_dim = style.dim if style.op == "scatter" else None
    return input_dim, output_dim, kwarg
