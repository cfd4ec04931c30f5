"""LoRA on a 16-bit base (peft)."""

from .base import Lora, register

register(Lora())
