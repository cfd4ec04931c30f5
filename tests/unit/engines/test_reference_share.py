"""DPO's reference model on each rank, as TRL prepares it (``trl/models/utils.py``), against
hand counts from the config:

* no sharding engine (one GPU, DDP): ``accelerator.prepare_model(evaluation_mode=True)``, a whole
  copy in its load dtype;
* DeepSpeed (``prepare_deepspeed``): ZeRO-3 initialises it as a ZeRO-3 engine without an optimizer,
  16-bit and partitioned, with TRL's persistence threshold (10 x hidden: the norms stay whole) and
  prefetch bucket (0.9 x hidden^2) for its forward's gathers; ZeRO-0/1/2: stage 0, a 16-bit
  replica;
* FSDP2 (``prepare_fsdp``): ``fully_shard`` on the root alone, so 1/N at rest and the whole model
  gathered (in the mixed-precision dtype) for its forward; without resharding after forward it
  stays gathered.
"""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._estimate.phases import reference_share
from hf_memkit._model.spec import resolve_model
from hf_memkit._setup.setup import normalize_args
from tests.helpers import require

CFG = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                  tie_word_embeddings=False, attention_dropout=0.0)
KiB = 1024
DPO = {"per_device_train_batch_size": 1, "max_length": 64, "bf16": True}


def _counts() -> tuple[int, int, int]:
    """(parameters, elements of the parameters at most 10 x hidden, largest module) by hand."""
    h, i, v, n = CFG.hidden_size, CFG.intermediate_size, CFG.vocab_size, CFG.num_hidden_layers
    kv = CFG.num_key_value_heads * (h // CFG.num_attention_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    norms = (2 * n + 1) * h                     # each h elements, under 10 x hidden
    return n * layer + h + 2 * v * h, norms, v * h


def _share(args: dict, world: int) -> tuple[int, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        setup = normalize_args({**DPO, **args}, num_gpus=world, trainer="dpo")
    return reference_share(resolve_model(CFG), setup)


def _zero(stage: int, world: int) -> dict:
    return {"deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
                          "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                          "train_batch_size": world}}


@pytest.fixture(autouse=True)
def _trl():
    require("trl")


def test_a_replica_without_a_sharding_engine():
    p, _, _ = _counts()
    for world in (1, 8):
        held, gathered = _share({}, world)
        assert held == pytest.approx(4 * p, abs=KiB) and gathered == 0   # fp32, as loaded


def test_zero3_partitions_the_reference():
    p, persistent, largest = _counts()
    held, gathered = _share(_zero(3, 8), 8)
    # 16-bit partitions of everything, plus the persistent norms whole
    assert held == pytest.approx(2 * p / 8 + 2 * persistent, abs=KiB)
    # its forward: the largest module (an embedding) + TRL's prefetch bucket, in 16-bit
    assert gathered == pytest.approx(2 * (largest + 0.9 * CFG.hidden_size ** 2), abs=KiB)
    # ZeRO-2: TRL sets the reference's stage to 0, a 16-bit replica
    held2, gathered2 = _share(_zero(2, 8), 8)
    assert held2 == pytest.approx(2 * p, abs=KiB) and gathered2 == 0


def test_fsdp2_shards_the_reference_as_one_unit():
    p, _, _ = _counts()
    full = {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}}
    held, gathered = _share(full, 8)
    assert held == pytest.approx(4 * p / 8, abs=KiB)       # fp32 shards: no upcast, frozen
    assert gathered == pytest.approx(2 * p, abs=KiB)       # all of it, bf16 (param_dtype)
    grad_op = {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": False}}
    held_op, gathered_op = _share(grad_op, 8)
    assert held_op == pytest.approx(4 * p / 8 + 2 * p, abs=KiB) and gathered_op == 0


def test_the_estimate_holds_the_share_and_says_so():
    p, _, _ = _counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = mk.estimate_memory(CFG, DPO, device="A100-80GB", num_gpus=8, trainer="dpo")
        z3 = mk.estimate_memory(CFG, {**DPO, **_zero(3, 8)}, device="A100-80GB", num_gpus=8,
                                trainer="dpo")
    assert any("reference model" in n and "gathered for its forward" in n for n in z3.notes)
    assert not any("gathered for its forward" in n for n in ddp.notes)
    # DDP holds the whole fp32 copy: at least that much over the policy's replica states
    assert ddp.breakdown["weights"] >= 4 * p + 4 * p
