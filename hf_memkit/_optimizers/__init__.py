"""Optimizer memory and facts, one registered ``OptimizerProfile`` per ``TrainingArguments.optim``
value (STYLE.md §2). A new optimizer is one ``register(OptimizerProfile(...))`` in one file here,
imported below."""

from . import adafactor, adagrad, adamw_torch, bnb, rmsprop, sgd  # noqa: F401  (registers)
from .base import (
    OptimizerContext,
    OptimizerMemory,
    OptimizerProfile,
    ParamInfo,
    get_optimizer_profile,
    planner_optimizers,
    register,
    supported_optimizers,
    trainer_groups,
)

__all__ = ["OptimizerContext", "OptimizerMemory", "OptimizerProfile", "ParamInfo",
           "get_optimizer_profile", "planner_optimizers", "register", "supported_optimizers",
           "trainer_groups"]
