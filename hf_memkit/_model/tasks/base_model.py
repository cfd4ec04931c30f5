"""The bare model without a head (``AutoModel``): no labels, no loss."""

from .base import Task, register

register(Task("base", "AutoModel", labels=lambda b, s, t: {}))
