"""Old names of :mod:`functional_fsdp.fsdp.layout` (``Plan`` is now ``ModelLayout``).

Kept while the FSDP runtime, units, ZeRO and API modules move to the new names; internal, so
these aliases go once nothing imports them.
"""

from .layout import ModelLayout as Plan
from .layout import Piece as Piece
from .layout import Round as Round
from .layout import UnitLayout as UnitPlan
from .layout import gather_dtype as gather_dtype
from .layout import gather_rounds as plan_rounds
from .layout import model_layout as make_plan
from .layout import unit_of as unit_of

__all__ = [
    "Piece",
    "Plan",
    "Round",
    "UnitPlan",
    "gather_dtype",
    "make_plan",
    "plan_rounds",
    "unit_of",
]
