"""functional_fsdp: Fully Sharded Data Parallel training written as pure functions.

Parameters are pytrees of :class:`Sharded` values on a named ``DeviceMesh``; sharding is
data (a :class:`P` per tensor), and ``shard``/``gather``/``reshard`` move values between
layouts with explicit, differentiable collectives.
"""

from ._tree import tree_leaves as tree_leaves
from ._tree import tree_map as tree_map
from .collectives import CommCounter as CommCounter
from .collectives import CommRecord as CommRecord
from .collectives import all_gather as all_gather
from .collectives import all_reduce as all_reduce
from .collectives import all_reduce_grad as all_reduce_grad
from .collectives import count_comms as count_comms
from .collectives import reduce_scatter as reduce_scatter
from .forward import FSDP as FSDP
from .forward import MixedPrecision as MixedPrecision
from .forward import Policy as Policy
from .forward import find_units as find_units
from .forward import fsdp as fsdp
from .launch import ProcessPool as ProcessPool
from .launch import WorkerError as WorkerError
from .launch import launch as launch
from .mesh import Axis as Axis
from .mesh import axis_size as axis_size
from .mesh import axis_sizes as axis_sizes
from .mesh import init_distributed as init_distributed
from .mesh import make_mesh as make_mesh
from .sharded import Sharded as Sharded
from .sharding import gather as gather
from .sharding import reshard as reshard
from .sharding import shard as shard
from .simulate import is_simulated as is_simulated
from .simulate import rank_values as rank_values
from .simulate import simulated_mesh as simulated_mesh
from .spec import Layout as Layout
from .spec import P as P

__version__ = "0.1.0"

__all__ = [
    "FSDP",
    "Axis",
    "CommCounter",
    "CommRecord",
    "Layout",
    "MixedPrecision",
    "P",
    "Policy",
    "ProcessPool",
    "Sharded",
    "WorkerError",
    "all_gather",
    "all_reduce",
    "all_reduce_grad",
    "axis_size",
    "axis_sizes",
    "count_comms",
    "find_units",
    "fsdp",
    "gather",
    "init_distributed",
    "is_simulated",
    "launch",
    "make_mesh",
    "rank_values",
    "reduce_scatter",
    "reshard",
    "shard",
    "simulated_mesh",
    "tree_leaves",
    "tree_map",
]
