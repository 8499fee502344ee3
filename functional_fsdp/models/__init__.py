"""Reference models for examples, tests and benchmarks, with their tensor-parallel plans."""

from .gpt import GPT as GPT
from .gpt import MLP as MLP
from .gpt import Attention as Attention
from .gpt import Block as Block
from .gpt import GPTConfig as GPTConfig
from .gpt import MLPModel as MLPModel
from .gpt import gpt_plan as gpt_plan
from .gpt import lm_loss as lm_loss
from .llama import llama_plan as llama_plan

__all__ = [
    "GPT",
    "MLP",
    "Attention",
    "Block",
    "GPTConfig",
    "MLPModel",
    "gpt_plan",
    "llama_plan",
    "lm_loss",
]
