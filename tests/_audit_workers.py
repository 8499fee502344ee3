"""A CPU-only audit for CUDA device and host-synchronisation bugs.

On a GPU two bugs are common and invisible on a CPU-only test machine:

* a tensor created on the host (``torch.arange(n)``, ``torch.full(...)``, ``torch.tensor([..])``
  without ``device=``) meets a parameter's tensor in one op: on CUDA that is a device-mismatch
  error (``index_select``, ``index``, ``cat``...) or a hidden host-to-device copy;
* the host waits for the device inside the step: ``.item()``, ``.tolist()``, ``.cpu()``,
  ``bool(t)``, or an op whose output size depends on data (``nonzero``, boolean masks).

On a CPU every tensor is on the same device, so :class:`DeviceAudit` tells them apart by where
each tensor came from, not by its ``device``:

1. **Host tensors.** While the audit is active, torch's factory functions (``torch.arange``,
   ``zeros``, ``full``, ``tensor``... — the list torch's own ``set_default_device`` uses) are
   wrapped: a call *without* an explicit ``device=`` creates a *host* tensor and records the
   call site. A call *with* ``device=`` creates a device tensor (on CUDA it would be made on
   the device), except ``torch.tensor``/``as_tensor`` of Python data, which is a host-to-device
   copy on every call and is reported. The wrapping is at the Python level because torch
   function modes are switched off inside ``autograd.Function.forward`` under ``torch.func``,
   while Python name look-ups are not. Tensors passed in ``host=`` (e.g. ``mesh.mesh``,
   which torch keeps on the CPU by design) are host tensors too.
2. **Propagation.** A ``TorchDispatchMode`` sees every aten op, inside ``torch.func.grad``,
   custom ``autograd.Function`` forwards and backwards alike. An op whose tensor inputs are
   all host tensors makes host tensors (host-side arithmetic on indices stays legal); every
   other tensor (parameters, batches, optimizer state, collective outputs) is a device tensor.
3. **Findings.** An op that takes a host tensor and a device tensor is a ``"device-mix"``
   finding; ``_local_scalar_dense`` (``.item()``, ``bool``, ``int``), ``nonzero``,
   ``masked_select``, ``unique``, ``equal`` on a device tensor, and ``Tensor.tolist``,
   ``.cpu()``, ``.numpy()`` of one, are ``"host-sync"`` findings; ``torch.tensor(data,
   device=...)`` is an ``"h2d-copy"`` finding. Each finding names the op, the first frame in
   ``functional_fsdp`` (or else in the caller's code) that ran it, and where the host tensor
   was created.

With ``transfers=True`` (for checkpoint loading, which reads files on the host and copies
them to the device by nature), host syncs, ``copy_``/``_to_copy`` between host and device
tensors and ``torch.tensor(data, device=...)`` are allowed: only computing ops that mix
host and device tensors (the ones that fail on CUDA) are reported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

import functional_fsdp

from ._hf import tiny_llama_config

_LIBRARY = os.path.dirname(functional_fsdp.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)

_DATA_FACTORIES = ("tensor", "as_tensor", "asarray")
_OWN_FRAMES = {"_site", "_report", "wrapper", "__torch_dispatch__"}
_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten._unique.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.unique_consecutive.default,
}
_TRANSFER_OPS = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
_SYNC_METHODS = ("tolist", "cpu", "numpy")  # .item() reaches the dispatch mode


@dataclass(frozen=True)
class Finding:
    """One problem the audit saw: what kind, which op, where it ran and where its host input came from."""

    kind: str  # "device-mix", "host-sync" or "h2d-copy"
    op: str
    where: str  # "path:line in function": the innermost frame outside torch
    host_from: str = ""  # where the host tensor was created, for "device-mix"

    @property
    def in_library(self) -> bool:
        """Whether functional_fsdp's own code asked for the op (not torch's, not a model's)."""
        return self.where.startswith("functional_fsdp" + os.sep)

    def __str__(self) -> str:
        origin = f" (host tensor from {self.host_from})" if self.host_from else ""
        return f"{self.kind}: {self.op} at {self.where}{origin}"


