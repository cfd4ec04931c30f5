"""Sequence-to-sequence language modelling: labels of the target length."""

from .base import Task, long_zeros, register

register(Task("seq2seq-lm", "AutoModelForSeq2SeqLM",
              labels=lambda b, s, t: {"labels": long_zeros(b, t)},
              arch_suffixes=("ForConditionalGeneration",), encoder_decoder_only=True,
              peft_task_type="SEQ_2_SEQ_LM", vocab_logits=True), "seq2seq")
