"""QLoRA: LoRA on a 4-bit NF4 base with double quantization (Dettmers et al. 2023). Every base
weight is dequantised in forward and backward: measured QLoRA throughput is ~0.7x LoRA's."""

from __future__ import annotations

from typing import Any

from .base import KbitLora, half_dtype, register


class QLora(KbitLora):
    name = "qlora"
    selected_by = ("auto", "qlora")
    slowdown = 1 / 0.7
    quant_bits = 4
    float_storage = False  # pack the 4-bit weights in the 16-bit dtype (FSDP-QLoRA)

    def quantization_config(self, dev: Any) -> Any:
        from transformers import BitsAndBytesConfig

        storage = {"bnb_4bit_quant_storage": half_dtype(dev)} if self.float_storage else {}
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=half_dtype(dev), **storage)


register(QLora())
