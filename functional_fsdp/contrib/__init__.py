"""optax.contrib's names: Muon, on sharded weights.

Example:
    >>> import torch, functional_fsdp as ff
    >>> opt = ff.contrib.muon(0.02)
    >>> state = opt.init({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
    >>> sorted(state.inner_states)
    ['adam', 'muon']
"""

from ..optim.muon import MuonDimensionNumbers as MuonDimensionNumbers
from ..optim.muon import MuonState as MuonState
from ..optim.muon import muon as muon
from ..optim.muon import orthogonalize_via_newton_schulz as orthogonalize_via_newton_schulz
from ..optim.muon import scale_by_muon as scale_by_muon
from ..optim.muon import scale_by_shape as scale_by_shape

__all__ = [
    "MuonDimensionNumbers",
    "MuonState",
    "muon",
    "orthogonalize_via_newton_schulz",
    "scale_by_muon",
    "scale_by_shape",
]
