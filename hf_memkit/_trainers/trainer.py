"""``transformers.Trainer``: the model's own loss from ``labels``, rows x seq_len tokens."""

from .base import TrainerKind, register

register(TrainerKind("trainer", title="Trainer",
                     config_class="transformers.TrainingArguments"))
