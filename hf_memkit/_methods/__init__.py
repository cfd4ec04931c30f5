"""Fine-tuning methods, one registered ``Method`` per file; import order is the ladder.

Why the ladder runs full fine-tuning first and LoRA only as a fallback:
docs/fitting.md#methods-rungs-and-offload; what a new method touches: docs/extending.md.
Imports the ground floor and ``_model``.
"""

# isort: off
from . import full, lora, qlora, qlora_fsdp, lora_8bit  # noqa: F401  (registers, in ladder order)
# isort: on
from .base import LORA_DEFAULTS, METHODS, Method, ladder, method_choices, register

__all__ = ["LORA_DEFAULTS", "METHODS", "Method", "ladder", "method_choices", "register"]
