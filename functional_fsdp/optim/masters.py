"""Master weights in the optimizer state: parameters in the compute dtype, fp32 masters with
the optimizer (the ZeRO paper's mixed-precision Adam, K = 12 bytes per parameter).

:func:`master_weights` wraps an optimizer in the optax style. Its state holds an fp32 copy
of the trainable parameters (the *masters*) laid out like the rest of the optimizer state, so
a ZeRO layout (``TrainState.create(..., opt_specs=P("dp"))``) shards the masters with Adam's
moments while the parameters themselves stay replicated in bf16. The inner optimizer steps
the masters with fp32 gradients; the new parameters are the masters cast to the compute dtype.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from optree import dataclasses as optree_dataclasses

from .._tree import NAMESPACE
from ._tree import check_tensor_tree, local_leaves
from .clipping import norm_dtype
from .transforms import (
    ABOUT_UPDATES,
    GradientTransformation,
    GradientTransformationExtraArgs,
    OptState,
    Params,
    Updates,
    call_update,
    without,
)


@optree_dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class MasterWeightsState:
    """State of :func:`master_weights`: the masters, the inner optimizer's state, and the
    dtype the parameters are kept in (static: part of the tree's structure, not a leaf, so
    checkpoints hold ``master.<name>`` and ``inner...`` only).

    Example:
        >>> import torch, functional_fsdp as ff
        >>> opt = ff.master_weights(ff.sgd(0.1), param_dtype=torch.bfloat16)
        >>> state = opt.init({"w": torch.ones(2)})
        >>> state.master["w"].dtype, state.param_dtype
        (torch.float32, torch.bfloat16)
    """

    master: Any  # like the params, in the master dtype (fp32), in the optimizer's layout
    inner: Any  # the inner optimizer's state, built on the masters
    # the dtype TrainState.create casts the trainable parameters to (static: not a leaf)
    param_dtype: torch.dtype = optree_dataclasses.field(default=torch.bfloat16, pytree_node=False)


def _cast(tree: Any, dtype: torch.dtype, copy: bool = False) -> Any:
    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(dtype, copy=copy)
        return t

    return optree.tree_map(cast, tree, namespace=NAMESPACE)


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly a ``dst`` value (a float cast that loses nothing)."""
    if src == dst:
        return True
    finfo_src, finfo_dst = torch.finfo(src), torch.finfo(dst)
    return finfo_dst.bits > finfo_src.bits and (
        finfo_dst.eps <= finfo_src.eps and finfo_dst.max >= finfo_src.max
    )


def _stale(updates: Updates, master_dtype: torch.dtype) -> tuple[str, ...]:
    """The keyword arguments about ``updates`` that no longer hold once they are cast to
    ``master_dtype``: none if the cast keeps every value and the norm is summed in the same
    dtype (one number either way), ``grad_norm`` if only the cast is exact, else both."""
    dtypes = {t.dtype for t in local_leaves(updates)[0] if t.is_floating_point()}
    if not all(_widens(d, master_dtype) for d in dtypes):
        return ABOUT_UPDATES
    return () if norm_dtype(dtypes) == norm_dtype([master_dtype]) else ("grad_norm",)


