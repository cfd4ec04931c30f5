"""ZeRO-1/2 with ``offload_optimizer`` in bf16: what DeepSpeed 0.19.8 keeps and makes on the GPU
for the host copy of the gradients, counted by hand from its code (issue 44).

The published run: deepseek-math-7b (LlamaForCausalLM, hidden 4096, 30 layers, vocabulary 102400,
untied head), ZeRO-2 + optimizer offload on 2 x RTX 4090, checkpointing, 1 x 512. It ran out of
memory at an allocation of 1.56 GiB: 102400 x 4096 x 4 B, one fp32 copy of the embedding's or the
head's gradient.

``DeepSpeedZeroOptimizer.__init__`` (deepspeed/runtime/zero/stage_1_and_2.py ~l.626-662) finds
``largest_param_numel`` over every parameter it trains and, with ``cpu_offload``, keeps
``temp_grad_buffer_for_gpu_offload = torch.zeros(largest_param_numel, dtype=self.dtype)`` on the
accelerator for the run. In the backward, ``copy_grads_in_partition`` (~l.2161-2178) takes each
reduced gradient's slice of this rank's partition (``grad_position``: at most the parameter,
at most the partition) and first ``set_norm_for_param_grad_in_gpu`` (~l.1886):
``accumulated_grad.data.to(get_norm_dtype()).norm(2)``, an fp64 copy on a device with fp64
(``zero/utils.py get_norm_dtype``), then ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``
(~l.1898): ``src_tensor.to(self.master_weights_and_grads_dtype)``, an fp32 copy, both on the GPU
and one after the other.
"""

from __future__ import annotations

import math
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memkit as mk
from hf_memkit._engines import Sharding, StateSizes
from hf_memkit._engines.deepspeed import DEEPSPEED_ENGINE
from hf_memkit._model.facts import model_facts

H, FF, LAYERS, VOCAB = 4096, 11008, 30, 102400
CONFIG = dict(hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
              num_attention_heads=32, num_key_value_heads=32, vocab_size=VOCAB,
              max_position_embeddings=4096, tie_word_embeddings=False,
              architectures=["LlamaForCausalLM"])
PER_LAYER = 4 * H * H + 3 * H * FF + 2 * H
TOTAL = 2 * VOCAB * H + LAYERS * PER_LAYER + H


def _states(offload: bool):
    with torch.device("meta"):
        facts = model_facts(LlamaForCausalLM(LlamaConfig(**CONFIG)))
    assert facts.total_params == TOTAL == 6_910_365_696     # deepseek-math-7b's 6.91B
    sizes = StateSizes(weight_bytes=2 * TOTAL, grad_bytes=2 * TOTAL, n_trainable=TOTAL,
                       optimizer_state=8 * TOTAL, optimizer_transient=0, load_itemsize=2)
    sh = Sharding("deepspeed", 2, 2, offload_optimizer=offload, mixed_precision=True,
                  reduce_bucket=int(5e8), allgather_bucket=int(5e8))
    return DEEPSPEED_ENGINE.rank_states(sh, sizes, facts, "cuda")


def test_offload_keeps_a_bf16_buffer_of_the_largest_parameter():
    largest = VOCAB * H                               # the embedding and the head, each
    extra = _states(offload=True).buckets - _states(offload=False).buckets
    assert extra == 2 * largest                       # temp_grad_buffer_for_gpu_offload


def test_offload_casts_the_largest_slice_to_fp64_then_fp32_in_the_backward():
    partition = math.ceil(TOTAL / 2)                  # the head's slice is the whole head
    slice_ = min(VOCAB * H, partition)
    assert 4 * slice_ == int(1.5625 * 2**30)          # the published failing allocation
    offload, resident = _states(offload=True), _states(offload=False)
    assert offload.grad_buffers - resident.grad_buffers == 8 * slice_   # the fp64 norm copy


def test_the_published_run_holds_them_in_its_backward():
    """The estimate of the published run: its backward holds the buffer and the fp64 copy on
    top of what the same run without them would (the bf16 weights, the reduce buckets)."""
    cfg = LlamaConfig(**CONFIG)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    args = {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True,
            "deepspeed": {"zero_optimization": zero, "bf16": {"enabled": True}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(cfg, args, seq_len=512, device="RTX-4090", num_gpus=2,
                               dtype="bfloat16")
    weights = 2 * TOTAL                               # bf16, whole on each rank under ZeRO-2
    buckets = 2 * (int(5e8) + int(5e8))               # reduce + allgather buckets, bf16
    held = weights + buckets + 2 * VOCAB * H + 8 * VOCAB * H
    assert e.phase_peaks["backward"] > held
    assert e.phase_peaks["backward"] < held + 2 * 2**30    # activations at 1 x 512: small


def test_overlap_comm_doubles_zero2s_reduce_buffer():
    """``setup_buckets`` (stage_1_and_2.py ~l.3256): one ``reduce_bucket_size`` buffer in the
    reduction dtype, and with ``overlap_comm`` a second ("double buffers to avoid data access
    conflict"); ``DeepSpeedZeroConfig.overlap_comm`` defaults to False below stage 3."""
    from hf_memkit._engines.deepspeed import DEEPSPEED_ENGINE as ds

    def buckets(zero):
        cfg = {"zero_optimization": {"stage": 2, "reduce_bucket_size": int(2e8),
                                     "allgather_bucket_size": int(2e8), **zero}}
        sh = ds.from_args({"deepspeed": cfg, "bf16": True}.get, 2)
        sizes = StateSizes(weight_bytes=2 * TOTAL, grad_bytes=2 * TOTAL, n_trainable=TOTAL,
                           optimizer_state=8 * TOTAL, optimizer_transient=0, load_itemsize=2)
        with torch.device("meta"):
            facts = model_facts(LlamaForCausalLM(LlamaConfig(**CONFIG)))
        return ds.rank_states(sh, sizes, facts, "cuda").buckets

    assert buckets({"overlap_comm": True}) - buckets({}) == 2 * int(2e8)   # one more, bf16
    assert buckets({}) == buckets({"overlap_comm": False})
