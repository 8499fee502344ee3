"""The shape-only planner: memory and communication per device, before anything runs.

:func:`plan` prices one training step of a model on a mesh from shapes alone (meta tensors
and the layout algebra the engine itself runs on); :func:`compare_strategies` puts DDP,
ZeRO-1/2/3, HSDP and FSDP+TP side by side. Figures are checked against measured runs in
``tests/test_planner.py``.
"""

from ._compare import STRATEGIES as STRATEGIES
from ._compare import Comparison as Comparison
from ._compare import compare_strategies as compare_strategies
from ._plan import CommFigure as CommFigure
from ._plan import PlanReport as PlanReport
from ._plan import UnitFigure as UnitFigure
from ._plan import plan as plan
from ._render import human as human

__all__ = [
    "STRATEGIES",
    "CommFigure",
    "Comparison",
    "PlanReport",
    "UnitFigure",
    "compare_strategies",
    "human",
    "plan",
]
