"""``MemoryCallback`` on CUDA, through a real ``transformers.Trainer`` on the CPU: the callback
reads a fake GPU machine (``tests.fakes``: torch.cuda's allocator counters, nvidia-ml-py's real
module over a fake NVML library) whose memory a script moves at known points of each step.

Issue 25: defect 10 (one NVML field NVML refuses must not lose the others, and a missing reading
names its real cause), defect 13's collision with ``TrainerMemoryTracker``, and deliverable 3's
metrics (active and reserved peaks, forward / backward / optimizer / eval peaks, other processes
on the device). The cross-rank maximum runs for real in test_memory_callback_ranks.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import hf_memkit as mk
from hf_memkit._callbacks import memory as memory_mod
from hf_memkit._callbacks._readers import CudaReader
from hf_memkit._device import probe as probe_mod
from hf_memkit._device.calibration import load_calibration, save_calibration
from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
from hf_memkit._units import GiB, MiB
from tests.fakes import Machine, a100, h100, install_cuda, install_nvml, mig_uuid_of
from tests.unit.device.test_calibration import make_cal


def gib(n_mib: float) -> float:
    return n_mib * MiB / GiB


class Gpu:
    """One fake machine installed in torch.cuda and NVML; the callback reads CUDA device 0."""

    def __init__(self, machine: Machine, monkeypatch):
        self.machine = machine
        install_nvml(machine, monkeypatch)
        self.cuda = install_cuda(machine, monkeypatch)
        # the Trainer itself runs on the CPU; the callback reads the (fake) CUDA device 0
        monkeypatch.setattr(memory_mod, "make_reader", lambda device: CudaReader(0))

    @property
    def uuid(self) -> str:
        return self.cuda.target(0).uuid

    def alloc(self, mib: float) -> None:
        self.cuda.allocate(int(mib * MiB), 0)

    def free(self, mib: float) -> None:
        self.machine.release(self.uuid, int(mib * MiB))

    def transient(self, mib: float) -> None:
        self.alloc(mib)
        self.free(mib)


class Base(transformers.TrainerCallback):
    """100 MiB of weights on the device once training starts (after the Trainer's set_seed)."""

    def __init__(self, gpu: Gpu):
        self.gpu = gpu

    def on_train_begin(self, args, state, control, **kw):
        self.gpu.alloc(100)


def trainer_for(tmp_path, callbacks, *, steps=4, logging_steps=2, model=None, **kw):
    torch.manual_seed(0)
    model = model or LlamaForCausalLM(tiny_llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128))
    data = SyntheticTextDataset(vocab_size=128, seq_len=16, num_samples=4 * steps)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps,
                             per_device_train_batch_size=4, logging_steps=logging_steps,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, **kw)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks,
                   eval_dataset=data if kw.get("eval_strategy") else None)


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


# ----------------------------------------------------------------------------------------------
# Defect 10: NVML fields fail on their own; a missing reading names its cause
# ----------------------------------------------------------------------------------------------

ESTIMATE = type("Est", (), {"peak_allocated": 400 * MiB, "device_used": 2 * GiB,
                            "device": type("D", (), {"kind": "cuda"})()})()


