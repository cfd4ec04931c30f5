"""LoRA on an LLM.int8 base (bitsandbytes 8-bit): int8 matmuls with outlier decomposition.
Slower than QLoRA and larger, so it comes after it on the ladder. No like-for-like table is
published; user reports on the same GPU and model measure 2-3x LoRA's time on a 16-bit base
(bitsandbytes issue #465, A5000, 7B: int8 2-3x, NF4 1.2-2x; Alpaca-CoT issue #26: "more than
2x"), and ms-swift's benchmark gives a GPTQ int8 base 2.19x (A100, Qwen-7B). The factor, 2.2,
is that band's low end; the plan says it is from reports (``note``). bitsandbytes issue #538
reported LLM.int8 unsupported on Hopper GPUs (2024)."""

from __future__ import annotations

from typing import Any

from .base import KbitLora, register


class Lora8bit(KbitLora):
    name = "lora-8bit"
    slowdown = 2.2
    quant_bits = 8
    note = ("LoRA on an 8-bit (LLM.int8) base: activations are traced with the base as frozen "
            "linears; the int8 kernels' own temporaries are not modelled. Its speed (2.2x LoRA's "
            "step time) is from user reports, not a published benchmark table")

    def quantization_config(self, dev: Any) -> Any:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True)


register(Lora8bit())
