"""Extractive question answering: start and end positions."""

from typing import Any

from .base import Task, long_zeros, register


class QuestionAnswering(Task):
    name = "question-answering"
    auto_class = "AutoModelForQuestionAnswering"
    arch_suffixes = ("ForQuestionAnswering",)
    peft_task_type = "QUESTION_ANS"

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        return {"start_positions": long_zeros(batch), "end_positions": long_zeros(batch)}


register(QuestionAnswering(), "qa")
