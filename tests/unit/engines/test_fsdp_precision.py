"""FSDP's precision rules and a sharded 4-bit base (issue #24), against hand counts made from the
config alone (never from the estimator's own parameter walk):

* accelerate (``fsdp2_prepare_model``; FSDP1: ``Accelerator.prepare_model``) upcasts every
  trainable parameter that is not fp32 to fp32 when mixed precision is on: a bf16-loaded model
  trained with ``bf16=True`` holds fp32 weight, gradient and AdamW shards, exactly as an
  fp32-loaded one; frozen parameters (a LoRA base) stay in their load dtype;
* DeepSpeed's optimizer steps fp32 master partitions whatever the load dtype;
* FSDP-QLoRA: a 4-bit base stored in bf16 shards with the rest, its absmax blocks do not; with
  uint8 storage accelerate leaves the packed weights out of FSDP2, whole on every rank.

The CPU ground truth of the upcast (two gloo ranks, accelerate's own FSDP2 preparation):
``tests/integration/test_distributed_ground_truth.py``.
"""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from tests.helpers import llama_counts, lora_count, qlora_hand_count, require

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0)
FSDP = {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}}
KiB = 1024


def est(model, args, **kw):
    kw.setdefault("seq_len", 64)
    kw.setdefault("device", "H100-80GB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(model, {"per_device_train_batch_size": 1, **args}, **kw)


@pytest.mark.parametrize("world", [2, 8])
def test_fsdp_upcasts_a_bf16_loaded_model_to_fp32_master_shards(world):
    p = llama_counts(TINY)["total"]
    args = {"bf16": True, **FSDP}
    bf16 = est(TINY, args, num_gpus=world, dtype="bfloat16")
    fp32 = est(TINY, args, num_gpus=world)
    # fp32 weights (4) + fp32 gradients (4) + AdamW exp_avg, exp_avg_sq (8) per parameter / N;
    # buffers (rotary inv_freq) and fused AdamW's step scalars are a few hundred bytes
    assert bf16.model_states == pytest.approx(16 * p / world, abs=2 * KiB)
    # loaded in bf16 or fp32, the ranks hold the same states and compute in bf16 alike
    assert bf16.model_states == fp32.model_states
    assert bf16.peak_allocated == fp32.peak_allocated
    assert any("upcasts" in n and f"{p:,}" in n for n in bf16.notes)
    assert not any("upcasts" in n for n in fp32.notes)


def test_without_mixed_precision_a_bf16_model_stays_bf16():
    p = llama_counts(TINY)["total"]
    pure = est(TINY, FSDP, num_gpus=2, dtype="bfloat16")
    # bf16 weights, gradients and AdamW moments (torch keeps the moments in the param dtype)
    assert pure.model_states == pytest.approx(8 * p / 2, abs=2 * KiB)


def test_frozen_lora_base_stays_in_its_load_dtype():
    require("peft")
    import peft

    k, a = llama_counts(TINY), lora_count(TINY, 8)
    lora = peft.LoraConfig(r=8, target_modules="all-linear")
    e = est(TINY, {"bf16": True, **FSDP}, num_gpus=2, dtype="bfloat16", peft_config=lora)
    # the bf16 base (2 B) sharded as it is; fp32 adapters (peft's), their gradients and AdamW
    expected = (2 * k["total"] + 4 * a) / 2 + 4 * a / 2 + 8 * a / 2
    assert e.model_states == pytest.approx(expected, abs=2 * KiB)


def test_deepspeed_steps_fp32_masters_of_a_bf16_loaded_model():
    require("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p = llama_counts(TINY)["total"]
    z2 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "train_batch_size": 8}
    _, ref = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=8, num_nodes=1,
                                                   cpu_offload=False)
    for dtype in (None, "bfloat16"):
        e = est(TINY, {"bf16": True, "deepspeed": z2}, num_gpus=8, dtype=dtype)
        assert e.model_states == pytest.approx(ref, rel=0.01)


# ---------------------------------------------------------------------------------------------
# FSDP-QLoRA: a sharded 4-bit base
# ---------------------------------------------------------------------------------------------

def _qlora(storage: str | None) -> dict:
    q = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": "bfloat16"}
    if storage:
        q["bnb_4bit_quant_storage"] = storage
    return q


def test_fsdp_qlora_shards_the_4bit_base_stored_in_bf16():
    require("peft")
    require("bitsandbytes")
    import peft

    cfg = mk.profile_model("Llama-3.1-70B").config
    lora = peft.LoraConfig(r=16, target_modules="all-linear")
    hand = qlora_hand_count(cfg, 16, 2)
    args = {"bf16": True, **FSDP}
    e = est("Llama-3.1-70B", args, num_gpus=2, dtype="bfloat16", peft_config=lora,
            quantization_config=_qlora("bfloat16"), device="RTX-4090")
    # the packed base, bf16 embeddings/norms and fp32 adapters sharded; the absmax blocks
    # (quant_state, not a parameter) whole; adapter gradients and AdamW moments sharded
    expected = hand["sharded"] + hand["constants"] + hand["states"] / 2
    assert e.model_states == pytest.approx(expected, abs=4 * KiB)
    assert 18 * 2**30 < e.model_states < 21 * 2**30           # ~20 GiB of a 70B per rank
    # a 4-bit base is never upcast: the adapters are fp32 already (peft)
    assert not any("upcasts" in n for n in e.notes)

    # default uint8 storage: accelerate leaves the packed weights out of FSDP2
    u8 = est("Llama-3.1-70B", args, num_gpus=2, dtype="bfloat16", peft_config=lora,
             quantization_config=_qlora(None), device="RTX-4090")
    whole = -(-(hand["rest"] + 4 * hand["adapters"]) // 2) + hand["packed"] + hand["constants"]
    assert u8.model_states == pytest.approx(whole + hand["states"] / 2, abs=4 * KiB)
    assert any("uint8" in n for n in u8.notes)
