"""functional_fsdp: Fully Sharded Data Parallel training written as pure functions.

Parameters are pytrees of :class:`Sharded` values on a named ``DeviceMesh``; sharding is
data (a :class:`P` per tensor), and ``shard``/``gather``/``reshard`` move values between
layouts with explicit, differentiable collectives.
"""

from . import contrib as contrib
from . import cp as cp
from . import dtensor as dtensor  # provides Sharded.to_dtensor and Sharded.from_dtensor
from . import ft as ft
from ._dpo import dpo_loss as dpo_loss
from ._lm_losses import causal_lm_loss as causal_lm_loss
from ._lm_losses import sequence_logps as sequence_logps
from ._loss import SumCount as SumCount
from ._partition import combine as combine
from ._partition import partition as partition
from ._tree import tree_leaves as tree_leaves
from ._tree import tree_map as tree_map
from .compiled import Jitted as Jitted
from .compiled import TraceError as TraceError
from .compiled import jit as jit
from .display import describe as describe
from .display import visualize as visualize
from .distributed.collectives import CollectiveError as CollectiveError
from .distributed.collectives import CommCounter as CommCounter
from .distributed.collectives import CommRecord as CommRecord
from .distributed.collectives import all_gather as all_gather
from .distributed.collectives import all_reduce as all_reduce
from .distributed.collectives import all_reduce_grad as all_reduce_grad
from .distributed.collectives import check_collectives as check_collectives
from .distributed.collectives import count_comms as count_comms
from .distributed.collectives import reduce_scatter as reduce_scatter
from .distributed.mesh import Axis as Axis
from .distributed.mesh import axis_size as axis_size
from .distributed.mesh import axis_sizes as axis_sizes
from .distributed.mesh import init_distributed as init_distributed
from .distributed.mesh import make_mesh as make_mesh
from .distributed.mesh import rank_device as rank_device
from .distributed.simulate import end_simulation as end_simulation
from .distributed.simulate import is_simulated as is_simulated
from .distributed.simulate import rank_values as rank_values
from .distributed.simulate import simulated_mesh as simulated_mesh
from .fsdp.api import FSDP as FSDP
from .fsdp.api import SingleUnitWarning as SingleUnitWarning
from .fsdp.api import fsdp as fsdp
from .fsdp.float8_gather import Float8Gather as Float8Gather
from .fsdp.float8_gather import float8_round_trip as float8_round_trip
from .fsdp.materialize import init_sharded as init_sharded
from .fsdp.memory import MemoryEvent as MemoryEvent
from .fsdp.memory import MemoryTracker as MemoryTracker
from .fsdp.memory import track_memory as track_memory
from .fsdp.policy import MixedPrecision as MixedPrecision
from .fsdp.policy import Policy as Policy
from .fsdp.policy import find_units as find_units
from .fsdp.quantized_gather import QuantizedGather as QuantizedGather
from .fsdp.quantized_gather import dequantize_blockwise as dequantize_blockwise
from .fsdp.quantized_gather import quantize_blockwise as quantize_blockwise
from .fsdp.quantized_reduce import QuantizedReduce as QuantizedReduce
from .fsdp.tensor_peak import TensorPeak as TensorPeak
from .fsdp.tensor_peak import tensor_peak as tensor_peak
from .grad_engine import AutogradFallbackWarning as AutogradFallbackWarning
from .launcher import ProcessPool as ProcessPool
from .launcher import WorkerError as WorkerError
from .launcher import launch as launch
from .models.gpt import gpt_plan as gpt_plan
from .models.llama import llama_plan as llama_plan
from .optim.clipping import clip_by_global_norm as clip_by_global_norm
from .optim.clipping import global_norm as global_norm
from .optim.clipping import global_norm_and_finite as global_norm_and_finite
from .optim.clipping import leaf_norms as leaf_norms
from .optim.elementwise import EmaState as EmaState
from .optim.elementwise import ScaleByLionState as ScaleByLionState
from .optim.elementwise import ZeroNansState as ZeroNansState
from .optim.elementwise import clip as clip
from .optim.elementwise import ema as ema
from .optim.elementwise import lamb as lamb
from .optim.elementwise import lion as lion
from .optim.elementwise import scale_by_lion as scale_by_lion
from .optim.elementwise import scale_by_trust_ratio as scale_by_trust_ratio
from .optim.elementwise import zero_nans as zero_nans
from .optim.factored import FactoredState as FactoredState
from .optim.factored import adafactor as adafactor
from .optim.factored import clip_by_block_rms as clip_by_block_rms
from .optim.factored import scale_by_factored_rms as scale_by_factored_rms
from .optim.factored import scale_by_param_block_rms as scale_by_param_block_rms
from .optim.finite import ApplyIfFiniteState as ApplyIfFiniteState
from .optim.finite import apply_if_finite as apply_if_finite
from .optim.masters import MasterWeightsState as MasterWeightsState
from .optim.masters import master_weights as master_weights
from .optim.records import learning_rate_of as learning_rate_of
from .optim.schedules import Schedule as Schedule
from .optim.schedules import constant_schedule as constant_schedule
from .optim.schedules import cosine_decay_schedule as cosine_decay_schedule
from .optim.schedules import cosine_onecycle_schedule as cosine_onecycle_schedule
from .optim.schedules import exponential_decay as exponential_decay
from .optim.schedules import join_schedules as join_schedules
from .optim.schedules import linear_onecycle_schedule as linear_onecycle_schedule
from .optim.schedules import linear_schedule as linear_schedule
from .optim.schedules import piecewise_constant_schedule as piecewise_constant_schedule
from .optim.schedules import polynomial_schedule as polynomial_schedule
from .optim.schedules import sgdr_schedule as sgdr_schedule
from .optim.schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from .optim.transforms import EmptyState as EmptyState
from .optim.transforms import GradientTransformation as GradientTransformation
from .optim.transforms import (
    GradientTransformationExtraArgs as GradientTransformationExtraArgs,
)
from .optim.transforms import MaskedState as MaskedState
from .optim.transforms import ScaleByAdamState as ScaleByAdamState
from .optim.transforms import ScaleByScheduleState as ScaleByScheduleState
from .optim.transforms import TraceState as TraceState
from .optim.transforms import TransformInitFn as TransformInitFn
from .optim.transforms import TransformUpdateFn as TransformUpdateFn
from .optim.transforms import adam as adam
from .optim.transforms import adamw as adamw
from .optim.transforms import add_decayed_weights as add_decayed_weights
from .optim.transforms import apply_updates as apply_updates
from .optim.transforms import chain as chain
from .optim.transforms import identity as identity
from .optim.transforms import masked as masked
from .optim.transforms import scale as scale
from .optim.transforms import scale_by_adam as scale_by_adam
from .optim.transforms import scale_by_learning_rate as scale_by_learning_rate
from .optim.transforms import scale_by_schedule as scale_by_schedule
from .optim.transforms import sgd as sgd
from .optim.transforms import trace as trace
from .optim.wrappers import InjectHyperparamsState as InjectHyperparamsState
from .optim.wrappers import MultiSteps as MultiSteps
from .optim.wrappers import MultiStepsState as MultiStepsState
from .optim.wrappers import MultiTransformState as MultiTransformState
from .optim.wrappers import inject_hyperparams as inject_hyperparams
from .optim.wrappers import multi_transform as multi_transform
from .planner import Comparison as Comparison
from .planner import PlanReport as PlanReport
from .planner import compare_strategies as compare_strategies
from .planner import plan as plan
from .plot import plot_comms as plot_comms
from .plot import plot_losses as plot_losses
from .plot import plot_memory as plot_memory
from .resharding import gather as gather
from .resharding import reshard as reshard
from .resharding import shard as shard
from .rng import fold_in as fold_in
from .rng import rng_key as rng_key
from .rng import seeded as seeded
from .sharded import Sharded as Sharded
from .spec import Layout as Layout
from .spec import P as P
from .tp.hf import hf_tp_plan as hf_tp_plan
from .tp.ops import copy_to as copy_to
from .tp.ops import gather_from as gather_from
from .tp.ops import reduce_from as reduce_from
from .tp.ops import scatter_to as scatter_to
from .tp.ops import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .tp.ops import vocab_parallel_embedding as vocab_parallel_embedding
from .tp.plan import TensorParallel as TensorParallel
from .tp.plan import tensor_parallel as tensor_parallel
from .tp.porting import parallelize_module as parallelize_module
from .tp.styles import ColwiseParallel as ColwiseParallel
from .tp.styles import ExpertParallel as ExpertParallel
from .tp.styles import LocalAttributes as LocalAttributes
from .tp.styles import PrepareInput as PrepareInput
from .tp.styles import ReplicatedParallel as ReplicatedParallel
from .tp.styles import RowwiseParallel as RowwiseParallel
from .tp.styles import ScatterInput as ScatterInput
from .tp.styles import ScatterOutput as ScatterOutput
from .tp.styles import SequenceParallel as SequenceParallel
from .tp.styles import Style as Style
from .tp.styles import VocabParallelEmbedding as VocabParallelEmbedding
from .tp.styles import divide_by_tp as divide_by_tp
from .tp.torch_styles import from_torch_plan as from_torch_plan
from .train import DonatedStateError as DonatedStateError
from .train import TrainState as TrainState
from .train import local_batch as local_batch
from .train import train_step as train_step

