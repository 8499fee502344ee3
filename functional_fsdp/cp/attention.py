"""Exact attention over a sequence split across ranks (context parallelism).

Each rank of the ``cp`` axis holds two chunks of every sequence (:mod:`.layout`). Its
queries attend to the keys of the whole sequence: the keys and values are all-gathered over
the axis (the Llama 3 paper's all-gather context parallelism: one collective per layer, the
backward a reduce-scatter of their gradients), and the mask is built from global token
indices, so that the result is the one process's attention on the whole sequence:

* causal: a query at global index ``g`` sees keys at ``<= g``;
* documents: where ``position_ids`` are given (packed sequences, Hugging Face's
  padding-free convention), a query sees only the keys of its own document; a document
  starts where the position does not continue the previous one's by one, as transformers'
  ``find_packed_sequence_indices`` reads it;
* padding: a 2D ``attention_mask`` (1 for tokens, 0 for padding) hides padded keys;
* sliding windows: a query sees the ``sliding_window`` keys before it, itself included.

The model code calls :func:`attention` (or, for a transformers model, the attention
registered by :func:`register_attention`); which mesh and axis split the sequence is read
from the call of :meth:`FSDP.apply <functional_fsdp.FSDP.apply>` it runs in (a context
variable that the activation-checkpointing recompute replays). Outside such a call, or on an
axis of size 1, it is plain attention on the local sequence.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.accounting import labelled
from ..distributed.axes import axis_sizes, describe_mesh
from ..distributed.collectives import all_gather
from ..distributed.simulate import rank_values
from .layout import gathered_index, sequence_positions

ATTENTION_NAME = "functional_fsdp_cp"
"""The name :func:`register_attention` registers with transformers' ``AttentionInterface``."""

COMM_LABEL = "cp"
"""The label (:attr:`functional_fsdp.CommRecord.label`) of the attention's collectives: the
gathers of keys, values, positions and padding, and the reduce-scatters of their gradients."""


@dataclass
class SequenceSplit:
    """The sequence split of one :meth:`FSDP.apply` call: its mesh and axis, and how many
    attention calls went through :func:`attention` (a model that never calls it would
    attend within its own chunks only; the call refuses that)."""

    mesh: DeviceMesh
    axis: str
    calls: int = 0
    # The call had no padding mask and added one of ones, so that transformers does not
    # look for packed documents in a rank's chunks (cp.checks.with_padding_mask): the mask
    # the attention then receives is that one, with nothing to mask or gather.
    mask_added: bool = False

    @property
    def size(self) -> int:
        return axis_sizes(self.mesh)[self.axis]


_CURRENT: contextvars.ContextVar[SequenceSplit | None] = contextvars.ContextVar(
    "functional_fsdp_sequence_split", default=None
)


@contextlib.contextmanager
def splitting(mesh: DeviceMesh, axis: str, mask_added: bool = False) -> Iterator[SequenceSplit]:
    """Inside the block, :func:`attention` gathers keys and values over ``axis``."""
    split = SequenceSplit(mesh, axis, mask_added=mask_added)
    token = _CURRENT.set(split)
    try:
        yield split
    finally:
        _CURRENT.reset(token)


def current() -> SequenceSplit | None:
    """The sequence split of the :meth:`FSDP.apply` call running now, if any."""
    return _CURRENT.get()


def positions(length: int, device: torch.device | None = None) -> torch.Tensor:
    """The global index of each of this rank's ``length`` tokens: ``arange(length)`` outside
    a sequence split, this rank's two chunks inside one. For models that compute their own
    position embeddings (the library's GPT).

    Example:
        >>> import functional_fsdp as ff
        >>> ff.cp.positions(4).tolist()
        [0, 1, 2, 3]
    """
    split = current()
    if split is None or split.size == 1:
        return torch.arange(length, device=device)
    return sequence_positions(split.mesh, split.axis, length, device)


