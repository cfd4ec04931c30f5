"""The model: where its config comes from (``catalog``), what it is (``profile``), its heads
(``tasks``), its layer structure (``facts``) and the estimator's view of it (``spec``)."""

from .catalog import list_models, load_bundled_config, resolve_config
from .facts import ModelFacts, model_facts
from .profile import (
    ModelProfile,
    architecture_facts,
    build_model,
    logical_numel,
    profile_model,
    to_config,
    unwrap_model,
)
from .tasks import TASKS, auto_class, normalize_task, task_of_class

__all__ = ["TASKS", "ModelFacts", "ModelProfile", "architecture_facts", "auto_class",
           "build_model", "list_models", "load_bundled_config", "logical_numel", "model_facts",
           "normalize_task", "profile_model", "resolve_config", "task_of_class", "to_config",
           "unwrap_model"]
