"""``transformers.Trainer``: the model's own loss from ``labels``, rows x seq_len tokens (the base
``TrainerKind`` as it is)."""

from .base import TrainerKind, register

TRAINER = register(TrainerKind())
