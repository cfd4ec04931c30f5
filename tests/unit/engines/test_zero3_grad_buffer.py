"""DeepSpeed ZeRO-3's flat gradient buffer (issue 45), against a hand count from DeepSpeed's
allocation code (deepspeed 0.19.8) and the model's published shapes.

``DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer`` (deepspeed/runtime/zero/stage3.py,
~l.786) allocates, once, before the first step::

    self.grad_partitions_flat_buffer = torch.zeros(sum(p.partition_numel() for p in all_params),
                                                   dtype=self.gradient_accumulation_dtype,
                                                   device=self.device)

on the accelerator, or on the host with ``offload_optimizer`` (stage3.py ~l.333: ``self.device``
is ``cpu`` then). It lives for the whole run, so every phase holds it, the first forward too.
``partition_numel`` is the parameter's padded size over the world
(partition_parameters.py ``_aligned_size`` / ``_padding_size``: ``ceil(numel / N)``); the
gradient-accumulation dtype is the model's (engine.py ``get_data_types`` ~l.1806: bf16 under
``bf16.enabled`` unless ``data_types.grad_accum_dtype`` says otherwise), 2 bytes a element.

The same ``offload_optimizer`` moves the fp32 master partitions and the optimizer's moments to
the host too (``self.device`` again), so the forward on the accelerator without offload holds at
least master (4) + AdamW's exp_avg and exp_avg_sq (8) + the flat gradient buffer (2) bytes per
partition element more than the forward with it. hf_memkit counts the buffer as 4 bytes per
element (the fp32 gradient partitions; a separate issue): this test bounds it from below by
what DeepSpeed really allocates.
"""

from __future__ import annotations

import math
import warnings

import hf_memkit as mk

WORLD = 8
# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): hidden 4096, intermediate 14336, 32 layers,
# 32 heads of 128 with 8 KV heads, vocabulary 128256, untied head
H, FF, LAYERS, KV, VOCAB = 4096, 14336, 32, 8 * 128, 128256
PER_LAYER = [H * H, KV * H, KV * H, H * H, FF * H, FF * H, H * FF, H, H]  # q k v o gate up down norms
TENSORS = [VOCAB * H] + PER_LAYER * LAYERS + [H, VOCAB * H]          # embed, layers, norm, head


def _forward(offload: bool) -> int:
    zero = {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    args = {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True,
            "deepspeed": {"zero_optimization": zero, "bf16": {"enabled": True}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory("Llama-3.1-8B", args, seq_len=512, device="H100-80GB",
                               num_gpus=WORLD)
    return e.phase_peaks["forward"]


def test_zero3_forward_already_holds_the_flat_gradient_partition_buffer():
    assert sum(TENSORS) == 8_030_261_248          # the published 8.03B parameters
    partition = sum(math.ceil(n / WORLD) for n in TENSORS)   # sum of partition_numel()
    grad_buffer = 2 * partition                   # bf16 grad_partitions_flat_buffer
    master_and_moments = (4 + 8) * partition      # fp32 partitions, AdamW exp_avg + exp_avg_sq
    moved = _forward(offload=False) - _forward(offload=True)
    assert moved >= master_and_moments + grad_buffer, (moved, master_and_moments, grad_buffer)
    # ... and nothing near a second copy of the model states (bounds the check from above)
    assert moved < master_and_moments + 3 * grad_buffer
