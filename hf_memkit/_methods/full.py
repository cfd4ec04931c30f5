"""Full fine-tuning: every weight trains (fp32 master weights, or pure bf16)."""

from .base import Method, register

register(Method())
