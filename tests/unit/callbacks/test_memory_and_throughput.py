"""MemoryCallback and ThroughputCallback without a training run: only the main process logs, a run
stopped before training began leaves nothing behind, and the FLOPs-per-token formula for full and
LoRA training (the callbacks through the real Trainer: tests/integration/test_callbacks.py)."""

from __future__ import annotations

import os

import torch
from transformers import LlamaForCausalLM, TrainingArguments
from transformers.trainer_callback import TrainerState

from hf_memkit._callbacks import memory as memory_mod
from hf_memkit._callbacks.throughput import flops_per_token, flops_per_token_terms
from hf_memkit._run.synthetic import tiny_llama_config
from hf_memkit.callbacks import MemoryCallback
from tests.helpers import require


def test_only_main_process_logs(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state = TrainerState()
    state.is_world_process_zero = False
    cb = MemoryCallback()
    cb.on_train_begin(args, state, None)
    logs = {"loss": 1.0}
    cb.on_log(args, state, None, logs=logs)
    cb.on_train_end(args, state, None)
    assert logs == {"loss": 1.0} and not os.path.exists(tmp_path / "memory_report.json")


def test_memory_callback_end_without_begin_is_harmless(tmp_path):
    """A run stopped before training began: the train-end work writes nothing and does not raise."""
    from transformers import TrainingArguments
    from transformers.trainer_callback import TrainerControl, TrainerState

    cb = memory_mod.MemoryCallback()
    args = TrainingArguments(output_dir=str(tmp_path / "never"), use_cpu=True, report_to=[])
    cb.on_train_end(args, TrainerState(), TrainerControl())
    assert not (tmp_path / "never").exists() and cb.report_path is None


def test_flops_formula_full_and_lora():
    torch.manual_seed(0)
    cfg = tiny_llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            vocab_size=128)
    model = LlamaForCausalLM(cfg)
    t = flops_per_token_terms(model)
    n = sum(p.numel() for p in model.parameters()) - 128 * 64   # input embedding: a lookup
    assert t["N"] == n and t["N_trainable"] == n and (t["L"], t["h"]) == (2, 64)
    mf, hf = flops_per_token(t, 32)
    assert mf == 6 * n + 12 * 2 * 64 * 32 and hf == mf
    _, hf_ckpt = flops_per_token(t, 32, checkpointing=True)
    assert hf_ckpt == mf + 2 * n + 4 * 2 * 64 * 32
    peft = require("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    t = flops_per_token_terms(lora)
    nt = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert t["N_trainable"] == nt and t["N"] == n + nt
    mf, _ = flops_per_token(t, 32)
    assert mf == 4 * (n + nt) + 2 * nt + 12 * 2 * 64 * 32
