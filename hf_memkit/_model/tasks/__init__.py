"""Tasks (heads), one registered ``Task`` per file; import order is the order of inference."""

# isort: off
from . import (  # noqa: F401  (registers, in this order)
    causal_lm,
    seq2seq_lm,
    masked_lm,
    sequence_classification,
    token_classification,
    question_answering,
    base_model,
)
# isort: on
from .base import (
    TASKS,
    Task,
    auto_class,
    infer_task,
    normalize_task,
    register,
    task_choices,
    task_of_class,
)

__all__ = ["TASKS", "Task", "auto_class", "infer_task", "normalize_task", "register",
           "task_choices", "task_of_class"]
