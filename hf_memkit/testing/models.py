"""The models and data a ground-truth spec describes, built for real (random init, LoRA/QLoRA
applied as users apply them), shared by every harness in ``hf_memkit.testing``."""

from __future__ import annotations

from typing import Any


def spec_model(spec: dict[str, Any], workdir: str):
    """The model of a spec, built for real (random init), LoRA/QLoRA applied as users do."""
    import torch
    import transformers

    from .._model.tasks import TASKS

    cfg_dict = dict(spec["config"])
    config = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    auto = getattr(transformers, TASKS.get(spec.get("task", "causal-lm")).auto_class)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    attn = spec.get("attn_implementation")
    kw = {"attn_implementation": attn} if attn else {}
    torch.manual_seed(0)
    if spec.get("quantization"):
        from .._model.profile import load_quantized

        q = dict(spec["quantization"])
        if "bnb_4bit_compute_dtype" in q:
            q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
        model = load_quantized(auto, config, transformers.BitsAndBytesConfig(**q), workdir,
                               dtype=dtype, **kw)
    else:
        model = auto.from_config(config, dtype=dtype, **kw)
    if spec.get("lora"):
        import peft

        if spec.get("quantization"):
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=bool(spec["args"].get("gradient_checkpointing")
                                                       or spec["args"].get(
                                                           "activation_checkpointing")))
        model = peft.get_peft_model(model, peft.LoraConfig(**spec["lora"]))
    return model


def synthetic_examples(spec: dict[str, Any], config: Any, n: int, *,
                       seed: int = 1) -> list[dict[str, Any]]:
    """``n`` random-token examples of ``spec``'s ``seq_len`` with the labels its ``task`` needs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    task, s = spec.get("task", "causal-lm"), spec["seq_len"]
    vocab = config.get_text_config().vocab_size
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (s,), generator=g)
        ex = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if task in ("causal-lm", "masked-lm", "token-classification"):
            ex["labels"] = ids.clone()
        elif task == "seq2seq-lm":
            ex["labels"] = torch.randint(0, vocab, (spec.get("target_len") or s,), generator=g)
        elif task == "sequence-classification":
            ex["labels"] = torch.tensor(0)
        out.append(ex)
    return out
