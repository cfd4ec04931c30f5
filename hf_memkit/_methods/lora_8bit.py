"""LoRA on an LLM.int8 base (bitsandbytes 8-bit): int8 matmuls with outlier decomposition. No
throughput figure in the published GPU anchors (docs/anchors.md); assumed between LoRA and QLoRA
(0.8x LoRA) so the ladder orders them by memory."""

from __future__ import annotations

from typing import Any

from .base import KbitLora, register


class Lora8bit(KbitLora):
    name = "lora-8bit"
    slowdown = 1 / 0.8
    quant_bits = 8
    note = ("LoRA on an 8-bit (LLM.int8) base: activations are traced with the base as frozen "
            "linears; the int8 kernels' own temporaries are not modelled")

    def quantization_config(self, dev: Any) -> Any:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True)


register(Lora8bit())
