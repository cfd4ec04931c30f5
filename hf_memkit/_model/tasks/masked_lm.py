"""Masked language modelling: a label per token."""

from typing import Any

from .base import Task, long_zeros, register


class MaskedLM(Task):
    name = "masked-lm"
    auto_class = "AutoModelForMaskedLM"
    arch_suffixes = ("ForMaskedLM",)
    vocab_logits = True

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        return {"labels": long_zeros(batch, seq_len)}


register(MaskedLM(), "mlm")
