"""Adapters and quantization as the model sees them: the LoRA adapter to trace (``LoraSpec``)
and the linears bitsandbytes replaces (``quantizable_linears``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoraSpec:
    """The LoRA adapter to trace (from a peft LoraConfig or a peft model)."""

    peft_config: Any                   # peft.LoraConfig
    quantized_4bit: bool = False       # QLoRA: base weights NF4 (traced with SimLinear4bit)
    compute_dtype: torch.dtype = torch.bfloat16  # bnb_4bit_compute_dtype


def quantizable_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The nn.Linear modules bitsandbytes replaces: all but the output head and adapters."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear and mod is not head and "lora_" not in name and \
                not name.endswith(("lm_head", "classifier", "score", "qa_outputs")):
            out.append((name, mod))
    return out
