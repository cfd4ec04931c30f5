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


# ----------------------------------------------------------------------------------------------
# The pieces of issue 25's readings: the cross-rank encoding, the reduction's device, the phases
# ----------------------------------------------------------------------------------------------


def test_rank_encoding_gives_the_max_and_the_lowest_rank_holding_it():
    from hf_memkit._callbacks._ranks import decode, encode

    keys = ("a", "b", "c", "d")
    per_rank = [{"a": 5, "b": 7, "c": None, "d": None},
                {"a": 9, "b": 7, "c": 3, "d": None},
                {"a": 1, "b": 2, "c": None, "d": None}]
    enc = [encode(v, keys, r, 3) for r, v in enumerate(per_rank)]
    best = [max(col) for col in zip(*enc, strict=True)]   # what all_reduce(MAX) computes
    values, ranks = decode(best, keys, 3)
    assert values == {"a": 9, "b": 7, "c": 3, "d": None}
    assert ranks == {"a": 1, "b": 0, "c": 1}              # a tie goes to the lowest rank


def test_reduction_tensor_lives_where_the_backend_reduces(monkeypatch):
    from hf_memkit._callbacks import _ranks

    for backend, device, want in (("gloo", torch.device("cuda", 3), "cpu"),
                                  ("cpu:gloo,cuda:nccl", torch.device("cuda", 3), "cpu"),
                                  ("nccl", torch.device("cuda", 3), "cuda:3")):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, _b=backend: _b)
        assert str(_ranks.collective_device(device)) == want
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert str(_ranks.collective_device(torch.device("cpu"))) == "cuda:1"
    assert _ranks.world() is None                         # no process group here


def test_phases_split_forward_and_backward_over_micro_batches():
    from hf_memkit._callbacks._phases import StepPhases

    readings = iter([10, 50, 80, 40, 60])
    phases = StepPhases(lambda: next(readings))
    model = torch.nn.Linear(2, 2)
    assert phases.attach(model)
    model(torch.ones(2))                                  # not armed: no reading
    phases.arm()
    model(torch.ones(2))      # before the first forward: 10; forward 1: 50
    model(torch.ones(2))      # backward 1: 80; forward 2: 40
    got = phases.finish(90)   # backward 2 and clipping, up to on_pre_optimizer_step
    assert got == {"forward": 50, "backward": 90, "fwd_bwd": 90}
    model(torch.ones(2))                                  # disarmed again
    phases.detach()
    assert next(readings) == 60                           # nothing read since
    phases.arm()              # detached: no hooks, so one window for forward + backward
    assert phases.finish(30) == {"fwd_bwd": 30}
