"""Sequence classification: one label per sequence."""

from .base import Task, long_zeros, register

register(Task("sequence-classification", "AutoModelForSequenceClassification",
              labels=lambda b, s, t: {"labels": long_zeros(b)},
              arch_suffixes=("ForSequenceClassification",), peft_task_type="SEQ_CLS",
              trainable_by_cli=True), "seq-cls", "classification")
