"""Checkpoints: atomic, verified DCP saves that reshard across meshes, a checkpoint manager,
and Hugging Face I/O.

``save``/``load`` checkpoint any state (params, optimizer state) with torch DCP, atomically
and verified; ``CheckpointManager`` saves every N steps (optionally in the background), keeps
the last K and restores the latest complete step. ``load_safetensors``/``load_dcp_state_dict``
read pretrained weights shard by shard; ``export_safetensors`` writes a
``from_pretrained``-ready directory one unit at a time; ``full_state_dict`` returns the whole
state dict with tied names; ``export_peft_adapter`` and ``export_merged`` write LoRA adapters
in peft's format and the merged model.

Example:
    >>> ff.checkpoint.save("ckpt/step_100", state)  # doctest: +SKIP
    >>> state = ff.checkpoint.load("ckpt/step_100", fresh_state_on_another_mesh)  # doctest: +SKIP
    >>> mgr = ff.checkpoint.CheckpointManager("ckpt", save_every=100, async_save=True)  # doctest: +SKIP
    >>> params = ff.checkpoint.load_safetensors(sm, "llama-dir")  # doctest: +SKIP
"""

from ._atomic import CheckpointError as CheckpointError
from .dcp import load as load
from .dcp import save as save
from .hf_export import export_safetensors as export_safetensors
from .hf_export import full_state_dict as full_state_dict
from .hf_load import load_dcp_state_dict as load_dcp_state_dict
from .hf_load import load_safetensors as load_safetensors
from .lora import export_merged as export_merged
from .lora import export_peft_adapter as export_peft_adapter
from .manager import CheckpointManager as CheckpointManager

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "export_merged",
    "export_peft_adapter",
    "export_safetensors",
    "full_state_dict",
    "load",
    "load_dcp_state_dict",
    "load_safetensors",
    "save",
]
