"""``MemoryCallback(calibrate=True)``: a real ``transformers.Trainer`` on CPU, the callback reading
a fake CUDA device and NVML, writes one residual into the stored calibration (the store and
``hf-memkit calibrate`` themselves: tests/unit/device/test_calibration.py)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

from hf_memkit import MemoryCallback
from hf_memkit._callbacks import memory as memory_mod
from hf_memkit._callbacks._readers import CudaReader
from hf_memkit._device.calibration import load_calibration, save_calibration
from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
from hf_memkit._units import GiB, MiB
from tests.helpers import A100_80
from tests.unit.device.test_calibration import make_cal


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"


class FakeStats:
    def __init__(self):
        self.allocated, self.reserved = 100 * MiB, 128 * MiB

    def memory_allocated(self, i=None):
        return self.allocated

    def memory_reserved(self, i=None):
        return self.reserved

    def max_memory_allocated(self, i=None):
        return self.allocated

    def reset_peak_memory_stats(self, i=None):
        pass


@pytest.fixture
def cuda_callback_env(cache, fake_cuda, monkeypatch):
    """One fake A100 where this process holds 1000 MiB + 100 MiB x step, beside another
    process (5 GiB) and the driver's reservation (500 MiB): device_used, and so the residual,
    is this process's own (issue 25, defect 8), not the device-wide used."""
    gpu = dataclasses.replace(A100_80, free=A100_80.total)
    machine = fake_cuda([gpu])
    machine.spawn(9999, machine.gpus[0].uuid, 5 * GiB)
    machine.gpus[0].reserved = 500 * MiB
    gpu.hold = lambda n: machine.this.context.__setitem__(machine.gpus[0].uuid, n)
    stats = FakeStats()
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                 "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(stats, name))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # the Trainer itself runs on the CPU; the callback reads the (fake) CUDA device
    monkeypatch.setattr(memory_mod, "make_reader", lambda device: CudaReader(0))
    return gpu


def used_at(step: int) -> int:
    return 1000 * MiB + 100 * MiB * step


def train_with(tmp_path, gpu, callback, *, steps=6, logging_steps=1):
    class Script(memory_mod.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if hasattr(gpu, "hold"):    # a fake CUDA machine is installed
                gpu.hold(used_at(state.global_step + 1))

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, vocab_size=128))
    data = SyntheticTextDataset(vocab_size=128, seq_len=16, num_samples=4 * steps)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps,
                             per_device_train_batch_size=4, logging_steps=logging_steps,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Script(), callback]).train()


ESTIMATE = types.SimpleNamespace(peak_allocated=400 * MiB, device_used=2 * GiB,
                                 device=types.SimpleNamespace(kind="cuda"))


@pytest.mark.parametrize("logging_steps, step", [(1, 3), (2, 4)])
def test_memory_callback_writes_one_residual_from_step_3(cuda_callback_env, tmp_path,
                                                         logging_steps, step):
    gpu = cuda_callback_env
    path = save_calibration(make_cal(gpu=gpu.name, torch=torch.__version__, residuals=(0.02,)))
    train_with(tmp_path, gpu, MemoryCallback(ESTIMATE, calibrate=True, plot=False),
               logging_steps=logging_steps)
    assert load_calibration(path).residuals == pytest.approx((0.02, used_at(step) / (2 * GiB) - 1))


def test_memory_callback_without_a_calibration_warns_once(cuda_callback_env, tmp_path, cache,
                                                          caplog):
    with caplog.at_level("WARNING"):
        train_with(tmp_path, cuda_callback_env, MemoryCallback(ESTIMATE, calibrate=True,
                                                               plot=False))
    msgs = [r.message for r in caplog.records if "hf-memkit calibrate" in r.message]
    assert len(msgs) == 1 and "no calibration stored for NVIDIA A100-SXM4-80GB" in msgs[0]
    assert not cache.exists() or not any(cache.iterdir())


def test_memory_callback_survives_a_corrupt_calibration(cuda_callback_env, tmp_path, caplog):
    """The broken file is skipped with a warning naming it (find_calibration); the callback then
    finds no calibration, says so once, and writes nothing over the file."""
    path = save_calibration(make_cal(gpu=cuda_callback_env.name, torch=torch.__version__))
    path.write_text("{broken")
    with caplog.at_level("WARNING"), pytest.warns(UserWarning, match="is corrupt") as warned:
        train_with(tmp_path, cuda_callback_env, MemoryCallback(ESTIMATE, calibrate=True,
                                                               plot=False))
    assert any(str(path) in str(w.message) and "re-run `hf-memkit calibrate`" in str(w.message)
               for w in warned)
    assert sum("no calibration stored" in r.message for r in caplog.records) == 1
    assert path.read_text() == "{broken"


def test_memory_callback_calibrate_needs_cuda_and_an_estimate(tmp_path, cache, caplog):
    gpu = dataclasses.replace(A100_80)
    with caplog.at_level("WARNING"):
        train_with(tmp_path, gpu, MemoryCallback(ESTIMATE, calibrate=True, plot=False), steps=3)
    assert sum("calibrate=True needs CUDA" in r.message for r in caplog.records) == 1
    # a CPU estimate or none at all gives no device_used to compare with NVML
    cpu_estimate = types.SimpleNamespace(peak_allocated=1, device_used=1,
                                         device=types.SimpleNamespace(kind="cpu"))
    assert memory_mod.predicted_device_used(cpu_estimate) is None
    assert memory_mod.predicted_device_used(None) is None
    plan = types.SimpleNamespace(estimate=ESTIMATE)
    assert memory_mod.predicted_device_used(plan) == 2 * GiB
