"""A colocated vLLM's start-up beside a sharded policy (issue 44, item 4).

TRL 1.16 builds vLLM in ``GRPOTrainer.__init__`` (``VLLMGeneration(...)``), after
``Trainer.__init__`` and before ``accelerator.prepare``. What of the policy is on the GPU then:
  * transformers ``Trainer.__init__`` moves the model to the device only when
    ``place_model_on_device``, which is False under DeepSpeed or FSDP (``trainer.py``:
    ``is_deepspeed_enabled ... or self.is_fsdp_enabled``): on one process or under DDP the whole
    policy is there, under FSDP and DeepSpeed ZeRO-1/2 none of it (it is on the host until
    ``accelerator.prepare``);
  * under ZeRO-3, ``from_pretrained`` ran inside ``deepspeed.zero.Init``, which partitioned every
    parameter as it loaded onto ``remote_device``: the accelerator, unless the config offloads
    the parameters (``partition_parameters.py``: ``Init.__init__``, ``remote_device =
    offload_param.device``): 1/N of it a rank, or none.
vLLM then requests ``ceil(total_memory x gpu_memory_utilization)`` of the free memory, both from
``torch.cuda.mem_get_info`` (``vllm/v1/worker/utils.py``: ``request_memory``, on
``MemorySnapshot``): the total CUDA hands out, not NVML's.
"""

from __future__ import annotations

import math
import warnings

import pytest

from tests.helpers import require

require("trl")

import torch  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._engines import ENGINES, Sharding  # noqa: E402
from hf_memkit._units import format_bytes  # noqa: E402

ZERO3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


@pytest.mark.parametrize("engine,stage,offload,ranks,fraction", [
    ("none", 0, False, 1, 1.0),         # Trainer.__init__: _move_model_to_device
    ("ddp", 0, False, 8, 1.0),
    ("fsdp", 3, False, 8, 0.0),         # place_model_on_device False: on the host
    ("fsdp", 2, False, 8, 0.0),
    ("deepspeed", 2, False, 8, 0.0),    # no zero.Init: on the host until prepare
    ("deepspeed", 3, False, 8, 1 / 8),  # zero.Init: one partition on the accelerator
    ("deepspeed", 3, True, 8, 0.0),     # zero.Init onto offload_param's device, the host
])
def test_the_policy_on_the_device_when_trl_builds_vllm(engine, stage, offload, ranks, fraction):
    sh = Sharding(engine, ranks, stage, offload_params=offload)
    assert ENGINES.get(engine).resident_at_init_fraction(sh) == fraction


def test_vllm_starts_beside_a_70b_policy_zero3_partitioned_over_8_ranks():
    """Llama-3.1-70B in bf16 under ZeRO-3 on 8 H100s, vLLM TP=8 at 0.3: each rank holds 1/8 of
    the policy (16.4 GiB) when vLLM asks for 0.3 of the 79.11 GiB CUDA reports; the old rule
    charged the whole 131 GiB policy and refused a setup that starts."""
    args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, num_generations=8,
                max_completion_length=1024, use_vllm=True, vllm_tensor_parallel_size=8,
                vllm_gpu_memory_utilization=0.3, vllm_max_model_length=2048, bf16=True,
                gradient_checkpointing=True, deepspeed=ZERO3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory("Llama-3.1-70B", args, seq_len=512, device="H100-80GB",
                               trainer="grpo", num_gpus=8, dtype=torch.bfloat16)
    dev = mk.get_device("H100-80GB")
    # by hand, from request_memory and zero.Init
    total = dev.cuda_memory                              # cudaMemGetInfo's total (published)
    requested = math.ceil(total * 0.3)
    policy = mk.profile_model("Llama-3.1-70B").total_params * 2      # bf16, buffers aside
    on_rank = math.ceil(policy / 8)
    free = total - e.breakdown["context"] - on_rank
    assert free >= requested and policy > total          # starts; the whole policy would not
    assert not e.refusals, e.refusals
    note = next(n for n in e.notes if n.startswith("vLLM's start-up"))
    assert f"{format_bytes(requested)} requested (0.3 x {format_bytes(total)}" in note, note
    assert f"and {format_bytes(on_rank)} then: 1/8 of the policy" in note, note


def test_vllms_share_is_of_the_total_cuda_reports():
    """request_memory takes ceil(total x share) of cudaMemGetInfo's total: on an H100-80GB 0.3 x
    79.11 GiB (the catalog's published figure), not 0.3 x NVML's 79.65 GiB."""
    from transformers import LlamaConfig

    small = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
    dev = mk.get_device("H100-80GB")
    assert dev.cuda_memory < dev.total_memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(small, dict(per_device_train_batch_size=4, num_generations=4,
                                           max_completion_length=256, use_vllm=True,
                                           vllm_max_model_length=1024, bf16=True),
                               seq_len=128, device=dev, trainer="grpo", dtype=torch.bfloat16)
    share = math.ceil(dev.cuda_memory * 0.3)
    assert e.breakdown["vllm"] <= share     # within its share (less its profiling peak)
    assert any(f"{format_bytes(share)} requested" in n for n in e.notes)
