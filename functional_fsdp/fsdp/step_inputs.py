"""What a training step tells the ``FSDP.apply`` calls inside its loss function (private).

``train_step`` calls the user's ``loss_fn``, and ``loss_fn`` calls :meth:`FSDP.apply
<functional_fsdp.FSDP.apply>`: the step cannot pass arguments to ``apply`` itself. So it
passes one explicit, immutable :class:`StepInputs` per model, for the duration of the loss
function (``with given(model, ...)``). ``FSDP.apply`` reads it once, when the call starts,
and hands its fields to the interpreter (:func:`functional_fsdp.fsdp.runtime.run`) as
arguments; nothing else reads it, and nothing of it outlives the block. The public
:meth:`FSDP.no_sync` is the same block, for users' own accumulation loops.

This is the one channel between a step and the engine that is not an argument. It says
which collectives run (``replicas`` replace all-gathers by values the step already holds;
``reduce=False`` leaves the reduction of the gradients to the step), never what the units
compute with.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The per-step inputs of one model's ``apply`` calls.

    Attributes:
        reduce: ``False``: gradients stay local to each rank (no reduction over the data
            axes; the step reduces them once, e.g. ``accumulate_mode="local"``).
        replicas: ZeRO-1/2's full values held at rest: ``{id of a differentiated local
            shard, as apply receives it: its full value}``. A unit whose gathered parameters
            all have one computes with them instead of all-gathering (the same values); its
            backward still reduce-scatters onto the shards.
    """

    reduce: bool = True
    replicas: Mapping[int, torch.Tensor] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )


NONE = StepInputs()

# {id of an FSDP description: its StepInputs}, inside given() blocks of this thread or task.
_GIVEN: contextvars.ContextVar[Mapping[int, StepInputs]] = contextvars.ContextVar(
    "functional_fsdp_step_inputs", default=types.MappingProxyType({})
)


@contextlib.contextmanager
def given(model: Any, **changes: Any) -> Iterator[StepInputs]:
    """Inside the block, ``model.apply`` calls get ``changes`` (fields of :class:`StepInputs`)
    on top of the inputs an enclosing block gave them."""
    current = _GIVEN.get()
    inputs = dataclasses.replace(current.get(id(model), NONE), **changes)
    token = _GIVEN.set(types.MappingProxyType({**current, id(model): inputs}))
    try:
        yield inputs
    finally:
        _GIVEN.reset(token)


def inputs_for(model: Any) -> StepInputs:
    """The inputs given to ``model``'s calls here (:data:`NONE` outside any block)."""
    return _GIVEN.get().get(id(model), NONE)
