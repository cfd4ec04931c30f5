"""The end-to-end slice the README's demo runs: probe, profile, train a tiny Llama on CPU.

Returns data; ``hf-memkit demo`` renders it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from ._device import DeviceInfo, probe_device
from ._profile import ModelProfile, profile_model
from ._rss import current_rss, peak_rss, reset_peak_rss, set_mmap_threshold
from ._synthetic import SyntheticTextDataset, tiny_llama_config


@dataclass
class DemoResult:
    device: DeviceInfo
    profile: ModelProfile
    steps: int
    first_loss: float
    last_loss: float
    seconds: float
    rss_before_train: int
    peak_rss_during_train: int | None
    output_dir: str


def run_demo(output_dir: str | Path = "demo_output", *, steps: int = 40, seq_len: int = 64,
             batch_size: int = 8, seed: int = 0) -> DemoResult:
    set_mmap_threshold()  # before tensors exist: makes the RSS reading track tensor bytes
    device = probe_device()
    config = tiny_llama_config()
    profile = profile_model(config)  # on the meta device: no weights yet
    model = AutoModelForCausalLM.from_config(config)
    data = SyntheticTextDataset(vocab_size=config.vocab_size, seq_len=seq_len,
                                num_samples=steps * batch_size, seed=seed)
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
        learning_rate=5e-3, warmup_steps=2, logging_steps=max(1, steps // 8), report_to="none",
        save_strategy="no", use_cpu=True, seed=seed, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    rss0 = current_rss()
    reset_peak_rss()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    peak = peak_rss()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return DemoResult(device, profile, steps, losses[0], losses[-1], seconds, rss0,
                      None if peak is None else peak - rss0, str(output_dir))
