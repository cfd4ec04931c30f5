"""Sequence classification: one label per sequence, as the config's ``problem_type`` makes the
model's loss read it (``*ForSequenceClassification.forward``): a class index (cross-entropy), one
float per sequence (regression: ``num_labels == 1``), or one float per label
(``multi_label_classification``: BCE with logits)."""

from typing import Any

from .base import Task, long_zeros, register


class SequenceClassification(Task):
    name = "sequence-classification"
    auto_class = "AutoModelForSequenceClassification"
    arch_suffixes = ("ForSequenceClassification",)
    peft_task_type = "SEQ_CLS"
    trainable_by_cli = True

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        import torch

        kind, n = getattr(config, "problem_type", None), getattr(config, "num_labels", 2)
        if kind == "multi_label_classification":
            return {"labels": torch.zeros(batch, n)}
        if kind == "regression" or (kind is None and n == 1):
            return {"labels": torch.zeros(batch)}
        return {"labels": long_zeros(batch)}


register(SequenceClassification(), "seq-cls", "classification")
