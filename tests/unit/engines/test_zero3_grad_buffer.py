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
master (4) + AdamW's exp_avg and exp_avg_sq (8) + the flat gradient buffer (2) bytes per
partition element more than the forward with it: exactly that, since nothing else moves.

The step (``DeepSpeedZeroOptimizer_Stage3.step``) then goes over the partition one sub-group at a
time: ``_prepare_fp32_grad_for_sub_group`` (stage3.py ~l.2683) flattens the sub-group's bf16
gradient partitions (``self.flatten``: a copy, 2 B an element) and casts the copy to fp32 (4 B),
the fp32 partition's ``.grad`` through ``_optimizer_step`` until ``_release_sub_group``. Sub-groups
come from ``_create_fp16_sub_groups`` (~l.1210), per optimizer param group, closing at the
parameter that takes the running sum of ``partition_numel()`` to ``sub_group_size`` (1e9 by
default, ``DeepSpeedZeroConfig``). The Trainer's param groups: decayed matrices, and norms.
"""

from __future__ import annotations

import math
import warnings

import pytest

import hf_memkit as mk

WORLD = 8
# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): hidden 4096, intermediate 14336, 32 layers,
# 32 heads of 128 with 8 KV heads, vocabulary 128256, untied head
H, FF, LAYERS, KV, VOCAB = 4096, 14336, 32, 8 * 128, 128256
PER_LAYER = [H * H, KV * H, KV * H, H * H, FF * H, FF * H, H * FF, H, H]  # q k v o gate up down norms
TENSORS = [VOCAB * H] + PER_LAYER * LAYERS + [H, VOCAB * H]          # embed, layers, norm, head


def _phases(offload: bool = False, sub_group: int | None = None) -> dict[str, int]:
    zero = {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
            **({"sub_group_size": sub_group} if sub_group else {})}
    args = {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True,
            "deepspeed": {"zero_optimization": zero, "bf16": {"enabled": True}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory("Llama-3.1-8B", args, seq_len=512, device="H100-80GB",
                               num_gpus=WORLD)
    return e.phase_peaks


def test_zero3_forward_already_holds_the_flat_gradient_partition_buffer():
    assert sum(TENSORS) == 8_030_261_248          # the published 8.03B parameters
    partition = sum(math.ceil(n / WORLD) for n in TENSORS)   # sum of partition_numel()
    grad_buffer = 2 * partition                   # bf16 grad_partitions_flat_buffer
    master_and_moments = (4 + 8) * partition      # fp32 partitions, AdamW exp_avg + exp_avg_sq
    moved = _phases(offload=False)["forward"] - _phases(offload=True)["forward"]
    # fp32 gradient partitions (4 B) would move 2 B more an element: 14% more than this
    assert moved == pytest.approx(master_and_moments + grad_buffer, rel=0.005)


def _largest_sub_group(sub_group: int) -> int:
    decay = [n for n in TENSORS if n > H]         # the Trainer's decayed group: the matrices
    largest, running = 0, 0
    for i, n in enumerate(decay):
        running += math.ceil(n / WORLD)
        if running >= sub_group or i == len(decay) - 1:
            largest, running = max(largest, running), 0
    return largest


def test_zero3_step_casts_one_sub_group_of_gradients_to_fp32():
    big, small = _largest_sub_group(int(1e9)), _largest_sub_group(int(2e8))
    assert (big, small) == (1_003_749_376, 205_520_896)   # one sub-group, then five
    # bf16 flatten + fp32 cast of the largest sub-group (adamw_torch_fused: no temporaries)
    expected = 6 * (big - small)
    grew = _phases(sub_group=int(1e9))["optimizer step"] - \
        _phases(sub_group=int(2e8))["optimizer step"]
    # hf_memkit bounds a sub-group by sub_group_size + one parameter's partition (the head's)
    slack = 6 * math.ceil(VOCAB * H / WORLD)
    assert abs(grew - expected) <= slack, (grew, expected)


def test_grpo_generation_under_zero3_holds_the_gradient_buffer():
    """GRPO generates between optimizer steps: ZeRO-3's flat gradient buffer, allocated before
    the first step, is alive then too (as the master partitions and the moments are)."""
    def generate(offload: bool) -> int:
        zero = {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        args = {"per_device_train_batch_size": 4, "bf16": True, "num_generations": 4,
                "max_completion_length": 64,
                "deepspeed": {"zero_optimization": zero, "bf16": {"enabled": True}}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = mk.estimate_memory("Llama-3.2-1B", args, seq_len=128, device="H100-80GB",
                                   num_gpus=4, trainer="grpo")
        return e.phase_peaks["generate (decode)"]

    n = mk.profile_model("Llama-3.2-1B").total_params     # all trained, tied head
    moved = generate(False) - generate(True)
    # master (4) + AdamW moments (8) + bf16 gradient buffer (2) per partition element
    assert moved == pytest.approx(14 * n / 4, rel=1e-3)
