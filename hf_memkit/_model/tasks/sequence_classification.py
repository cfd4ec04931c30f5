"""Sequence classification: one label per sequence, as the config's ``problem_type`` makes the
model's loss read it (``*ForSequenceClassification.forward``): a class index (cross-entropy), one
float per sequence (regression: ``num_labels == 1``), or one float per label
(``multi_label_classification``: BCE with logits)."""

from typing import Any

from .base import Task, long_zeros, register


def _labels(config: Any, b: int, s: int, t: int) -> dict[str, Any]:
    import torch

    kind, n = getattr(config, "problem_type", None), getattr(config, "num_labels", 2)
    if kind == "multi_label_classification":
        return {"labels": torch.zeros(b, n)}
    if kind == "regression" or (kind is None and n == 1):
        return {"labels": torch.zeros(b)}
    return {"labels": long_zeros(b)}


register(Task("sequence-classification", "AutoModelForSequenceClassification",
              labels=lambda b, s, t: {"labels": long_zeros(b)}, config_labels=_labels,
              arch_suffixes=("ForSequenceClassification",), peft_task_type="SEQ_CLS",
              trainable_by_cli=True), "seq-cls", "classification")
