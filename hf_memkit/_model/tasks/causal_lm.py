"""Causal language modelling: labels are the input ids (the model shifts them)."""

from .base import Task, long_zeros, register

register(Task("causal-lm", "AutoModelForCausalLM",
              labels=lambda b, s, t: {"labels": long_zeros(b, s)},
              arch_suffixes=("ForCausalLM", "LMHeadModel"), peft_task_type="CAUSAL_LM",
              vocab_logits=True, trainable_by_cli=True), "clm")
