"""Optimizer memory and facts, one registered ``OptimizerProfile`` per ``TrainingArguments.optim``
value (docs/style.md §2). A new optimizer is one ``register(OptimizerProfile(...))`` in one file
here, imported below; docs/extending.md says what else it touches (nothing).

Imports the ground floor only (``_errors``, ``_compat``, ``_registry``).
"""

from . import (  # noqa: F401  (each module registers its optimizers)
    adafactor,
    adagrad,
    adamw_torch,
    apollo,
    bnb,
    galore,
    grokadamw,
    lomo,
    rmsprop,
    schedulefree,
    sgd,
    stable_adamw,
    torchao,
)
from .base import (
    OPTIMIZERS,
    TARGET_MODULES_ARG,
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

__all__ = ["OPTIMIZERS", "TARGET_MODULES_ARG", "OptimizerContext", "OptimizerMemory", "OptimizerProfile", "ParamInfo",
           "get_optimizer_profile", "planner_optimizers", "register", "supported_optimizers",
           "trainer_groups"]
