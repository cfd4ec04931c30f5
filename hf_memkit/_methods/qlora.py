"""QLoRA: LoRA on a 4-bit NF4 base with double quantization (Dettmers et al. 2023). Every base
weight is dequantised in forward and backward, so a step takes longer than LoRA's on a 16-bit
base. Measured, same GPU, model and data (docs/fitting.md, speed factors): LitGPT's resource
table (A100-40GB, bitsandbytes, bf16, micro-batch 1; Lightning-AI/litgpt
tutorials/resource-tables.md) Llama-2-7B 2.36 -> 3.68 min per 1k iterations (1.56x), 13B 2.0x;
Raschka, "Practical Tips for Finetuning LLMs Using LoRA" (A100, Llama-2-7B) 1.85 h -> 2.79 h
(1.51x); ms-swift's benchmark (A100, Qwen-7B, 2048 tokens) 4.31 -> 2.41 samples/s (1.79x). The
factor is their median, 1.56; longer sequences shrink it (attention is not dequantised)."""

from __future__ import annotations

from typing import Any

from .base import KbitLora, half_dtype, register


class QLora(KbitLora):
    name = "qlora"
    selected_by = ("auto", "qlora")
    slowdown = 1.56
    quant_bits = 4
    float_storage = False  # pack the 4-bit weights in the 16-bit dtype (FSDP-QLoRA)

    def quantization_config(self, dev: Any) -> Any:
        from transformers import BitsAndBytesConfig

        storage = {"bnb_4bit_quant_storage": half_dtype(dev)} if self.float_storage else {}
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=half_dtype(dev), **storage)


register(QLora())
