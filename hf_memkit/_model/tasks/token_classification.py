"""Token classification: a label per token."""

from typing import Any

from .base import Task, long_zeros, register


class TokenClassification(Task):
    name = "token-classification"
    auto_class = "AutoModelForTokenClassification"
    arch_suffixes = ("ForTokenClassification",)
    peft_task_type = "TOKEN_CLS"

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        return {"labels": long_zeros(batch, seq_len)}


register(TokenClassification(), "token-cls")
