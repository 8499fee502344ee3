"""Refuse, before it runs, a model whose attention cannot follow a sequence split."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.axes import describe_mesh
from .attention import ATTENTION_NAME


def check_split_attention(module: nn.Module, axis: str, mesh: DeviceMesh) -> None:
    """Raise if a transformers (sub)model of ``module`` runs another attention than
    :func:`functional_fsdp.cp.hf_attention`: under a sequence split it would attend within
    each rank's chunks only. Models of other libraries are checked after their forward (no
    attention call through :func:`functional_fsdp.cp.attention` at all is refused)."""
    for path, sub in module.named_modules():
        config = sub.__dict__.get("config")
        impl = getattr(config, "_attn_implementation", None)
        if impl is None or impl == ATTENTION_NAME:
            continue
        where = f"{type(sub).__name__} at {path!r}" if path else type(sub).__name__
        raise ValueError(
            f"{where} uses attn_implementation={impl!r}, which attends within each rank's "
            f"chunks only, but the {axis!r} axis of {describe_mesh(mesh)} splits each "
            f"sequence. Build the model with attn_implementation=ff.cp.register_attention() "
            f"(exact attention over the whole sequence; plain attention where nothing is "
            f"split), or pass sequence_axis=None to ff.fsdp to split the batch over "
            f"{axis!r} instead."
        )


def with_padding_mask(module: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``kwargs`` with an all-ones boolean ``attention_mask`` where a transformers model
    running :func:`functional_fsdp.cp.hf_attention` gets ``position_ids`` and no mask, and
    whether it added one.

    transformers reads such a call as possibly packed and looks for document starts in each
    rank's ``position_ids``, whose chunks start anywhere under a sequence split (and differ
    per rank on a simulated mesh, where that look cannot run). The attention finds the
    documents itself, over the whole sequence, and (told by the call's split) treats this
    mask as nothing to mask or gather.
    """
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return kwargs, False
    if kwargs.get("position_ids") is None or kwargs.get("attention_mask") is not None:
        return kwargs, False
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return kwargs, False
    ones = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
    return {**kwargs, "attention_mask": ones}, True
