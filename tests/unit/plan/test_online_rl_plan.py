"""Plans for TRL's GRPOTrainer / RLOOTrainer (issue 26): whole generation groups, vLLM's share
of a colocated GPU chosen from its KV demand, sleep mode when the trainer needs the room, and
the plan applied onto a user's GRPOConfig."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import trl  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._errors import ConfigError, HfMemkitError  # noqa: E402

SMALL = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
COLOCATED = dict(trainer="grpo", use_vllm=True, max_completion_length=512, num_generations=8,
                 device="RTX-4090")


def _plan(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(SMALL, **kw)


def test_a_target_that_splits_a_generation_group_is_refused_with_the_nearest_valid():
    with pytest.raises(ConfigError) as exc:
        _plan(seq_len=64, target_batch_size=12, device="cpu", trainer="grpo", num_generations=8)
    msg = str(exc.value)
    assert "num_generations=8" in msg and "nearest valid targets: 8, 16" in msg


def test_vllm_gets_the_smallest_share_that_holds_its_kv_demand():
    plan = _plan(seq_len=256, target_batch_size=16, **COLOCATED)
    share = plan.training_args_kwargs["vllm_gpu_memory_utilization"]
    total = mk.get_device("RTX-4090").total_memory
    # the demand by hand: 16 sequences x (256 + 512) tokens, K and V of 8 layers x 8 heads x
    # 128 dims in bf16, beside vLLM's bf16 copy of the weights
    params = mk.profile_model(SMALL).total_params
    demand = 16 * (256 + 512) * 2 * 8 * 8 * 128 * 2
    assert share * total >= 2 * params + demand
    assert (share - 0.05) * total < 2 * params + demand + 512 * 2**20  # + activations, graphs
    assert plan.estimate.breakdown["vllm"] <= share * total
    assert any(n.startswith(f"vLLM's share {share:.2f}") for n in plan.notes)


def test_sleep_mode_is_turned_on_when_the_trainer_needs_the_room():
    # the share is of the total CUDA reports (cudaMemGetInfo, 23.61 GiB on a 4090), not NVML's
    pinned = dict(seq_len=256, target_batch_size=16, method="full", optim="adamw_torch",
                  per_device_train_batch_size=16, activation_checkpointing=False, **COLOCATED)
    awake = _plan(vllm_gpu_memory_utilization=0.5, **pinned)
    assert not awake.training_args_kwargs.get("vllm_enable_sleep_mode")
    plan = _plan(vllm_gpu_memory_utilization=0.72, **pinned)
    assert plan.training_args_kwargs["vllm_enable_sleep_mode"] is True
    assert any(n.startswith("vllm_enable_sleep_mode=True") for n in plan.notes)
    assert plan.estimate.fits
    with pytest.raises(HfMemkitError, match="server mode"):
        _plan(vllm_gpu_memory_utilization=0.72, vllm_enable_sleep_mode=False, **pinned)


def test_the_plan_applies_onto_a_users_grpo_config():
    """GRPOConfig derives generation_batch_size and steps_per_generation from each other and
    refuses both: the applied config derives them again from the planned batch."""
    plan = _plan(seq_len=64, target_batch_size=8, device="cpu", trainer="grpo",
                 num_generations=4, max_completion_length=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], beta=0.04,
                              num_generations=4, max_completion_length=64)
        args = plan.apply_to(mine)
    kw = plan.training_args_kwargs
    assert type(args) is trl.GRPOConfig and args.beta == 0.04
    assert args.per_device_train_batch_size == kw["per_device_train_batch_size"]
    assert args.steps_per_generation == kw["gradient_accumulation_steps"]
    assert args.generation_batch_size == 8


def test_a_share_vllm_cannot_start_with_is_refused_naming_the_largest_that_can():
    """vLLM starts only if the free memory, after the policy and the CUDA context, holds its
    share of the card (request_memory): 0.97 of an RTX 4090 cannot be free beside any policy."""
    with pytest.raises(ConfigError) as exc:
        _plan(seq_len=256, target_batch_size=16, vllm_gpu_memory_utilization=0.97, **COLOCATED)
    msg = str(exc.value)
    assert "vllm_gpu_memory_utilization=0.97" in msg and "refuses to start" in msg
    most = float(msg.split("use at most ")[1].split(",")[0])
    total = mk.get_device("RTX-4090").total_memory
    params = mk.profile_model(SMALL).total_params
    assert most * total + params * 0.5 < total            # the share it names can start
