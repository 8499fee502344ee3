"""Two ways to differentiate one step: ``torch.func`` or plain autograd (private).

:func:`~functional_fsdp.train_step` computes its gradients with ``torch.func.grad_and_value``
by default. Some model code cannot be transformed by ``torch.func`` but trains under plain
autograd, as it does under torch's FSDP or DDP:

* custom ``torch.autograd.Function``\\ s without ``setup_context`` (``transformers``' Bloom);
* ``Tensor.requires_grad_()`` inside the forward: the hooks of Hugging Face's
  ``enable_input_require_grads`` (registered by ``gradient_checkpointing_enable()`` and
  peft's ``prepare_model_for_kbit_training``), peft LoRA on Mixtral's experts;
* Hugging Face's own gradient checkpointing (``torch.utils.checkpoint`` inside its layers);
* ``.data`` assignments inside the forward (bitsandbytes' ``Params4bit`` construction).

For those, :class:`Differentiator` computes the same gradients with ``torch.autograd``: the
trainable local shards are replaced by detached leaf copies that require grad, the loss is
back-propagated through them and their ``.grad`` are the gradients. The gradient rule is the
same, because it lives in :meth:`FSDP.apply <functional_fsdp.FSDP.apply>`'s autograd
functions, which run under both. The step stays pure: the copies are the step's own, the
state's tensors are never marked or written, and ``.grad`` that the backward leaves on other
tensors are put back as they were.

The price of autograd: the step is no longer a ``torch.func`` function. It cannot itself be
transformed (``vmap`` over a step, ``jvp``/``hessian`` of the step, ``grad`` of a step for
meta-learning); the gradients carry no history. Numbers are the same.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.utils._pytree as torch_pytree

from . import rng as random

Engine = Literal["auto", "func", "autograd"]
ENGINES: tuple[str, ...] = ("auto", "func", "autograd")

# What torch.func says when it meets code it cannot transform, and what we call it. Matched
# on the error's text: torch raises a plain RuntimeError for each.
_CANNOT_TRANSFORM: tuple[tuple[str, str], ...] = (
    ("must override the setup_context", "an autograd.Function without setup_context"),
    ("requires_grad_()", "Tensor.requires_grad_() inside the forward"),
    ("saved tensor hooks", "torch.utils.checkpoint (saved-tensor hooks)"),
    ("mutating directly with `.data`", "a .data assignment inside the forward"),
)


class AutogradFallbackWarning(UserWarning):
    """``train_step(engine="auto")`` computes gradients with plain autograd, because
    ``torch.func`` cannot transform the model; pass ``engine="autograd"`` to say so.

    Example:
        >>> import warnings, torch, functional_fsdp as ff
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = model.register_forward_hook(lambda m, args, out: out.requires_grad_())
        >>> loss_fn = lambda p, b: torch.func.functional_call(model, p, (b,)).pow(2).mean()
        >>> step = ff.train_step(loss_fn, ff.sgd(0.1), batch="local")  # engine="auto"
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> state = ff.TrainState.create(params, ff.sgd(0.1))
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     state, metrics = step(state, torch.ones(3, 2))
        >>> [w.category.__name__ for w in seen], state.step
        (['AutogradFallbackWarning'], 1)
    """


def check_engine(engine: Any, where: str = "train_step") -> None:
    """Raise unless ``engine`` is one of :data:`ENGINES`."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(
            f"{where}: engine must be 'auto', 'func' or 'autograd', got {engine!r}. 'func' "
            f"differentiates with torch.func (a step that torch.func can transform); "
            f"'autograd' with plain autograd (for model code torch.func cannot transform: "
            f"custom autograd.Functions without setup_context, requires_grad_() hooks, Hugging "
            f"Face gradient checkpointing); 'auto' (the default) uses torch.func where it can."
        )


def reason_up_front(module: Any) -> str | None:
    """Why ``torch.func`` cannot transform ``module``, if a look at it tells (else ``None``):
    a forward hook that calls ``requires_grad_``, or Hugging Face gradient checkpointing
    enabled on a module in training mode."""
    if not isinstance(module, torch.nn.Module):
        return None
    for path, m in module.named_modules():
        where = f"{type(m).__name__} {path!r}" if path else type(m).__name__
        if getattr(m, "gradient_checkpointing", False) is True and m.training:
            return f"gradient checkpointing is enabled on {where} (torch.utils.checkpoint)"
        for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()):
            if "requires_grad_" in _names_called(hook):
                name = getattr(hook, "__name__", type(hook).__name__)
                return f"{where} has a forward hook {name} that calls requires_grad_()"
    return None


def _names_called(fn: Any) -> tuple[str, ...]:
    while True:  # bound methods and functools.partial: the function underneath
        inner = getattr(fn, "__func__", None) or getattr(fn, "func", None)
        if inner is None or inner is fn:
            break
        fn = inner
    code = getattr(fn, "__code__", None)
    return code.co_names if code is not None else ()