def _documents(pos: torch.Tensor) -> torch.Tensor:
    """A document number per token: a new one wherever the position does not go on by one."""
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def _check_global_positions(pos: torch.Tensor, split: SequenceSplit) -> None:
    """Refuse position ids that are not positions in the global sequence (eagerly only)."""
    if torch.compiler.is_compiling() or pos.is_meta:
        return
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(pos):
        return
    step = torch.diff(pos, dim=-1)
    bad = (step != 1) & (pos[:, 1:] != 0)
    for values, flags in zip(rank_values(pos), rank_values(bad)):
        hits = flags.nonzero()
        if len(hits):
            row, g = (int(v) for v in hits[0])
            raise ValueError(
                f"context-parallel attention over {split.axis!r} of {describe_mesh(split.mesh)}: "
                f"position_ids are not positions in the global sequence: in row {row} the "
                f"position goes from {int(values[row, g])} to {int(values[row, g + 1])} at "
                f"global token {g + 1} (a position either goes on by one or starts a document "
                f"at 0). Pass each token's global position, split with the batch (ff.local_batch "
                f"splits position_ids with input_ids); a transformers model given no "
                f"position_ids numbers each rank's chunks from 0."
            )


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys.

    Args:
        query: ``[batch, heads, local_length, head_dim]``, this rank's tokens.
        key: ``[batch, kv_heads, local_length, head_dim]``; ``heads`` must be a multiple of
            ``kv_heads`` (grouped-query attention).
        value: like ``key``.
        position_ids: ``[batch or 1, local_length]``, each token's position in its document
            (global positions, split with the batch). Packed documents never attend to each
            other. ``None``: the whole row is one sequence.
        padding_mask: ``[batch, local_length]``, nonzero for tokens and 0 for padding keys.
        scale: the softmax scale (default ``head_dim ** -0.5``).
        dropout_p: attention dropout (each rank draws its own masks for its queries).
        is_causal: a causal mask (``False``: every query sees every key of its document).
        sliding_window: the number of keys a query sees, itself included.

    Returns:
        ``[batch, heads, local_length, head_dim]``.

    Example:
        >>> import torch, functional_fsdp as ff
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> torch.allclose(ff.cp.attention(q, k, v),
        ...                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        True
    """
    split = current()
    if split is not None:
        split.calls += 1
    cp = 1 if split is None else split.size
    plain = position_ids is None and padding_mask is None and sliding_window is None
    if cp == 1 and plain:
        key, value = _repeat_kv(query, key, value)
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    local = query.shape[2]
    device = query.device
    if cp == 1:
        q_index = k_index = torch.arange(local, device=device)
        order = None
    else:
        assert split is not None
        with labelled(COMM_LABEL):
            key = all_gather(key, split.mesh, split.axis, dim=2)
            value = all_gather(value, split.mesh, split.axis, dim=2)
        q_index = sequence_positions(split.mesh, split.axis, local, device)
        k_index = gathered_index(local, cp, device)
        order = torch.argsort(k_index)
    if is_causal:
        mask = k_index[None, :] <= q_index[:, None]
    else:
        mask = torch.ones(local, k_index.shape[0], dtype=torch.bool, device=device)
    if sliding_window is not None:
        mask = mask & (q_index[:, None] - k_index[None, :] < sliding_window)
    mask = mask[None]  # [1 or batch, q, k]
    if position_ids is not None:
        pos = position_ids.expand(query.shape[0], -1)
        if split is not None and cp > 1:
            with labelled(COMM_LABEL):
                pos = all_gather(pos, split.mesh, split.axis, dim=1)
            pos = pos[:, order]  # global order
            _check_global_positions(pos, split)
            in_order = _documents(pos)  # by global index
            docs = in_order[:, k_index]  # in the gathered order
            q_docs = in_order.gather(1, q_index.expand(pos.shape[0], -1))
        else:
            docs = q_docs = _documents(pos)
        mask = mask & (q_docs[:, :, None] == docs[:, None, :])
    if padding_mask is not None:
        keep = padding_mask.to(torch.bool)
        if split is not None and cp > 1:
            with labelled(COMM_LABEL):
                keep = all_gather(keep.to(torch.uint8), split.mesh, split.axis, dim=1).bool()
        mask = mask & keep[:, None, :]
        # A padded query that sees no key would be NaN: let it see itself (its output is
        # padding, and no real token sees it).
        mask = mask | (k_index[None, None, :] == q_index[None, :, None])
    key, value = _repeat_kv(query, key, value)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None], dropout_p=dropout_p, scale=scale
    )


def _repeat_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values repeated to the query heads (grouped-query attention), as
    transformers' ``repeat_kv``."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)


_UNSUPPORTED = ("softcap", "s_aux", "position_bias", "sinks")


def hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`attention` with transformers' attention-function signature (what
    :func:`register_attention` registers): returns ``([batch, length, heads, head_dim],
    None)``."""
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__}: context-parallel attention does not implement "
                f"{name!r} (this architecture's attention modifies the scores); train it "
                f"without a 'cp' axis, or with attn_implementation='eager'."
            )
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(
            f"{type(module).__name__}: context-parallel attention takes a 2D padding mask "
            f"([batch, length], 1 for tokens), got one of shape {tuple(attention_mask.shape)}; "
            f"pass the batch's attention_mask as the tokenizer returns it, or position_ids "
            f"for packed documents."
        )
    split = current()
    if split is not None and split.mask_added:
        attention_mask = None  # the ones the call added: nothing to mask, nothing to gather
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attention(
        query,
        key,
        value,
        position_ids=kwargs.get("position_ids"),
        padding_mask=attention_mask,
        scale=scaling,
        dropout_p=dropout,
        is_causal=bool(causal),
        sliding_window=kwargs.get("sliding_window"),
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register the context-parallel attention with transformers; returns its name.

    Build the model with it, ``attn_implementation=ff.cp.register_attention()``: its
    attention layers then run :func:`attention`, exact over a sequence split by a ``cp``
    mesh axis and plain attention elsewhere (so the same model runs on one process too).

    Example:
        >>> import functional_fsdp as ff
        >>> ff.cp.register_attention()  # doctest: +SKIP
        'functional_fsdp_cp'
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    # Without a mask function of its own, transformers would hand the attention no padding
    # mask at all; this one passes the batch's 2D mask through as it is.
    AttentionMaskInterface.register(ATTENTION_NAME, _padding_mask)
    return ATTENTION_NAME


def _padding_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """transformers' mask function for :func:`hf_attention`: the 2D padding mask (or
    ``None``), which :func:`attention` turns into its mask over the split sequence."""
    return attention_mask
