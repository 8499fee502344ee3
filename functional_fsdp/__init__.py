"""functional_fsdp: Fully Sharded Data Parallel training written as pure functions.

Parameters are pytrees of :class:`Sharded` values on a named ``DeviceMesh``; sharding is
data (a :class:`P` per tensor), and ``shard``/``gather``/``reshard`` move values between
layouts with explicit, differentiable collectives.
"""

from . import checkpoint as checkpoint
from ._tree import tree_leaves as tree_leaves
from ._tree import tree_map as tree_map
from .clipping import clip_by_global_norm as clip_by_global_norm
from .clipping import global_norm as global_norm
from .collectives import CommCounter as CommCounter
from .collectives import CommRecord as CommRecord
from .collectives import all_gather as all_gather
from .collectives import all_reduce as all_reduce
from .collectives import all_reduce_grad as all_reduce_grad
from .collectives import count_comms as count_comms
from .collectives import reduce_scatter as reduce_scatter
from .debug import describe as describe
from .debug import visualize as visualize
from .forward import FSDP as FSDP
from .forward import MixedPrecision as MixedPrecision
from .forward import Policy as Policy
from .forward import find_units as find_units
from .forward import fsdp as fsdp
from .launch import ProcessPool as ProcessPool
from .launch import WorkerError as WorkerError
from .launch import launch as launch
from .memory import MemoryEvent as MemoryEvent
from .memory import MemoryTracker as MemoryTracker
from .memory import track_memory as track_memory
from .mesh import Axis as Axis
from .mesh import axis_size as axis_size
from .mesh import axis_sizes as axis_sizes
from .mesh import init_distributed as init_distributed
from .mesh import make_mesh as make_mesh
from .optim import EmptyState as EmptyState
from .optim import GradientTransformation as GradientTransformation
from .optim import MaskedState as MaskedState
from .optim import ScaleByAdamState as ScaleByAdamState
from .optim import ScaleByScheduleState as ScaleByScheduleState
from .optim import TraceState as TraceState
from .optim import TransformInitFn as TransformInitFn
from .optim import TransformUpdateFn as TransformUpdateFn
from .optim import adam as adam
from .optim import adamw as adamw
from .optim import add_decayed_weights as add_decayed_weights
from .optim import apply_updates as apply_updates
from .optim import chain as chain
from .optim import identity as identity
from .optim import masked as masked
from .optim import scale as scale
from .optim import scale_by_adam as scale_by_adam
from .optim import scale_by_learning_rate as scale_by_learning_rate
from .optim import scale_by_schedule as scale_by_schedule
from .optim import sgd as sgd
from .optim import trace as trace
from .schedules import Schedule as Schedule
from .schedules import constant_schedule as constant_schedule
from .schedules import cosine_decay_schedule as cosine_decay_schedule
from .schedules import join_schedules as join_schedules
from .schedules import linear_schedule as linear_schedule
from .schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from .sharded import Sharded as Sharded
from .sharding import gather as gather
from .sharding import reshard as reshard
from .sharding import shard as shard
from .simulate import is_simulated as is_simulated
from .simulate import rank_values as rank_values
from .simulate import simulated_mesh as simulated_mesh
from .spec import Layout as Layout
from .spec import P as P
from .tp import TensorParallel as TensorParallel
from .tp import gpt_plan as gpt_plan
from .tp import tensor_parallel as tensor_parallel
from .tp_ops import copy_to as copy_to
from .tp_ops import gather_from as gather_from
from .tp_ops import reduce_from as reduce_from
from .tp_ops import scatter_to as scatter_to
from .tp_ops import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .tp_ops import vocab_parallel_embedding as vocab_parallel_embedding
from .tp_styles import ColwiseParallel as ColwiseParallel
from .tp_styles import PrepareInput as PrepareInput
from .tp_styles import RowwiseParallel as RowwiseParallel
from .tp_styles import ScatterOutput as ScatterOutput
from .tp_styles import SequenceParallel as SequenceParallel
from .tp_styles import Style as Style
from .tp_styles import VocabParallelEmbedding as VocabParallelEmbedding
from .train import DonatedStateError as DonatedStateError
from .train import TrainState as TrainState
from .train import train_step as train_step

__version__ = "0.1.0"

__all__ = [
    "FSDP",
    "Axis",
    "ColwiseParallel",
    "CommCounter",
    "CommRecord",
    "DonatedStateError",
    "EmptyState",
    "GradientTransformation",
    "Layout",
    "MaskedState",
    "MemoryEvent",
    "MemoryTracker",
    "MixedPrecision",
    "P",
    "Policy",
    "PrepareInput",
    "ProcessPool",
    "RowwiseParallel",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "ScatterOutput",
    "Schedule",
    "SequenceParallel",
    "Sharded",
    "Style",
    "TensorParallel",
    "TraceState",
    "TrainState",
    "TransformInitFn",
    "TransformUpdateFn",
    "VocabParallelEmbedding",
    "WorkerError",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_gather",
    "all_reduce",
    "all_reduce_grad",
    "apply_updates",
    "axis_size",
    "axis_sizes",
    "chain",
    "checkpoint",
    "clip_by_global_norm",
    "constant_schedule",
    "copy_to",
    "cosine_decay_schedule",
    "count_comms",
    "describe",
    "find_units",
    "fsdp",
    "gather",
    "gather_from",
    "global_norm",
    "gpt_plan",
    "identity",
    "init_distributed",
    "is_simulated",
    "join_schedules",
    "launch",
    "linear_schedule",
    "make_mesh",
    "masked",
    "rank_values",
    "reduce_from",
    "reduce_scatter",
    "reshard",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scatter_to",
    "sgd",
    "shard",
    "simulated_mesh",
    "tensor_parallel",
    "trace",
    "track_memory",
    "train_step",
    "tree_leaves",
    "tree_map",
    "visualize",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "warmup_cosine_decay_schedule",
]
