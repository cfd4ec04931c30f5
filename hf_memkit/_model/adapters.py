"""Adapters and quantization as the model sees them: the LoRA adapter to trace (``LoraSpec``)
and the linears bitsandbytes replaces (``quantizable_linears``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoraSpec:
    """The LoRA adapter to trace (from a peft LoraConfig or a peft model)."""

    peft_config: Any                   # peft.LoraConfig
    quantized_4bit: bool = False       # QLoRA: base weights NF4 (traced with SimLinear4bit)
    compute_dtype: torch.dtype = torch.bfloat16  # bnb_4bit_compute_dtype
    # the dtype the trainable adapter weights train in; None: what peft gives them (fp32 on a
    # 16-bit base, autocast_adapter_dtype). TRL casts a quantized model's to bf16.
    adapter_dtype: torch.dtype | None = None


def lora_identity(lora: LoraSpec | None) -> str | None:
    """The adapter as text that is the same in every process (the config's sets sorted, unlike
    its ``repr``): what trace keys hold (``ModelSpec.trace_identity``)."""
    if lora is None:
        return None
    cfg = lora.peft_config
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    return json.dumps({"config": d, "quantized_4bit": lora.quantized_4bit,
                       "compute_dtype": str(lora.compute_dtype),
                       "adapter_dtype": str(lora.adapter_dtype)}, sort_keys=True, default=_plain)


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return repr(value)


def cast_adapters(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Cast the trainable parameters of a peft model to ``dtype``, as TRL's trainers do for a
    quantized base (``SFTTrainer.__init__``: every ``requires_grad`` parameter but DoRA's
    magnitude vector). Works on meta tensors."""
    if dtype is None:
        return
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point() and "lora_magnitude_vector" not in name:
            p.data = p.data.to(dtype)


def adapter_dtype_of(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a peft model's trainable LoRA weights have (None: it has none)."""
    for name, p in model.named_parameters():
        if p.requires_grad and "lora_" in name and "lora_magnitude_vector" not in name:
            return p.dtype
    return None


def quantizable_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The nn.Linear modules bitsandbytes replaces: all but the output head and adapters."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear and mod is not head and "lora_" not in name and \
                not name.endswith(("lm_head", "classifier", "score", "qa_outputs")):
            out.append((name, mod))
    return out
