"""Refuse, before it runs, a model whose attention cannot follow a sequence split."""

from __future__ import annotations

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
