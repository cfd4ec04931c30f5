"""Extractive question answering: start and end positions."""

from .base import Task, long_zeros, register

register(Task("question-answering", "AutoModelForQuestionAnswering",
              labels=lambda b, s, t: {"start_positions": long_zeros(b),
                                      "end_positions": long_zeros(b)},
              arch_suffixes=("ForQuestionAnswering",), peft_task_type="QUESTION_ANS"), "qa")