__version__ = "0.1.0"

__all__ = [
    "FSDP",
    "ApplyIfFiniteState",
    "AutogradFallbackWarning",
    "Axis",
    "CollectiveError",
    "ColwiseParallel",
    "CommCounter",
    "CommRecord",
    "Comparison",
    "DonatedStateError",
    "EmaState",
    "EmptyState",
    "ExpertParallel",
    "FactoredState",
    "Float8Gather",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "InjectHyperparamsState",
    "Jitted",
    "Layout",
    "LocalAttributes",
    "MaskedState",
    "MasterWeightsState",
    "MemoryEvent",
    "MemoryTracker",
    "MixedPrecision",
    "MultiSteps",
    "MultiStepsState",
    "MultiTransformState",
    "P",
    "PlanReport",
    "Policy",
    "PrepareInput",
    "ProcessPool",
    "QuantizedGather",
    "QuantizedReduce",
    "ReplicatedParallel",
    "RowwiseParallel",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "ScatterInput",
    "ScatterOutput",
    "Schedule",
    "SequenceParallel",
    "Sharded",
    "SingleUnitWarning",
    "Style",
    "SumCount",
    "TensorParallel",
    "TensorPeak",
    "TraceError",
    "TraceState",
    "TrainState",
    "TransformInitFn",
    "TransformUpdateFn",
    "VocabParallelEmbedding",
    "WorkerError",
    "ZeroNansState",
    "adafactor",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_gather",
    "all_reduce",
    "all_reduce_grad",
    "apply_if_finite",
    "apply_updates",
    "axis_size",
    "axis_sizes",
    "causal_lm_loss",
    "chain",
    "check_collectives",
    "checkpoint",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "combine",
    "compare_strategies",
    "constant_schedule",
    "contrib",
    "copy_to",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "count_comms",
    "cp",
    "dequantize_blockwise",
    "describe",
    "divide_by_tp",
    "dpo_loss",
    "ema",
    "end_simulation",
    "exponential_decay",
    "find_units",
    "float8_round_trip",
    "fold_in",
    "from_torch_plan",
    "fsdp",
    "ft",
    "gather",
    "gather_from",
    "global_norm",
    "global_norm_and_finite",
    "gpt_plan",
    "hf_tp_plan",
    "identity",
    "init_distributed",
    "init_sharded",
    "inject_hyperparams",
    "is_simulated",
    "jit",
    "join_schedules",
    "lamb",
    "launch",
    "leaf_norms",
    "learning_rate_of",
    "linear_onecycle_schedule",
    "linear_schedule",
    "lion",
    "llama_plan",
    "local_batch",
    "make_mesh",
    "masked",
    "master_weights",
    "multi_transform",
    "parallelize_module",
    "partition",
    "piecewise_constant_schedule",
    "plan",
    "plot_comms",
    "plot_losses",
    "plot_memory",
    "polynomial_schedule",
    "quantize_blockwise",
    "rank_device",
    "rank_values",
    "reduce_from",
    "reduce_scatter",
    "reshard",
    "rng_key",
    "scale",
    "scale_by_adam",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_param_block_rms",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "scatter_to",
    "seeded",
    "sequence_logps",
    "sgd",
    "sgdr_schedule",
    "shard",
    "simulated_mesh",
    "tensor_parallel",
    "tensor_peak",
    "trace",
    "track_memory",
    "train_step",
    "tree_leaves",
    "tree_map",
    "visualize",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "warmup_cosine_decay_schedule",
    "zero_nans",
]


def __getattr__(name: str) -> object:
    """``ff.checkpoint`` loads on first use: it imports torch's distributed checkpointing
    (and DTensor), about a second that the planner's command line does not need."""
    if name == "checkpoint":
        import importlib

        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
