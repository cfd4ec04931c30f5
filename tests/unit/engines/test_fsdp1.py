"""FSDP1 (``fsdp_config={"version": 1}``), as accelerate 1.15 prepares it, against hand counts
from torch's FSDP1 code (issue 44).

* ``_post_forward_reshard`` (torch/distributed/fsdp/_runtime_utils.py) does not free the root
  unit's parameters after the forward; with accelerate's ``TRANSFORMER_BASED_WRAP`` the root holds
  every parameter in no decoder layer: the embedding, the final norm and the head. FSDP2 as
  accelerate applies it (``fsdp2_prepare_model``) makes the embedding a unit of its own, freed
  after its forward, and keeps only [norm, head] gathered.
* accelerate's upcast under mixed precision (``Accelerator.prepare_model``) is per
  ``FlatParameter`` that requires grad. Through the Trainer with PEFT, transformers'
  ``update_fsdp_plugin_peft`` sets peft's ``fsdp_auto_wrap_policy``: every leaf module whose weight
  trains (LoRA's A and B) is a unit of its own, so a layer's FlatParameter holds only frozen base
  weights and stays in bf16.
"""

from __future__ import annotations

import warnings

import pytest
from peft import LoraConfig

import hf_memkit as mk

V, H = 128256, 4096                   # Llama-3.1-8B: vocabulary, hidden size


def _est(version, **kw):
    args = {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True,
            "fsdp": "full_shard", "fsdp_config": {"version": version}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory("Llama-3.1-8B", args, seq_len=2048, device="H100-80GB",
                                  num_gpus=8, **kw)


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp1_keeps_the_embedding_gathered_through_the_forward(lora):
    kw = {"peft_config": LoraConfig(r=16, target_modules="all-linear")} if lora else {}
    one, two = _est(1, **kw), _est(2, **kw)
    assert one.setup.sharding.label().startswith("FSDP1 full shard x8")
    # the root unit beyond FSDP2's gathered tail: the bf16 embedding and the final norm
    assert one.phase_peaks["forward"] - two.phase_peaks["forward"] == 2 * (V * H + H)
    assert any("FSDP1" in n and "root unit" in n for n in one.notes)


def test_fsdp1_with_lora_does_not_upcast_the_frozen_base():
    """The issue's case (8B LoRA on 8 ranks): the model states are FSDP2's, bf16 base shards;
    an upcast base would add 2 B of each of its 8.03B parameters / 8 ranks (1.87 GiB)."""
    kw = {"peft_config": LoraConfig(r=16, target_modules="all-linear")}
    assert _est(1, **kw).model_states == _est(2, **kw).model_states
