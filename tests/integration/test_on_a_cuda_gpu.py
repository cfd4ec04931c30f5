"""What only a real CUDA GPU can show (``gpu``-marked; skipped without one): the NVML readings of
``MemoryCallback`` against NVML read directly, the OOM guard recovering from a real CUDA
out-of-memory error, and ``hf-memkit calibrate --check``. The CPU tests drive the same code
through ``tests.fakes`` and injected errors; these run it on the device, in the command
DEVELOPERS.md gives a session that is lent one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
from hf_memkit._units import GiB, MiB
from hf_memkit.callbacks import MemoryCallback, OOMGuardTrainer
from tests.helpers import require

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 32000


def _model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=4, vocab_size=VOCAB))


def _args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", disable_tqdm=True,
                dataloader_num_workers=0, learning_rate=1e-4, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


def test_memory_callback_logs_what_nvml_and_the_allocator_read(tmp_path):
    pynvml = require("pynvml")
    from hf_memkit._device.nvml import nvml_handle

    pynvml.nvmlInit()
    handle = nvml_handle(pynvml, torch.cuda.current_device())
    direct: list[dict] = []

    class ReadNvml(transformers.TrainerCallback):  # after MemoryCallback's own on_log
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "memory/allocated_gib" in logs:
                torch.cuda.synchronize()
                procs = []
                try:
                    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except pynvml.NVMLError:
                    pass
                mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid()
                        and p.usedGpuMemory is not None]
                direct.append({"logs": dict(logs), "used": pynvml.nvmlDeviceGetMemoryInfo(
                    handle).used, "mine": mine[0] if mine else None,
                    "reserved": torch.cuda.memory_reserved(),
                    "allocated": torch.cuda.memory_allocated()})

    model = _model()
    params = sum(p.numel() for p in model.parameters())
    data = SyntheticTextDataset(vocab_size=VOCAB, seq_len=512, num_samples=32)
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path, max_steps=4, per_device_train_batch_size=4,
                                logging_steps=2, bf16=True),
        train_dataset=data, callbacks=[MemoryCallback(plot=False, report=False), ReadNvml()])
    trainer.train()
    pynvml.nvmlShutdown()
    assert len(direct) == 2, trainer.state.log_history
    for d in direct:
        logs = d["logs"]
        # the whole device as nvidia-smi shows it: read a moment apart, within 64 MiB
        assert abs(logs["memory/nvml_used_gib"] * GiB - d["used"]) <= 64 * MiB, (logs, d)
        if d["mine"] is not None:  # NVML lists this process (gVisor and MIG may not)
            assert abs(logs["memory/process_used_gib"] * GiB - d["mine"]) <= 64 * MiB
            assert d["mine"] >= d["reserved"]  # the context is on top of the segments
        assert abs(logs["memory/reserved_gib"] * GiB - d["reserved"]) <= 2 * MiB
        # a step holds fp32 weights, gradients and AdamW's two moments at least
        assert logs["memory/peak_allocated_gib"] * GiB >= 16 * params
        assert logs["memory/peak_allocated_gib"] <= logs["memory/peak_reserved_gib"] + 1e-9
        assert logs["memory/nvml_used_gib"] * GiB >= d["reserved"]


def _peak_reserved(tmp_path, batch: int) -> int:
    model = _model()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    data = SyntheticTextDataset(vocab_size=VOCAB, seq_len=1024, num_samples=batch * 2)
    transformers.Trainer(model=model, args=_args(tmp_path / f"b{batch}", max_steps=2,
                                                 per_device_train_batch_size=batch),
                         train_dataset=data).train()
    peak = torch.cuda.max_memory_reserved()
    del model
    torch.cuda.empty_cache()
    return peak


def test_the_oom_guard_recovers_from_a_real_cuda_oom(tmp_path):
    """The allocator is capped just above what a micro-batch of 2 needs (measured first), and
    the run asks for 8: its forward runs out of device memory for real; the guard halves the
    micro-batch (8 -> 4 -> 2) keeping the effective batch, and the run ends its steps."""
    two, one = _peak_reserved(tmp_path, 2), _peak_reserved(tmp_path, 1)
    assert two > one
    cap = two + (two - one) // 2
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        data = SyntheticTextDataset(vocab_size=VOCAB, seq_len=1024, num_samples=16)
        trainer = OOMGuardTrainer(model=_model(), args=_args(
            tmp_path / "guarded", max_steps=2, per_device_train_batch_size=8, logging_steps=1),
            train_dataset=data, max_oom_recoveries=3)
        trainer.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert trainer.state.global_step == 2
    rec = trainer.oom_recoveries
    assert rec and all(r.where == "forward/backward" for r in rec), rec
    assert "out of memory" in rec[0].cause.lower(), rec[0].cause
    assert rec[-1].micro_batch_size * rec[-1].gradient_accumulation_steps == 8
    assert rec[-1].micro_batch_size <= 4
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses


def test_calibrate_and_its_check_on_this_gpu(tmp_path):
    env = dict(os.environ, HF_MEMKIT_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", "from hf_memkit.commands.main import main; raise SystemExit("
           "main())", "calibrate", "--json", "--check"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(p.stdout[p.stdout.index("{"):])
    cal = doc["calibration"]
    assert cal["gpu"] == torch.cuda.get_device_name(0)
    assert 100 * MiB < cal["context"] < 4 * GiB and cal["context_at_init"] <= cal["context"]
    assert 1.0 <= cal["reserved_over_allocated"] < 2.0
    assert doc["checks"], doc
    for row in doc["checks"]:
        for key in ("allocated", "reserved", "device_used"):
            err = row["predicted"][key] / row["measured"][key] - 1
            assert abs(err) <= 0.10, (row["name"], key, row["predicted"], row["measured"])
