"""The bare model without a head (``AutoModel``): no labels, no loss."""

from typing import Any

from .base import Task, register


class BaseModel(Task):
    name = "base"
    auto_class = "AutoModel"

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        return {}


register(BaseModel())