def _site(skip: int = 2) -> str:
    """The innermost frame outside torch and this audit: the code that asked for the op."""
    frame = sys._getframe(skip)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        own = path == _HERE and frame.f_code.co_name in _OWN_FRAMES
        if not path.startswith(_TORCH) and not own:
            return _format_frame(frame, path)
        frame = frame.f_back
    return "<unknown>"


def _format_frame(frame: Any, path: str) -> str:
    root = os.path.dirname(_LIBRARY.rstrip(os.sep))
    if path.startswith(root + os.sep):
        rel = os.path.relpath(path, root)
    else:  # an installed package: from its top-level folder on
        rel = path.split("site-packages" + os.sep)[-1]
    return f"{rel}:{frame.f_lineno} in {frame.f_code.co_name}"


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func's wrappers (what the dispatch mode sees)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


class DeviceAudit(TorchDispatchMode):
    """Record device-mix and host-sync findings while active (see the module docstring).

    Example:
        >>> x = torch.ones(4)  # a "device" tensor: it existed before the audit
        >>> with DeviceAudit() as audit:
        ...     _ = x.index_select(0, torch.arange(2))
        >>> [f.kind for f in audit.findings]
        ['device-mix']
    """

    def __init__(self, *, host: Iterable[torch.Tensor] = (), transfers: bool = False) -> None:
        super().__init__()
        self.findings: list[Finding] = []
        self.transfers = transfers
        self._host = WeakTensorKeyDictionary()
        for t in host:
            self._host[_unwrap(t)] = "outside the audited code"
        self._patches: contextlib.ExitStack | None = None

    # ------------------------------------------------------------------ tags

    def host_origin(self, t: torch.Tensor) -> str | None:
        """Where ``t`` was created if it is a host tensor, else ``None``."""
        return self._host.get(_unwrap(t))

    def _tag(self, out: Any, origin: str) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._host[_unwrap(t)] = origin

    def _report(self, kind: str, op: str, host_from: str = "") -> None:
        finding = Finding(kind, op, _site(3), host_from)
        if finding not in self.findings:
            self.findings.append(finding)

    # ------------------------------------------------------------------ factories, methods

    def _factory(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            from_data = name in _DATA_FACTORIES and not (args and isinstance(args[0], torch.Tensor))
            if kwargs.get("device") is not None:
                if from_data and not self.transfers:
                    self._report("h2d-copy", f"torch.{name}(data, device=...)")
            elif name in _DATA_FACTORIES and not from_data:
                pass  # as_tensor(tensor) keeps the tensor's own tag
            else:
                self._tag(out, _site(2))
            return out

        return wrapper

    def _method(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.host_origin(t) is None and not self.transfers:
                self._report("host-sync", f"Tensor.{name}()")
            return fn(t, *args, **kwargs)

        return wrapper

    def __enter__(self) -> DeviceAudit:
        self._patches = contextlib.ExitStack()
        for fn in _device_constructors():
            name = getattr(fn, "__name__", "")
            if getattr(torch, name, None) is fn:
                self._patches.enter_context(_patched(torch, name, self._factory(name, fn)))
        for name in _SYNC_METHODS:
            fn = getattr(torch.Tensor, name)
            self._patches.enter_context(_patched(torch.Tensor, name, self._method(name, fn)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        assert self._patches is not None
        self._patches.close()

    # ------------------------------------------------------------------ every aten op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        origins = [self._host.get(t) for t in tensors]
        host = [o for o in origins if o is not None]
        device = len(origins) - len(host)
        if host and device and not (self.transfers and func in _TRANSFER_OPS):
            self._report("device-mix", str(func.overloadpacket.__name__), host[0])
        if func in _SYNC_OPS and device and not self.transfers:
            self._report("host-sync", f"aten.{func.overloadpacket.__name__}")
        out = func(*args, **kwargs)
        if host and not device:
            self._tag(out, host[0])
        return out


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


# --------------------------------------------------------------------------- audited cases
#
# Each case runs on every rank of a real gloo process group: it builds its state outside the
# audit, then audits one full step (and the optimizer-state setup where the strategy reshards
# it), and returns the findings with the audited loss and a single-process reference loss.

STEP_CASES = ("fsdp", "fsdp_global_batch", "zero1", "hsdp", "tp", "transformers")
WORLD = {"fsdp": 2, "fsdp_global_batch": 2, "zero1": 2, "hsdp": 4, "tp": 4, "transformers": 2}


def _meshes_host(mesh: Any) -> list[torch.Tensor]:
    """The mesh's rank grid: a CPU tensor by design in torch, also on CUDA meshes.

    ``DeviceMesh.mesh`` is computed from ``_rank_map`` on every access.
    """
    return [mesh.mesh, *([mesh._rank_map] if hasattr(mesh, "_rank_map") else [])]


@contextlib.contextmanager
def _audited(mesh: Any) -> Iterator[DeviceAudit]:
    """The audit, plus torch's own sync check (errors on a host sync) when on CUDA."""
    cuda = mesh.device_type == "cuda"
    with DeviceAudit(host=_meshes_host(mesh)) as audit:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield audit
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def _host_sync_allowed(mesh: Any) -> Iterator[None]:
    """Inside :func:`_audited`: torch's sync check off (on CUDA) for an expected host read."""
    cuda = mesh.device_type == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")


def _result(audit: DeviceAudit, metrics: Any, ref_loss: float, mesh: Any) -> dict[str, Any]:
    return {
        "findings": [str(x) for x in audit.findings if x.in_library],
        "model_findings": [str(x) for x in audit.findings if not x.in_library],
        "loss": float(metrics["loss"]),
        "ref_loss": ref_loss,
        "device": mesh.device_type,
    }


def _gpt_case(name: str, device: str) -> dict[str, Any]:
    import functional_fsdp as ff
    from functional_fsdp.models import GPT, gpt_plan, lm_loss
    from functional_fsdp.tp.ops import vocab_parallel_cross_entropy
    from functional_fsdp.tp.plan import tensor_parallel
    from functional_fsdp.train import local_batch

    from ._tp_workers import CFG, gpt_batch

    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch()
    ref_loss = lm_loss(model(idx), tgt).item()
    dev = ff.init_distributed(device_type=device)
    model, idx, tgt = model.to(dev), idx.to(dev), tgt.to(dev)
    axes = {"hsdp": {"replicate": 2, "shard": 2}, "tp": {"dp": 2, "tp": 2}}.get(name, {"dp": 2})
    mesh = ff.make_mesh(axes, device_type=dev.type)
    opt = ff.chain(ff.clip_by_global_norm(1.0, eps=1e-6), ff.adamw(1e-2, weight_decay=0.1))
    opt_specs = ff.P("dp") if name == "zero1" else None
    if name == "tp":
        tp = tensor_parallel(model, mesh, gpt_plan(CFG))
        f = ff.fsdp(model, mesh, specs=tp.specs, wrappers=tp.wrappers)

        def loss_fn(p: Any, b: Any) -> torch.Tensor:
            return vocab_parallel_cross_entropy(f.apply(p, b[0]), b[1], mesh)
    else:
        f = ff.fsdp(model, mesh, specs=ff.P() if name == "zero1" else None)

        def loss_fn(p: Any, b: Any) -> torch.Tensor:
            return lm_loss(f.apply(p, b[0]), b[1])

    batch_mode = "global" if name == "fsdp_global_batch" else "local"
    batch = (idx, tgt) if batch_mode == "global" else local_batch((idx, tgt), mesh, f.data_axes)
    step = ff.train_step(loss_fn, opt, model=f, batch=batch_mode, opt_specs=opt_specs)
    params = f.shard()
    with _audited(mesh) as audit:
        state = ff.TrainState.create(params, opt, opt_specs=opt_specs)
        if batch_mode == "global":
            # By design, a step's first call compares the ranks' global batches: one small
            # all-gather whose verdict the host reads. Nothing else may touch the host.
            with _host_sync_allowed(mesh):
                state, metrics = step(state, batch)
            first = audit.findings
            audit.findings = [x for x in first if not _checks_the_global_batch(str(x))]
            assert len(audit.findings) == len(first) - 2, [str(x) for x in first]
        elif name == "tp":
            # By design, a plan's first call checks each distinct block against the unsharded
            # block (tp/verify.py): one verdict per block read on the host. Nothing else may.
            with _host_sync_allowed(mesh):
                state, metrics = step(state, batch)
            first = audit.findings
            audit.findings = [x for x in first if not str(x).endswith(" in _agreed")]
            assert len(audit.findings) < len(first), [str(x) for x in first]  # it checked
        else:
            state, metrics = step(state, batch)
        state, _ = step(state, batch)
    return _result(audit, metrics, ref_loss, mesh)


def _checks_the_global_batch(finding: str) -> bool:
    return finding.endswith((" in differences", " in rows_agree"))  # agreement.py's check


def _transformers_case(device: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import functional_fsdp as ff
    from functional_fsdp.train import local_batch

    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=64)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    ref_loss = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    dev = ff.init_distributed(device_type=device)
    model, ids = model.to(dev), ids.to(dev)
    mesh = ff.make_mesh({"dp": 2}, device_type=dev.type)
    f = ff.fsdp(model, mesh)
    opt = ff.adamw(1e-2, weight_decay=0.01)

    def loss_fn(p: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return f.apply(p, **b, labels=b["input_ids"], use_cache=False).loss

    step = ff.train_step(loss_fn, opt, model=f, batch="local")
    # An explicit attention mask, as in training. transformers still reads the mask on the
    # host to choose an attention kernel (a sync in the model's code, not the library's).
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch = local_batch(full, mesh, f.data_axes)
    params = f.shard()
    with _audited(mesh) as audit:
        state = ff.TrainState.create(params, opt)
        state, metrics = step(state, batch)
    return _result(audit, metrics, ref_loss, mesh)


def audit_step(name: str, device: str = "cpu") -> dict[str, Any]:
    """Audit one strategy's ``TrainState.create`` and its train steps (see ``STEP_CASES``).

    Returns the library's findings, the model's own (``model_findings``), the audited loss
    and the single-process reference loss on the same global batch.
    """
    if name == "transformers":
        return _transformers_case(device)
    return _gpt_case(name, device)


def audit_checkpoint_load(path: str) -> dict[str, Any]:
    """Save on a 2x2 mesh, then audit ``checkpoint.load`` into other (uneven, multi-axis) layouts."""
    import functional_fsdp as ff

    mesh = ff.make_mesh({"a": 2, "b": 2})
    torch.manual_seed(0)
    full = {"w": torch.randn(7, 5), "v": torch.randn(6, 3), "s": torch.randn(5)}
    saved = ff.shard(full, mesh, {"w": ff.P("a", "b"), "v": ff.P(), "s": ff.P("b")})
    ff.checkpoint.save(path, saved)
    like = ff.shard(
        {k: torch.zeros_like(v) for k, v in full.items()},
        mesh,
        {"w": ff.P(("b", "a")), "v": ff.P(("a", "b"), None), "s": ff.P(("a", "b"))},
    )
    with DeviceAudit(host=_meshes_host(mesh), transfers=True) as audit:
        loaded = ff.checkpoint.load(path, like)
    back = ff.gather(loaded)
    return {
        "findings": [str(x) for x in audit.findings],
        "err": max((back[k] - full[k]).abs().max().item() for k in full),
        "specs": {k: str(v.spec) for k, v in loaded.items()},
    }
