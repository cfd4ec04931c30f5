"""Token classification: a label per token."""

from .base import Task, long_zeros, register

register(Task("token-classification", "AutoModelForTokenClassification",
              labels=lambda b, s, t: {"labels": long_zeros(b, s)},
              arch_suffixes=("ForTokenClassification",), peft_task_type="TOKEN_CLS"),
         "token-cls")