def _cannot_transform(error: BaseException) -> str | None:
    text = str(error)
    if not isinstance(error, RuntimeError):
        return None
    for needle, reason in _CANNOT_TRANSFORM:
        if needle in text:
            return reason
    return None


class Differentiator:
    """The gradient engine of one ``train_step``: ``grad_and_value(fn)(wrt, batch)`` as
    ``torch.func.grad_and_value`` returns it, computed by the chosen engine.

    With ``engine="auto"``: plain autograd if :func:`reason_up_front` finds a reason at the
    first call, else ``torch.func``, falling back to autograd (and keeping it) whenever
    ``torch.func`` raises one of the errors of code it cannot transform (a model changed
    between steps, e.g. checkpointing enabled later, too). The notice is given once.
    """

    def __init__(self, engine: Engine, module: Any = None) -> None:
        check_engine(engine)
        self.engine = engine
        self.module = module
        self.chosen: str | None = None if engine == "auto" else engine

    def _notice(self, reason: str) -> None:
        self.chosen = "autograd"
        warnings.warn(
            f"train_step: torch.func cannot differentiate this model ({reason}), so the step "
            f"computes its gradients with plain autograd: the same numbers, but the step cannot "
            f"be transformed by torch.func. Pass train_step(..., engine='autograd') to silence "
            f"this notice.",
            AutogradFallbackWarning,
            stacklevel=5,  # the caller of step(state, batch)
        )

    def grad_and_value(
        self, fn: Callable[[Any, Any], Any], *, has_aux: bool = False
    ) -> Callable[[Any, Any], tuple[Any, Any]]:
        """``torch.func.grad_and_value(fn, has_aux=has_aux)``: with ``has_aux``, ``fn``
        returns ``(loss, aux)`` and the value is ``(loss, aux)``, ``aux`` detached."""

        def run(wrt: Any, batch: Any) -> tuple[Any, Any]:
            if self.chosen is None:  # "auto", first call: a look at the module
                reason = reason_up_front(self.module)
                if reason is not None:
                    self._notice(reason)
                else:
                    self.chosen = "func"
            if self.chosen == "autograd":
                return autograd_grad_and_value(fn, wrt, batch, has_aux=has_aux)
            # torch.func: "func", or "auto" until it meets code it cannot transform
            state = random.get_state() if self.engine == "auto" else None
            try:
                return torch.func.grad_and_value(fn, has_aux=has_aux)(wrt, batch)
            except RuntimeError as error:
                reason = _cannot_transform(error)
                if reason is None:
                    raise
                if self.engine == "func":
                    raise RuntimeError(
                        f"train_step(engine='func'): torch.func cannot differentiate this "
                        f"model ({reason}). Use engine='autograd' (the same pure step and "
                        f"gradients, computed with plain autograd; the step then cannot be "
                        f"transformed by torch.func), or engine='auto' to choose by itself. "
                        f"torch.func said: {error}"
                    ) from error
                self._notice(reason)
                random.set_state(state)  # the retry draws what the first attempt drew
                return autograd_grad_and_value(fn, wrt, batch, has_aux=has_aux)

        return run


def autograd_grad_and_value(
    fn: Callable[[Any, Any], Any], wrt: Any, batch: Any, *, has_aux: bool = False
) -> tuple[Any, Any]:
    """``torch.func.grad_and_value(fn, has_aux=has_aux)(wrt, batch)``, computed with plain
    autograd (``aux``, with ``has_aux``, comes back detached).

    The tensors of ``wrt`` (``Sharded`` leaves: their local shards) are replaced by detached
    leaf copies that require grad; ``backward()`` runs without ``inputs=`` (so that reentrant
    ``torch.utils.checkpoint`` works), and ``.grad`` it leaves on other tensors are put back.
    A tensor the loss does not depend on gets a zero gradient, as ``torch.func`` gives.
    """
    tensors, spec = torch_pytree.tree_flatten(wrt)
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t for t in tensors]
    with torch.enable_grad():
        out = fn(torch_pytree.tree_unflatten(leaves, spec), batch)
        loss, aux = out if has_aux else (out, None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            with _grads_kept(loss, {id(x) for x in leaves}):
                torch.autograd.backward(loss)
    grads = [
        (x.grad if x.grad is not None else torch.zeros_like(x))
        if isinstance(x, torch.Tensor)
        else x
        for x in leaves
    ]
    grad_tree = torch_pytree.tree_unflatten(grads, spec)
    if has_aux:
        detached = torch_pytree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux
        )
        return grad_tree, (loss.detach(), detached)
    return grad_tree, loss.detach()


class _grads_kept:
    """Put back the ``.grad`` of the leaves of ``loss``'s graph other than ``ours``."""

    def __init__(self, loss: torch.Tensor, ours: set[int]) -> None:
        self.saved = [(v, v.grad) for v in _graph_leaves(loss) if id(v) not in ours]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        for v, grad in self.saved:
            v.grad = grad


def _graph_leaves(loss: torch.Tensor) -> Iterator[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` nodes) that ``loss``'s backward would write."""
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            yield variable
        stack.extend(next_node for next_node, _ in node.next_functions)
