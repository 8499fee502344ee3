"""Checkpoints: atomic, verified DCP saves that reshard across meshes, and a manager.

Example:
    >>> ff.checkpoint.save("ckpt/step_100", state)  # doctest: +SKIP
    >>> state = ff.checkpoint.load("ckpt/step_100", fresh_state_on_another_mesh)  # doctest: +SKIP
    >>> mgr = ff.checkpoint.CheckpointManager("ckpt", save_every=100, async_save=True)  # doctest: +SKIP
"""

from ._atomic import CheckpointError as CheckpointError
from .dcp import load as load
from .dcp import save as save
from .manager import CheckpointManager as CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "load", "save"]
