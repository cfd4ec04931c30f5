"""Trainers whose step hf_memkit models, one registered ``TrainerKind`` per file (``base``):
``transformers.Trainer``, TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer`` and
``RLOOTrainer``."""

# isort: off
from . import trainer, sft, dpo, rl  # noqa: F401  (registers, in this order)
# isort: on
from .base import TRAINERS, BatchShape, TraceStep, TrainerKind, TrlTrainerKind, register
from .detect import trainer_of_args
from .trainer import TRAINER

__all__ = ["TRAINER", "TRAINERS", "BatchShape", "TraceStep", "TrainerKind", "TrlTrainerKind",
           "register", "trainer_of_args"]
