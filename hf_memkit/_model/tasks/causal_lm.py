"""Causal language modelling: labels are the input ids (the model shifts them)."""

from typing import Any

from .base import Task, long_zeros, register


class CausalLM(Task):
    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    arch_suffixes = ("ForCausalLM", "LMHeadModel")
    peft_task_type = "CAUSAL_LM"
    vocab_logits = True
    trainable_by_cli = True

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        return {"labels": long_zeros(batch, seq_len)}


register(CausalLM(), "clm")
