"""Sequence-to-sequence language modelling: labels of the target length."""

from typing import Any

from .base import Task, long_zeros, register


class Seq2SeqLM(Task):
    name = "seq2seq-lm"
    auto_class = "AutoModelForSeq2SeqLM"
    arch_suffixes = ("ForConditionalGeneration",)
    encoder_decoder_only = True
    peft_task_type = "SEQ_2_SEQ_LM"
    vocab_logits = True

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        return {"labels": long_zeros(batch, target_len)}


register(Seq2SeqLM(), "seq2seq")