@pytest.fixture
def mig(monkeypatch, tmp_path):
    """One A100 in MIG mode, this user not root, the instance named in CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    machine = Machine([a100(0x10, 0, migs=[("3g.40gb", 40 * GiB), ("3g.40gb", 40 * GiB)])])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig_uuid_of(0, 0))
    return Gpu(machine, monkeypatch)


def test_mig_unsupported_utilisation_keeps_memory_and_calibration(mig, tmp_path, caplog):
    """Issue 25, defect 10: on a MIG instance NVML answers its memory but not the utilisation
    (NOT_SUPPORTED). Before, that one error dropped memory/nvml_used_gib for the whole run and
    calibrate=True then asked to `pip install nvidia-ml-py`."""
    name = mk.probe_device(0).name
    path = save_calibration(make_cal(gpu=name, torch=torch.__version__, residuals=(0.02,)))
    cb = memory_mod.MemoryCallback(ESTIMATE, calibrate=True, plot=False)
    with caplog.at_level(logging.WARNING):
        trainer_for(tmp_path, [Base(mig), cb], steps=4, logging_steps=1).train()
    instance = mig.machine.target(mig_uuid_of(0, 0))
    used = instance.total - mig.machine.free(instance)      # the instance's, not the card's
    logs = cb.timeline
    assert [r["step"] for r in logs] == [1, 2, 3, 4]
    assert all(r["nvml_used"] == used for r in logs)
    assert all("gpu_util" not in r for r in logs)
    assert all(r["other_processes"] == 0 for r in logs)     # the instance's list: only us
    # the residual of step 3 was recorded from the instance's used memory
    assert load_calibration(path).residuals == pytest.approx((0.02, used / (2 * GiB) - 1))
    text = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in text if "install nvidia-ml-py" in m]
    [util] = [m for m in text if "memory/gpu_util" in m]
    assert "not support" in util and "MIG" in util and "other NVML readings go on" in util


def test_mig_parent_without_root_names_the_cause(mig, monkeypatch, tmp_path, caplog):
    """A reader handed the MIG parent's handle (what nvml_handle gave before it mapped CUDA
    devices through their UUIDs): NVML refuses the parent's memory to non-root users. The
    calibrate warning says so, and never asks to install nvidia-ml-py, which is installed."""
    monkeypatch.setattr(probe_mod, "nvml_handle",
                        lambda pynvml, index: pynvml.nvmlDeviceGetHandleByIndex(0))
    save_calibration(make_cal(gpu=mk.probe_device(0).name, torch=torch.__version__))
    cb = memory_mod.MemoryCallback(ESTIMATE, calibrate=True, plot=False)
    with caplog.at_level(logging.WARNING):
        trainer_for(tmp_path, [Base(mig), cb], steps=3, logging_steps=1).train()
    assert all("nvml_used" not in r for r in cb.timeline)
    text = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in text if "install nvidia-ml-py" in m]
    [calib] = [m for m in text if m.startswith("calibrate=True")]
    assert "denied" in calib and "MIG" in calib and "root" in calib and "MIG-<uuid>" in calib


# ----------------------------------------------------------------------------------------------
# Defect 13: TrainerMemoryTracker (skip_memory_metrics=False) and the callback's resets
# ----------------------------------------------------------------------------------------------


def test_tracker_keeps_its_train_peak(monkeypatch, tmp_path):
    """Issue 25, defect 13: TrainerMemoryTracker resets the peak statistic when train() starts
    and reads it at the end. The callback's resets inside the steps used to shrink the tracker's
    train_mem_gpu_peaked_delta to the peak since the last log; both numbers are right now."""
    gpu = Gpu(Machine([h100(0x10, 0)]), monkeypatch)
    # transformers caches "no CUDA" from its first look; the tracker asks through this name
    monkeypatch.setattr(transformers.trainer_utils, "is_torch_cuda_available", lambda: True)

    class Spike(transformers.TrainerCallback):    # 2 GiB for a moment in step 1 (no log there)
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                gpu.transient(2048)

    cb = memory_mod.MemoryCallback(plot=False, report=False)
    trainer = trainer_for(tmp_path, [Base(gpu), Spike(), cb], steps=4, logging_steps=2,
                          skip_memory_metrics=False)
    out = trainer.train()
    assert out.metrics["train_mem_gpu_peaked_delta"] == 2048 * MiB   # peak 2148 - 100 at end
    assert trainer.state.log_history[-1]["train_mem_gpu_peaked_delta"] == 2048 * MiB
    first, second = train_logs(trainer)
    assert first["memory/peak_allocated_gib"] == pytest.approx(gib(2148))
    assert second["memory/peak_allocated_gib"] == pytest.approx(gib(100))


# ----------------------------------------------------------------------------------------------
# Deliverable 3: the metrics people log and ask for
# ----------------------------------------------------------------------------------------------


def scripted_model(gpu: Gpu):
    """A tiny Llama whose forward and backward move the fake device's memory:
    forward: +300 MiB activations kept for backward, +100 MiB for a moment;
    backward (a hook on the loss): +500 MiB for a moment, then the activations go;
    evaluation forward: +1100 MiB for a moment."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, vocab_size=128))

    def backward(grad):
        gpu.transient(500)
        gpu.free(300)

    def forward(module, args, output):
        if not module.training:
            gpu.transient(1100)
            return
        gpu.alloc(300)
        gpu.transient(100)
        output.loss.register_hook(backward)

    model.register_forward_hook(forward)
    return model


def test_phase_peaks_active_reserved_and_other_processes(monkeypatch, tmp_path):
    gpu = Gpu(Machine([h100(0x10, 0)]), monkeypatch)
    gpu.machine.spawn(4242, gpu.uuid, 3 * GiB)          # a colocated job on the same GPU

    class OptimizerStep(transformers.TrainerCallback):   # runs after MemoryCallback's event
        def on_pre_optimizer_step(self, args, state, control, **kw):
            gpu.transient(200)

    cb = memory_mod.MemoryCallback(plot=False)
    trainer = trainer_for(tmp_path, [Base(gpu), OptimizerStep(), cb], steps=4, logging_steps=2,
                          model=scripted_model(gpu), eval_strategy="steps", eval_steps=2,
                          per_device_eval_batch_size=8)
    trainer.train()
    first, second = train_logs(trainer)
    for h in (first, second):
        assert h["memory/allocated_gib"] == pytest.approx(gib(100))
        assert h["memory/peak_forward_gib"] == pytest.approx(gib(100 + 300 + 100))
        assert h["memory/peak_backward_gib"] == pytest.approx(gib(100 + 300 + 500))
        assert h["memory/peak_fwd_bwd_gib"] == pytest.approx(gib(900))
        assert h["memory/peak_optimizer_gib"] == pytest.approx(gib(300))
        assert h["memory/other_processes_gib"] == pytest.approx(3.0)
        assert h["memory/gpu_util"] == 97
        assert "memory/peak_allocated_rank" not in h                 # one process
    # the evaluation after step 2's log counts in the peak since the previous log of step 4
    assert first["memory/peak_allocated_gib"] == pytest.approx(gib(900))
    assert second["memory/peak_allocated_gib"] == pytest.approx(gib(1200))
    assert first["memory/peak_active_gib"] == pytest.approx(gib(900))
    assert second["memory/peak_active_gib"] == pytest.approx(gib(1200))
    # the caching allocator keeps what it reserved: 900 MiB after step 1, 1200 after the eval
    assert first["memory/peak_reserved_gib"] == pytest.approx(gib(900))
    assert second["memory/reserved_gib"] == pytest.approx(gib(1200))
    assert second["memory/peak_reserved_gib"] == pytest.approx(gib(1200))
    # NVML: the whole device, the colocated job and the driver's reservation included
    h100_gpu = gpu.machine.gpus[0]
    assert second["memory/nvml_used_gib"] * GiB == h100_gpu.total - gpu.machine.free(h100_gpu)
    assert second["memory/nvml_used_gib"] * GiB >= (3 * GiB + 1200 * MiB)
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert all(h["memory/peak_eval_gib"] == pytest.approx(gib(1200)) for h in evals)
    assert [r["peak_eval"] for r in cb.to_report()["evaluations"]] == [1200 * MiB] * 2
