"""Every phase of a step holds at least the states a rank keeps through the whole step: a phase
peak below them is impossible, whatever the depth extrapolation says."""

from __future__ import annotations

import warnings

import hf_memkit as mk


def test_zero3_phases_never_fall_below_the_resident_optimizer_state():
    """Llama-3.1-8B, ZeRO-3 on 8 ranks, checkpointing, seq 2048: the backward phase was
    extrapolated to -38 GiB (the gradients its 3-block trace held at a later moment than its
    2-block one, scaled to 32 blocks, were taken out of it). DeepSpeed keeps each rank's AdamW
    moments and fp32 master partition resident in every phase: 12 + 4 B per parameter / 8."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory("Llama-3.1-8B", dict(bf16=True, gradient_checkpointing=True,
                                                    per_device_train_batch_size=1,
                                                    deepspeed={"zero_optimization": {"stage": 3}}),
                               seq_len=2048, device="H100-80GB", num_gpus=8)
    resident = 16 * 8_030_261_248 // 8            # AdamW moments + fp32 master, one rank
    assert e.breakdown["optimizer"] >= 8 * 8_030_261_248 // 8
    assert {p: v >= resident for p, v in e.phase_peaks.items()} == \
        {p: True for p in e.phase_peaks}, e.phase_peaks