def master_weights(
    optimizer: GradientTransformation,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    master_dtype: torch.dtype = torch.float32,
) -> GradientTransformation:
    """Keep parameters in ``param_dtype`` and fp32 masters in the optimizer state.

    ``init(params)`` takes the full-precision parameters (so the masters start exact);
    :meth:`TrainState.create <functional_fsdp.TrainState.create>` then keeps the trainable
    parameters in ``param_dtype``. ``update(grads, state, params)`` casts the gradients to
    ``master_dtype``, steps the masters with ``optimizer`` and returns the updates that take
    ``params`` to the new masters cast to ``param_dtype``. ``train_step`` uses the cast masters
    themselves (bit-exact); :func:`apply_updates` outside it lands on them up to one rounding
    of ``param_dtype``. Checkpoints hold the masters (``opt_state.master.<name>``).

    With ``TrainState.create(..., opt_specs=P("dp"))`` (ZeRO-1/2) the masters are sharded with
    the optimizer state: per parameter 2 bytes replicated plus 12/N bytes (Adam's K = 12).

    Under ``train_step`` the step equals fp32 parameters computing in the same
    ``MixedPrecision`` policy, bit for bit: gradients reduced in a wider dtype than
    ``param_dtype`` (``reduce_dtype=torch.float32``) reach the masters unrounded (the step
    differentiates the masters, which FSDP gathers in the policy's ``param_dtype``), and
    micro-batches are summed in ``master_dtype``. See ``docs/guides/mixed-precision.md``.

    Args:
        optimizer: the inner optimizer (e.g. ``ff.adamw(3e-4)``), run on the masters.
        param_dtype: the dtype the parameters are kept and computed in.
        master_dtype: the dtype of the masters and of the inner optimizer's gradients.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> opt = ff.master_weights(ff.sgd(1e-4), param_dtype=torch.bfloat16)
        >>> state = ff.TrainState.create({"w": torch.ones(2)}, opt)
        >>> state.params["w"].dtype, state.opt_state.master["w"].dtype
        (torch.bfloat16, torch.float32)
        >>> step = ff.train_step(lambda p, b: (p["w"].float() * b).sum(), opt, batch="local")
        >>> for _ in range(3):
        ...     state, _ = step(state, torch.ones(2))
        >>> # steps of 1e-4 are below bf16's resolution at 1.0; the fp32 master keeps them
        >>> state.params["w"][0].item(), round(state.opt_state.master["w"][0].item(), 6)
        (1.0, 0.9997)
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"master_weights: wrap an optimizer (a GradientTransformation such as "
            f"ff.adamw(3e-4)), got {type(optimizer).__name__}."
        )
    for name, dtype in (("param_dtype", param_dtype), ("master_dtype", master_dtype)):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"master_weights({name}={dtype!r}): use a floating torch dtype, e.g. "
                f"torch.bfloat16 for the parameters and torch.float32 for the masters."
            )

    def init(params: Params) -> MasterWeightsState:
        check_tensor_tree(params, "master_weights.init")
        master = _cast(params, master_dtype, copy=True)  # own copies, never the params
        return MasterWeightsState(master, optimizer.init(master), param_dtype)

    def update(
        updates: Updates, state: OptState, params: Params | None = None, **kwargs: Any
    ) -> tuple[Updates, OptState]:
        if not isinstance(state, MasterWeightsState):
            raise ValueError(
                f"master_weights got a state of type {type(state).__name__}; pass the state "
                f"its init() returned (a MasterWeightsState)."
            )
        grads = _cast(updates, master_dtype)
        # The inner optimizer gets the gradients cast to the master dtype. Their norm is
        # ``grad_norm`` when the cast is exact and the norm is computed in the same dtype
        # (bf16/fp16 gradients, fp32 masters): then it is passed on, and a clip inside costs
        # no second all-reduce. ``finite`` holds whenever the cast is exact (a narrowing cast
        # can overflow a finite gradient). Otherwise the inner optimizer computes its own.
        extra = without(kwargs, _stale(updates, master_dtype))
        inner_updates, inner = call_update(optimizer, grads, state.inner, state.master, extra)
        m, treedef = local_leaves(state.master)
        new_master = optree.tree_unflatten(
            treedef, torch._foreach_add(m, local_leaves(inner_updates)[0])
        )
        if params is None:
            out = inner_updates
        else:
            p, p_def = local_leaves(params)
            cast = [x.to(y.dtype) for x, y in zip(local_leaves(new_master)[0], p)]
            out = optree.tree_unflatten(p_def, torch._foreach_sub(cast, p))
        return out, MasterWeightsState(new_master, inner, param_dtype)

    return GradientTransformationExtraArgs(init, update)
