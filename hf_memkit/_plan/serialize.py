"""JSON forms of what a ``Plan`` holds: the model reference, load kwargs and LoRA config."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch


def model_ref_to_json(ref: Any) -> Any:
    if isinstance(ref, str):
        return ref
    return {"config": ref.to_dict()}


def model_ref_from_json(ref: Any) -> Any:
    if isinstance(ref, str):
        return ref
    from transformers import AutoConfig

    d = dict(ref["config"])
    return AutoConfig.for_model(d.pop("model_type"), **d)


def model_kwargs_to_json(mk: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in mk.items():
        if isinstance(v, torch.dtype):
            out[k] = str(v).replace("torch.", "")
        elif k == "quantization_config" and v is not None:
            out[k] = v.to_dict() if hasattr(v, "to_dict") else dict(v)
        else:
            out[k] = v
    return out


def model_kwargs_from_json(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    if isinstance(out.get("dtype"), str):
        out["dtype"] = getattr(torch, out["dtype"])
    if out.get("quantization_config"):
        from transformers import BitsAndBytesConfig

        out["quantization_config"] = BitsAndBytesConfig.from_dict(out["quantization_config"])
    return out


def peft_to_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    d = cfg.to_dict()
    return json.loads(json.dumps(d, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def peft_from_dict(d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    import peft

    return peft.LoraConfig(**{k: v for k, v in d.items() if k in
                              {f.name for f in dataclasses.fields(peft.LoraConfig)} and
                              k not in ("peft_type", "auto_mapping", "revision")})


def estimate_kwargs(model_kwargs: dict[str, Any], peft_config: Any) -> dict[str, Any]:
    """``estimate_memory`` kwargs that reproduce a plan's model. A k-bit base loads in half
    precision, then prepare_model_for_kbit_training upcasts every non-quantized parameter to
    fp32: the estimate takes the trained dtype (None = fp32)."""
    quant = model_kwargs.get("quantization_config")
    return {"dtype": None if quant is not None else model_kwargs.get("dtype"),
            "attn_implementation": model_kwargs.get("attn_implementation"),
            "quantization_config": quant, "peft_config": peft_config}
