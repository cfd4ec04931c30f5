"""The model: where its config comes from (``catalog``, ``names``), what it is (``profile``), its
heads (``tasks``), its layer structure (``facts``), its adapters and quantized linears
(``adapters``), one rank's share under tensor parallelism (``tensor_parallel``) and the
estimator's view of it (``spec``).

``tasks`` needs neither torch nor transformers (the CLI's parsers read it), so the names of
``catalog``, ``facts`` and ``profile`` are imported on first use (PEP 562), never by importing
``hf_memkit._model.tasks``.

What a new task (head) or model family touches: docs/extending.md; why models are built from
bundled configs, never downloaded: docs/stack-facts.md#offline-models-and-data. Imports the
ground floor and ``_optimizers`` (``ParamInfo``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .tasks import TASKS, auto_class, normalize_task, task_of_class

_LAZY: dict[str, str] = {
    "list_models": ".catalog",
    "load_bundled_config": ".catalog",
    "resolve_config": ".catalog",
    "ModelFacts": ".facts",
    "model_facts": ".facts",
    "ModelProfile": ".profile",
    "architecture_facts": ".profile",
    "model_from_config": ".profile",
    "logical_numel": ".profile",
    "profile_model": ".profile",
    "to_config": ".profile",
    "unwrap_model": ".profile",
}

if TYPE_CHECKING:
    from .catalog import list_models, load_bundled_config, resolve_config
    from .facts import ModelFacts, model_facts
    from .profile import (
        ModelProfile,
        architecture_facts,
        logical_numel,
        model_from_config,
        profile_model,
        to_config,
        unwrap_model,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["TASKS", "ModelFacts", "ModelProfile", "architecture_facts", "auto_class",
           "model_from_config", "list_models", "load_bundled_config", "logical_numel", "model_facts",
           "normalize_task", "profile_model", "resolve_config", "task_of_class", "to_config",
           "unwrap_model"]
