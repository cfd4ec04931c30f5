"""Masked language modelling: a label per token."""

from .base import Task, long_zeros, register

register(Task("masked-lm", "AutoModelForMaskedLM",
              labels=lambda b, s, t: {"labels": long_zeros(b, s)},
              arch_suffixes=("ForMaskedLM",), vocab_logits=True), "mlm")
