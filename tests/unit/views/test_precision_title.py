"""The breakdown's title names the precision the step really trains in: the autocast dtype and
the dtype of the trained weights (their gradients and the optimizer's master copy), read from
the real model built as the run builds it; pure bf16 is never called "fp32"."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_memkit as mk
from hf_memkit._compat import quiet_peft
from hf_memkit._views.text import estimate_title

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _real_trained_dtype(dtype: torch.dtype, lora: bool) -> torch.dtype:
    """The first trainable parameter's dtype of the real model, loaded in ``dtype`` (and wrapped
    by peft with ``lora``), as the Trainer receives it."""
    model = AutoModelForCausalLM.from_config(TINY, dtype=dtype)
    if lora:
        with quiet_peft():
            model = get_peft_model(model, LoraConfig(**LORA))
    return next(p.dtype for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("dtype, fields, lora, words", [
    ("float32", {"bf16": True}, False, "bf16 autocast over fp32 trained weights"),
    ("bfloat16", {}, False, "pure bf16 (no fp32 master weights)"),
    ("bfloat16", {"bf16": True}, True, "bf16 autocast over fp32 trained weights"),
])
def test_title_names_the_trained_weights_dtype(dtype, fields, lora, words):
    real = _real_trained_dtype(getattr(torch, dtype), lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = mk.estimate_memory(TINY, {"per_device_train_batch_size": 1, **fields}, seq_len=64,
                                 device="A100-80GB", dtype=dtype,
                                 peft_config=LoraConfig(**LORA) if lora else None)
    assert est.trained_dtype == str(real).removeprefix("torch.")
    title = estimate_title(est)
    assert words in title, title
    if not fields:   # no autocast: the old title said "fp32" for bf16 weights
        assert "fp32," not in title
    assert mk.MemoryEstimate.from_dict(est.to_dict()).trained_dtype == est.trained_dtype
