"""Checkpoints: DCP save and load that reshard across meshes.

Example:
    >>> ff.checkpoint.save("ckpt/step_100", state)  # doctest: +SKIP
    >>> state = ff.checkpoint.load("ckpt/step_100", fresh_state_on_another_mesh)  # doctest: +SKIP
"""

from .dcp import load as load
from .dcp import save as save

__all__ = ["load", "save"]
